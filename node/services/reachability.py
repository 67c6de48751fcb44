"""Reachability: whether peers can dial this node, known from peers rather than guessed.

Most volunteers sit behind a home router or a carrier NAT: they dial out, nobody dials in,
and every hop is a request *to* the node serving the next stage. A node that cannot be
dialled serves nothing, so it must know it (libp2p's AutoNAT asks the same question the same
way: peers dial back). This module owns both sides of the check:

- **asking.** Before a node takes a stage, and whenever the address it announces changes, it
  asks up to ``NUM_ASKED`` peers to dial it back at that address with a fresh nonce
  (``DialBack``). It is ``direct`` when a peer connected and the nonce arrived here,
  ``unreachable`` when peers answered and none could connect, and ``unknown`` while there
  is nobody to ask (the swarm's first node) or nobody answered. A peer that does not answer
  says nothing about this node, so a check nobody answered leaves an earlier verdict about
  the same address as it was; a check none of whose peers answered asks the next
  ``NUM_ASKED`` candidates, up to ``MAX_ASKED`` peers (each silent one costs the request's
  timeout, so a check that has an answer looks no further). Peers are asked by standing
  (``asking_waves``): those attached to this node as their relay first, then those that
  have spoken to it (a joiner's bootstrap answered it), then the rest (a joiner's fellow
  joiners, known only from others, perhaps behind NATs whose private addresses swallow a
  request until its timeout), and no wave mixes two standings, so a likely answer is not
  held up by a silent peer. Within a standing, in ``swarm.peers.dialled_first`` order:
  direct ones serving a stage (they passed this check themselves), then other direct ones
  (a volunteer that has just joined may sit behind a NAT it has not found yet), then
  relayed ones, which refuse dial-backs (the asker's host would be only its relay's word)
  unless the asker is their relay: a request their relay sends itself comes over the
  connection they opened to its host, so they dial that host back. A joining node whose
  check nobody answered asks again as soon as a peer attaches to it, and so does a node
  serving ``unknown`` (the swarm's first, which had nobody to ask): a public node whose only
  peers are NATed joiners is verified by the first one that takes it as relay.
  The verdict, with one line of advice, is logged, shown by ``node status`` and exported as
  a metric.
- **answering.** A peer's ``DialBack`` is dialled back only at the host its request came
  from, so nobody can make this node connect anywhere else (a host that announces another
  address than it connects from is behind a NAT, and is told so without a dial); at most
  ``MAX_DIALS`` at once, each within ``DIAL_TIMEOUT_S``. An asker that could not be dialled
  is avoided by this node's router for ``AVOID_S``.
- **arriving.** A ``DialProbe`` carrying a nonce this node issued proves a dial-back reached
  it (a peer's word alone is not enough: it could be wrong or lie).

- **relays.** A node peers cannot dial serves through relays (``node.net.relay``) when it
  can attach to one: it is then ``relayed``, and says through which; it keeps
  ``net.relays`` of them, replaces one that dies and finds one again after losing all.
  ``net.force_relay`` skips the check. A node ``unreachable`` with no relay is not
  servable: ``until_servable`` holds its join (no stage), trying again every
  ``net.reachability_retry_s``. Nor is one whose check no peer answered: it asks again up
  to ``UNANSWERED_TRIES`` times before it serves unverified (the swarm's first node, with
  nobody to ask, serves at once). A relay-only node (``--stage relay``) only checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from node.config import parse_hostport
from node.context import NodeContext
from node.net.addresses import DIRECT, RELAYED, UNKNOWN, UNREACHABLE
from node.net.relay import RelayClient
from protocol.messages import Ack, DialBack, DialBackResult, DialProbe, PeerRecord, expect
from swarm.peers import dialled_first
from swarm.seams import Refused, TransportError

log = logging.getLogger(__name__)

NUM_ASKED = 2
"""Peers asked at once in one check."""
MAX_ASKED = 6
"""Peers asked at most in one check, when those asked first do not answer."""
UNANSWERED_TRIES = 3
"""Checks nobody answered before a joining node serves unverified (``until_servable``)."""
RECHECK_UNANSWERED_S = 5.0
"""How soon a joining node asks again after a check nobody answered (at most
``net.reachability_retry_s``)."""
DIAL_TIMEOUT_S = 3.0
"""How long a dial-back may take (a connection and one small request)."""
MAX_DIALS = 4
"""Dial-backs this node makes for others at once; more requests are answered busy."""
AVOID_S = 60.0
"""How long this node's router avoids a peer it could not dial back."""
RECHECK_UNKNOWN_S = 30.0
"""A node that found nobody to ask checks again this often once peers are known."""
RELAY_WAIT_S = 2.0
"""How often a node forced to relay (``net.force_relay``) looks for a relay until it has one."""


