"""Emulated network conditions in the transport: one-way latency and an egress bandwidth cap.

This machine's kernel has no netem, so latency cannot be added with ``tc``; like CheckFree's
own harness, the daemon can delay each message instead. ``ShapedTransport`` wraps any
``Transport``: a message leaves only when this node's (shared) uplink has sent everything
queued before it at ``bandwidth`` bytes per second, then travels ``latency_s``; the reply
pays the same on the way back (counted against the same uplink model, since the peer's
uplink is emulated the same way). Set with ``net.inject_latency_s`` and
``net.inject_bandwidth_mbps``; for testbeds and benchmarks, never for production.
"""

from __future__ import annotations

import asyncio
import time

from node.config import NetConfig
from protocol.frames import frame_nbytes
from protocol.messages import Message, encode_message
from swarm.seams import Transport, TransportError


def message_nbytes(msg: Message) -> int:
    """Bytes ``msg`` takes on the wire (header encoding only; tensors are not copied)."""
    return frame_nbytes(encode_message(msg))


class ShapedTransport:
    """A ``Transport`` whose messages pay latency and serialisation time on a shared uplink."""

    def __init__(self, inner: Transport, latency_s: float, bandwidth_bytes_s: float | None) -> None:
        self.inner = inner
        self.latency_s = latency_s
        self.bandwidth_bytes_s = bandwidth_bytes_s
        self._uplink_free_at = 0.0

    def _serialise_s(self, nbytes: int) -> float:
        return nbytes / self.bandwidth_bytes_s if self.bandwidth_bytes_s else 0.0

    async def _travel(self, nbytes: int) -> None:
        now = time.monotonic()
        start = max(now, self._uplink_free_at)
        self._uplink_free_at = start + self._serialise_s(nbytes)
        await asyncio.sleep(self._uplink_free_at - now + self.latency_s)

    async def request(
        self, address: str, msg: Message, timeout_s: float, peer_id: str = ""
    ) -> Message:
        try:
            async with asyncio.timeout(timeout_s):
                await self._travel(message_nbytes(msg))
                reply = await self.inner.request(address, msg, timeout_s, peer_id)
                await asyncio.sleep(self.latency_s + self._serialise_s(message_nbytes(reply)))
        except TimeoutError:
            raise TransportError(
                "timeout", f"{address} did not answer within {timeout_s:.1f}s"
            ) from None
        return reply


def shaped(inner: Transport, net: NetConfig) -> Transport:
    """``inner`` with ``net.inject_latency_s`` and ``net.inject_bandwidth_mbps`` applied, or
    ``inner`` itself when neither is set."""
    if not (net.inject_latency_s or net.inject_bandwidth_mbps):
        return inner
    return ShapedTransport(inner, net.inject_latency_s, net.inject_bandwidth_mbps * 125_000 or None)
