"""A simulated network and clock for membership: many ``MembershipService`` s in one process.

Owns virtual time (``SimClock``: ``sleep`` parks a coroutine until the driver advances the
clock to its wake-up, so a minute of a thousand nodes' heartbeats takes seconds) and an
in-memory network (``SimNet``): each request and reply is encoded with the project's own
codec to count its bytes (plus ``HTTP_OVERHEAD_BYTES``), delayed by a one-way latency, and
dispatched to the receiving service's handler; a request to a node that is down waits out
its timeout, as one to a vanished host does. The real membership code runs unchanged on
it: ``tests/test_membership.py`` and ``bench/membership.py`` use it.

Does not own the protocol (``swarm.membership``) or any real socket. The idle test of the
driver reads asyncio's ready queue (``loop._ready``, CPython's default loop; not uvloop).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter
from typing import Any

from protocol.frames import frame_nbytes
from protocol.messages import (
    Ack,
    Error,
    Hello,
    Leave,
    Message,
    Ping,
    Probe,
    encode_message,
)
from swarm.membership import EXCHANGE_BYTES, MembershipService
from swarm.seams import Refused, TransportError

HTTP_OVERHEAD_BYTES = EXCHANGE_BYTES
"""Bytes an exchange costs beyond its two frames: request line and headers, status line and
headers (about what aiohttp sends for ``POST /rpc``), TCP/IP headers left out."""


SIM_EPOCH_S = 1_800_000_000.0
"""What the virtual wall clock reads at virtual time 0 (a date in 2027)."""


class SimClock:
    """Virtual time: ``sleep`` waits until ``run_until`` moves the clock past its deadline."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self.t

    def wall(self) -> float:
        """Virtual wall time: every simulated node's clock agrees."""
        return SIM_EPOCH_S + self.t

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.t + max(0.0, seconds), next(self._seq), future))
        await future

    async def settle(self) -> None:
        """Let every runnable coroutine run until all of them wait on the clock."""
        loop: Any = asyncio.get_running_loop()
        await asyncio.sleep(0)
        while loop._ready:
            await asyncio.sleep(0)

    async def run_until(self, t_end: float) -> None:
        """Advance virtual time to ``t_end``, waking sleepers in order."""
        await self.settle()
        while self._sleepers and self._sleepers[0][0] <= t_end:
            wake = self._sleepers[0][0]
            self.t = max(self.t, wake)
            while self._sleepers and self._sleepers[0][0] <= wake:
                _, _, future = heapq.heappop(self._sleepers)
                if not future.done():
                    future.set_result(None)
            await self.settle()
        self.t = max(self.t, t_end)


def nbytes(msg: Message) -> int:
    return frame_nbytes(encode_message(msg))


class SimNet:
    """Addresses map to services; a node that is down, or on another side of a partition,
    does not answer (the request waits out its timeout)."""

    def __init__(self, clock: SimClock, latency_s: float = 0.02) -> None:
        self.clock = clock
        self.latency_s = latency_s
        self.nodes: dict[str, MembershipService] = {}
        self.side: dict[str, int] = {}
        self.sent: Counter[str] = Counter()
        self.received: Counter[str] = Counter()
        self.by_type: Counter[str] = Counter()
        self.overhead: Counter[str] = Counter()
        """Of ``sent`` and ``received``, what HTTP adds (the rest is frames)."""

    def transport(self, source: str) -> SimTransport:
        return SimTransport(self, source)

    def reachable(self, source: str, address: str) -> bool:
        side = self.side
        return (
            address in self.nodes
            and source in self.nodes
            and side.get(source, 0) == side.get(address, 0)
        )

    def count(self, source: str, target: str, msg: Message) -> None:
        """One message from ``source`` to ``target``: its frame and half an exchange's
        HTTP overhead, for both."""
        half = HTTP_OVERHEAD_BYTES // 2
        size = nbytes(msg) + half
        self.sent[source] += size
        self.received[target] += size
        self.overhead[source] += half
        self.overhead[target] += half
        self.by_type[msg.TYPE] += size


class SimTransport:
    def __init__(self, net: SimNet, source: str) -> None:
        self.net, self.source = net, source

    async def request(
        self, address: str, msg: Message, timeout_s: float, peer_id: str = ""
    ) -> Message:
        net = self.net
        if not net.reachable(self.source, address):
            await net.clock.sleep(timeout_s)
            raise TransportError("timeout", f"{address} did not answer in {timeout_s:g} s")
        net.count(self.source, address, msg)
        await net.clock.sleep(net.latency_s)
        target = net.nodes.get(address)
        if target is None:  # went down meanwhile
            await net.clock.sleep(timeout_s)
            raise TransportError("timeout", f"{address} did not answer in {timeout_s:g} s")
        reply: Message
        try:
            reply = await _dispatch(target, msg, self.source.split(":")[0])
        except Refused as e:
            reply = Error(code=e.code, message=e.message)
        net.count(address, self.source, reply)
        await net.clock.sleep(net.latency_s)
        if isinstance(reply, Error):
            raise TransportError(reply.code, reply.message)
        return reply


async def _dispatch(target: MembershipService, msg: Message, host: str) -> Message:
    if isinstance(msg, Hello):
        return target.handle_hello(msg, host)
    if isinstance(msg, Ping):
        return target.handle_ping(msg)
    if isinstance(msg, Probe):
        return await target.handle_probe(msg)
    if isinstance(msg, Leave):
        target.handle_leave(msg)
        return Ack()
    raise Refused("unexpected", f"no membership handler for {msg.TYPE}", 400)