def asking_waves(
    ranked: list[PeerRecord], standing: Callable[[PeerRecord], int]
) -> list[list[PeerRecord]]:
    """The first ``MAX_ASKED`` peers of ``ranked`` by ``standing`` (lowest first; ties keep
    ``ranked``'s order), in the waves a check asks them in: at most ``NUM_ASKED`` at once,
    and no wave mixes two standings, so a peer likely to answer is not held up by an
    unlikely one (a wave waits for all its peers, and a silent one costs a full timeout)."""
    waves: list[list[PeerRecord]] = []
    last = None
    for rank, p in sorted(((standing(p), p) for p in ranked), key=lambda rp: rp[0])[:MAX_ASKED]:
        if not waves or rank != last or len(waves[-1]) >= NUM_ASKED:
            waves.append([])
        waves[-1].append(p)
        last = rank
    return waves


class ReachabilityService:
    """This node's reachability (asking) and its dial-backs for peers (answering)."""

    def __init__(
        self,
        ctx: NodeContext,
        relays: RelayClient,
        attached: Callable[[str], bool] = lambda peer_id: False,
    ) -> None:
        self.ctx = ctx
        self.relays = relays
        """This node's relays, used while peers cannot dial it."""
        self.attached = attached
        """Whether a peer is attached to this node as its relay (``RelayHub.attached``)."""
        self._attach = asyncio.Event()
        """Set when a peer attaches (``attach_seen``): one that can answer a check."""
        self.state = UNKNOWN
        self.checked_address = ""
        """The address the last check was about."""
        self.detail = "not checked yet"
        self.checked_by: list[str] = []
        self.checked_at: float | None = None
        self.unanswered = False
        """Whether the last check asked peers and none of them answered."""
        self._nonces: dict[str, bool] = {}
        """Nonces of this node's checks in flight -> whether a dial-back brought it here."""
        self._dials = 0

    # ---- the node's life ------------------------------------------------------------------

    async def until_servable(self, adopt_observed: Callable[[], None]) -> None:
        """Return once peers can dial this node or reach it through a relay: before that it
        could serve nothing, so it takes no stage. Tries again every
        ``net.reachability_retry_s`` (the address may change, a port be opened, a relay
        come); ``adopt_observed`` first takes the address peers see, if it changed."""
        net = self.ctx.config.net
        if net.force_relay:
            while not await self._relay():
                await asyncio.sleep(RELAY_WAIT_S)
            return
        if not net.check_reachability:
            return
        unanswered = 0
        while True:
            state = await self.check()
            if state == DIRECT or (state == UNKNOWN and not self.unanswered):
                return  # dialled back, or the swarm's first node: nobody to ask
            if state == UNREACHABLE and net.relays and await self._relay():
                return
            wait = net.reachability_retry_s
            if state == UNKNOWN:  # peers known, none answered: they may be NATed joiners too
                unanswered += 1
                if unanswered >= UNANSWERED_TRIES:
                    log.warning(
                        "reachability: no peer answered %d checks; serving unverified "
                        "(checking again every %.0f s)",
                        unanswered,
                        RECHECK_UNKNOWN_S,
                    )
                    return
                wait = min(wait, RECHECK_UNANSWERED_S)
            with contextlib.suppress(TimeoutError):  # a peer that can answer attached
                await asyncio.wait_for(self._attach.wait(), wait)
            adopt_observed()

    async def keep(self) -> None:
        """Housekeeping (every second): check again when it is due (the address changed,
        or nobody had answered); while peers cannot dial this node, keep its relays."""
        net = self.ctx.config.net
        if net.check_reachability and not net.force_relay and self.due(self.ctx.state.address):
            await self.check()
        relay_only = self.ctx.config.node.stage == "relay"
        undiallable = net.force_relay or self.state in (RELAYED, UNREACHABLE)
        if undiallable and net.relays and not relay_only:
            await self._relay()

    async def _relay(self) -> bool:
        """Attach to relays until ``net.relays`` are held (a dead one replaced); True while
        at least one is."""
        changed = await self.relays.top_up(self.ctx.table.records())
        if changed or self.state != RELAYED:
            self.relayed(self.relays.addresses)
        return bool(self.relays.addresses)

    # ---- asking -------------------------------------------------------------------------

    def attach_seen(self) -> None:
        """A peer attached to this node as its relay: a joining node whose check nobody
        answered asks again now (``until_servable``), that peer first, and a node serving
        ``unknown`` is due a check (``due``)."""
        self._attach.set()

    async def check(self) -> str:
        """Ask peers to dial this node back at its announced address; returns the state.
        Peers attached to this node as their relay are asked first: over the link they
        opened, they answer for certain, and dial back the host they connect to."""
        ctx = self.ctx
        address = ctx.state.address
        self._attach.clear()
        now = ctx.clock.now()

        def standing(p: PeerRecord) -> int:
            if self.attached(p.peer_id):
                return 0  # it answers over the link it opened to this node
            return 1 if ctx.table.silent_s(p.peer_id, now) is not None else 2

        waves = asking_waves(dialled_first(ctx.table.records(), ctx.rng), standing)
        self.unanswered = bool(waves)
        if not waves:
            self._settle(UNKNOWN, address, [], "no peer to ask yet")
            return self.state
        answers: list[tuple[str, bool, str]] = []  # (peer id, reached, why)
        silent: list[str] = []  # why each peer that did not answer did not
        while waves and not answers:  # one answer is a verdict; seek no second one
            wave = waves.pop(0)
            for p, (v, why) in zip(
                wave, await asyncio.gather(*(self._ask(p, address) for p in wave)), strict=True
            ):
                if v is None:
                    silent.append(why)
                else:
                    answers.append((p.peer_id, v, why))
        self.unanswered = not answers
        reached = [pid for pid, v, _ in answers if v]
        refused = [(pid, why) for pid, v, why in answers if not v]
        if reached:
            self._settle(DIRECT, address, reached, f"dialled back by {len(reached)} peer(s)")
        elif refused:
            self._settle(UNREACHABLE, address, [pid for pid, _ in refused], refused[0][1])
        elif address == self.checked_address and self.state != UNKNOWN:
            self.checked_at = time.monotonic()  # nobody answered: the last verdict stands
            log.debug("reachability check unanswered, still %s: %s", self.state, silent[0])
        else:
            self._settle(UNKNOWN, address, [], silent[0])
        return self.state

    def due(self, address: str) -> bool:
        """Whether to check again: the announced address changed, or the last check found
        nobody to ask (or nobody answered) and peers have come since (at most every
        ``RECHECK_UNKNOWN_S``), or one has attached to this node since: it can answer."""
        if address != self.checked_address:
            return True
        if self.state != UNKNOWN or len(self.ctx.table) == 0:
            return False
        age = time.monotonic() - (self.checked_at or 0.0)
        return age >= RECHECK_UNKNOWN_S or self._attach.is_set()

    async def _ask(self, peer: PeerRecord, address: str) -> tuple[bool | None, str]:
        """One peer's dial-back: (reached, or None when the peer did not answer; why)."""
        nonce = secrets.token_hex(8)
        self._nonces[nonce] = False
        msg = DialBack(address=address, nonce=nonce, sender=self.ctx.peer_id)
        try:
            reply = await self.ctx.transport.request(
                peer.address, msg, DIAL_TIMEOUT_S + 5.0, peer.peer_id
            )
            result = expect(reply, DialBackResult)
        except (TransportError, ValueError) as e:
            return None, f"peer {peer.peer_id[:8]} did not answer the check ({e})"
        finally:
            arrived = self._nonces.pop(nonce, False)
        if result.reached and arrived:
            return True, ""
        return False, result.detail or "the dial-back did not arrive"

    def relayed(self, relays: list[str]) -> None:
        """This node serves through ``relays`` (none left: it is unreachable again)."""
        address = self.ctx.state.address
        if relays:
            self._settle(RELAYED, address, [], f"via {', '.join(relays)}")
        else:
            self._settle(UNREACHABLE, address, [], "no peer relays for this node")

    def _settle(self, state: str, address: str, peers: list[str], detail: str) -> None:
        changed = (state, address) != (self.state, self.checked_address)
        self.state, self.checked_address, self.checked_by = state, address, peers
        self.detail, self.checked_at = detail, time.monotonic()
        if changed:
            level = logging.WARNING if state == UNREACHABLE else logging.INFO
            log.log(level, "reachability: %s at %s (%s)%s", state, address, detail, self._advice())

    def _advice(self) -> str:
        if self.state not in (UNREACHABLE, RELAYED):
            return ""
        _, port = parse_hostport(self.checked_address)
        forward = (
            f"forward TCP port {port} on your router to this machine and start it with "
            f"--announce PUBLIC_IP"
        )
        if self.state == RELAYED:
            return (
                f"; peers cannot open connections to this node, so its traffic goes through a "
                f"relay (slower); to serve directly, {forward}"
            )
        return (
            f"; peers cannot open connections to this node and no peer relays for it, so it "
            f"cannot serve a stage: {forward}, run it on a machine with a public address, "
            f"or wait for a reachable peer that relays (net.relay_capacity > 0)"
        )

    # ---- answering ----------------------------------------------------------------------

    async def on_dial_back(self, msg: DialBack, peer_host: str) -> DialBackResult:
        """Dial the asker back at its address, if that is the host the request came from."""
        host, _ = parse_hostport(msg.address, "dial-back address")
        if host != peer_host:
            detail = (
                f"this node announces {host} but its requests come from {peer_host}: "
                "it is behind a NAT (or announces a wrong address)"
            )
            self._avoid(msg.sender)
            return DialBackResult(reached=False, observed_host=peer_host, detail=detail)
        if self._dials >= MAX_DIALS:
            raise Refused("busy", f"{self._dials} dial-backs in flight", 503)
        self._dials += 1
        try:
            await self.ctx.transport.request(
                msg.address, DialProbe(nonce=msg.nonce), DIAL_TIMEOUT_S, msg.sender
            )
        except TransportError as e:
            self._avoid(msg.sender)
            detail = f"{msg.address} did not accept a connection from a peer ({e.code})"
            return DialBackResult(reached=False, observed_host=peer_host, detail=detail)
        finally:
            self._dials -= 1
        return DialBackResult(reached=True, observed_host=peer_host, detail="")

    def _avoid(self, peer_id: str) -> None:
        self.ctx.router.avoid(peer_id, self.ctx.clock.now(), AVOID_S)

    def on_probe(self, msg: DialProbe) -> Ack:
        """A dial-back arrived: it proves the check whose nonce it carries."""
        if msg.nonce in self._nonces:
            self._nonces[msg.nonce] = True
        return Ack()

    def status(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "address": self.checked_address,
            "detail": self.detail,
            "advice": self._advice().removeprefix("; "),
            "checked_by": self.checked_by,
            "age_s": None
            if self.checked_at is None
            else round(time.monotonic() - self.checked_at, 1),
        }
