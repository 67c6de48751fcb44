"""Membership: bootstrap, heartbeats with peer exchange, and expiry of silent peers.

Owns the protocol that keeps every node's ``PeerTable`` converging on the whole swarm:

- Every ``heartbeat_s`` (jittered) a node sends ``Hello`` (its own record plus its table,
  each entry stamped with its age) to up to ``fanout`` random live peers, and to every
  bootstrap or LAN-sighted address that no live peer currently holds. The reply,
  ``Welcome``, carries the other side's record and table. Both sides merge what they hear,
  so one contact is enough to learn the whole swarm within a few rounds.
- A peer heard of by no one for ``ttl_s`` expires; ``Leave`` removes one at once.
- The address of a peer that expired (not one that left) is contacted again, with a
  backoff from ``ttl_s`` up to ``LOST_RETRY_MAX_S``, for ``LOST_FORGET_S``: after a network
  partition heals, that is how the two sides find each other again when nothing else would
  (a zeroconf sighting is reported once, and a bootstrap peer may be on the far side).
- Only peers of the same swarm name and model fingerprint are admitted; others are refused
  with code ``wrong_swarm`` and never enter the table.

``IntroducingTransport`` applies one rule of this protocol to every other request: a peer
that refuses us as ``unknown_peer`` (it has not heard of us yet; keyed swarms refuse
strangers' microbatches and gossip) is sent one ``Hello`` and asked once more.

Does not own discovery on the LAN (``swarm.discovery`` feeds addresses in through
``add_address``), nor sockets (the ``Transport`` seam), nor what the table is used for.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from protocol.messages import Hello, Leave, Message, PeerRecord, Welcome, expect
from swarm.peers import PeerTable
from swarm.seams import Clock, Refused, Transport, TransportError

log = logging.getLogger(__name__)

LOST_RETRY_MAX_S = 30.0
"""Longest wait between two contacts of an expired peer's address."""
LOST_FORGET_S = 3600.0
"""How long an expired peer's address is contacted again before it is forgotten."""


@dataclass(frozen=True)
class MembershipConfig:
    heartbeat_s: float = 1.0
    """Seconds between heartbeat rounds (each round is jittered by +-20 %)."""
    ttl_s: float = 8.0
    """A peer nobody has heard from for this long is considered gone."""
    fanout: int = 8
    """Live peers contacted per heartbeat round (all of them in a small swarm)."""
    request_timeout_s: float = 3.0
    """Deadline of one Hello exchange."""
    max_peers: int = 4096
    """Most peers a table holds: news of more is ignored until some expire or leave."""


class MembershipService:
    """Keeps ``table`` current by talking to peers through ``transport``."""

    def __init__(
        self,
        config: MembershipConfig,
        *,
        swarm: str,
        fingerprint: str,
        table: PeerTable,
        transport: Transport,
        clock: Clock,
        self_record: Callable[[], PeerRecord],
        rng: random.Random,
    ) -> None:
        self.config = config
        self.swarm = swarm
        self.fingerprint = fingerprint
        self.table = table
        self.transport = transport
        self.clock = clock
        self.self_record = self_record
        self.rng = rng
        self.bootstrap: list[str] = []
        self._sighted: set[str] = set()
        self._lost: dict[str, _Lost] = {}  # addresses of expired peers, retried with backoff
        self.observed_host: str | None = None
        self.num_rounds = 0

    def add_bootstrap(self, addresses: list[str]) -> None:
        """Addresses to keep contacting while no live peer answers from them."""
        self.bootstrap.extend(a for a in addresses if a not in self.bootstrap)

    def add_address(self, address: str) -> None:
        """An address seen on the LAN; contacted in the next round unless already known."""
        if address != self.self_record().address:
            self._sighted.add(address)

    async def run(self) -> None:
        """Heartbeat rounds until cancelled."""
        while True:
            await self.round()
            jitter = 1.0 + 0.2 * (2 * self.rng.random() - 1)
            await self.clock.sleep(self.config.heartbeat_s * jitter)

    async def round(self) -> None:
        """One heartbeat round: expire, then exchange with a sample of peers and new addresses."""
        now = self.clock.now()
        addresses = {p.peer_id: p.address for p in self.table.records()}
        for peer_id in self.table.expire(now):
            log.info("peer %s expired (silent for %.0fs)", peer_id[:8], self.config.ttl_s)
            wait_s = self.config.ttl_s
            self._lost.setdefault(addresses[peer_id], _Lost(now, now + wait_s, wait_s))
        peers = self.table.records()
        sample = self.rng.sample(peers, min(self.config.fanout, len(peers)))
        targets = {p.address for p in sample}
        held = {p.address for p in peers} | {self.self_record().address}
        targets |= {a for a in (*self.bootstrap, *self._sighted) if a not in held}
        targets |= self._lost_due(now, held)
        self._sighted -= targets
        await asyncio.gather(*(self.contact(a) for a in sorted(targets)))
        self.num_rounds += 1

    def _lost_due(self, now: float, held: set[str]) -> set[str]:
        """Addresses of expired peers due for another try; each try doubles the next wait."""
        due = set()
        for address, lost in list(self._lost.items()):
            if address in held or now - lost.since_s > LOST_FORGET_S:
                del self._lost[address]  # back in the table (or given up on)
            elif now >= lost.next_s:
                due.add(address)
                lost.wait_s = min(2 * lost.wait_s, LOST_RETRY_MAX_S)
                lost.next_s = now + lost.wait_s
        return due

    async def contact(self, address: str) -> bool:
        """Exchange tables with the node at ``address``; False if it did not answer."""
        hello = Hello(
            swarm=self.swarm,
            fingerprint=self.fingerprint,
            sender=self.self_record(),
            peers=self.table.for_exchange(self.clock.now()),
        )
        try:
            reply = await self.transport.request(address, hello, self.config.request_timeout_s)
            welcome = expect(reply, Welcome)
        except (TransportError, ValueError) as e:
            log.debug("hello to %s failed: %s", address, e)
            return False
        if (welcome.swarm, welcome.fingerprint) != (self.swarm, self.fingerprint):
            return False
        self.observed_host = welcome.observed_host
        self._merge(welcome.sender, welcome.peers, address)
        return True

    def handle_hello(self, hello: Hello, observed_host: str) -> Welcome:
        """Answer a peer's heartbeat: merge its news and return ours."""
        if hello.swarm != self.swarm or hello.fingerprint != self.fingerprint:
            raise Refused(
                "wrong_swarm",
                f"this node is in swarm {self.swarm!r} with model {self.fingerprint}; "
                f"you are in {hello.swarm!r} with {hello.fingerprint}",
            )
        self._merge(hello.sender, hello.peers, hello.sender.address)
        return Welcome(
            swarm=self.swarm,
            fingerprint=self.fingerprint,
            sender=self.self_record(),
            peers=self.table.for_exchange(self.clock.now()),
            observed_host=observed_host,
        )

    def handle_leave(self, leave: Leave) -> None:
        if self.table.remove(leave.peer_id, self.clock.now()):
            log.info("peer %s left", leave.peer_id[:8])

    async def leave_all(self, timeout_s: float) -> None:
        """Tell every live peer we are leaving (best effort, concurrently, bounded time)."""
        msg = Leave(peer_id=self.self_record().peer_id)

        async def tell(address: str) -> None:
            try:
                await self.transport.request(address, msg, timeout_s)
            except TransportError as e:
                log.debug("leave to %s failed: %s", address, e)

        await asyncio.gather(*(tell(p.address) for p in self.table.records()))

    def _merge(self, sender: PeerRecord, peers: list[PeerRecord], address: str) -> None:
        now = self.clock.now()
        if self.table.observe(sender, now):
            log.info("peer %s joined: stage %d at %s", sender.peer_id[:8], sender.stage, address)
        for record in peers:
            if self.table.observe(record, now, record.age_s, relayed=True):
                log.info(
                    "learned of peer %s: stage %d at %s via %s",
                    record.peer_id[:8],
                    record.stage,
                    record.address,
                    sender.peer_id[:8],
                )


@dataclass
class _Lost:
    """An expired peer's address: when it was lost, and when to try it next."""

    since_s: float
    next_s: float
    wait_s: float


class IntroducingTransport:
    """A ``Transport`` that says hello to a peer that does not know this node yet.

    A request refused with ``unknown_peer`` is followed by ``introduce(address)`` (a
    membership ``Hello``, ``MembershipService.contact``) and, if the peer answered it, sent
    once more within what is left of the same deadline. Hops, gossip and recovery requests
    go through it; membership itself uses the plain transport (a refused hello is final).
    """

    def __init__(
        self, inner: Transport, introduce: Callable[[str], Awaitable[bool]], clock: Clock
    ) -> None:
        self.inner = inner
        self.introduce = introduce
        self.clock = clock

    async def request(
        self, address: str, msg: Message, timeout_s: float, peer_id: str = ""
    ) -> Message:
        start = self.clock.now()
        try:
            return await self.inner.request(address, msg, timeout_s, peer_id)
        except TransportError as e:
            if e.code != "unknown_peer" or not await self.introduce(address):
                raise
        left_s = max(0.1, timeout_s - (self.clock.now() - start))
        return await self.inner.request(address, msg, left_s, peer_id)
