"""Latency and bandwidth emulation in the transport (this kernel has no netem)."""

import asyncio
import time

import pytest
import torch

from node.net.netem import ShapedTransport, message_nbytes
from protocol.messages import Ack, Leave, Message, RingChunk
from swarm.seams import TransportError


class Instant:
    async def request(
        self, address: str, msg: Message, timeout_s: float, peer_id: str = ""
    ) -> Message:
        return Ack()


async def test_latency_is_paid_both_ways() -> None:
    link = ShapedTransport(Instant(), latency_s=0.05, bandwidth_bytes_s=None)
    t0 = time.monotonic()
    await link.request("x", Leave(peer_id="a"), 5.0)
    assert 0.1 <= time.monotonic() - t0 < 0.3


async def test_bandwidth_serialises_messages_on_one_uplink() -> None:
    chunk = RingChunk(
        round_id="r",
        members_hash="h",
        phase="reduce",
        step=0,
        meta={},
        tensors={"c": torch.zeros(25_000)},
    )
    size = message_nbytes(chunk)
    assert size > 100_000
    link = ShapedTransport(
        Instant(), latency_s=0.0, bandwidth_bytes_s=1_000_000
    )  # ~0.1 s per message
    t0 = time.monotonic()
    await asyncio.gather(*(link.request("x", chunk, 5.0) for _ in range(3)))
    elapsed = time.monotonic() - t0
    assert elapsed == pytest.approx(3 * size / 1_000_000, rel=0.3)  # queued, not parallel


async def test_timeout_becomes_a_transport_error() -> None:
    link = ShapedTransport(Instant(), latency_s=1.0, bandwidth_bytes_s=None)
    with pytest.raises(TransportError) as info:
        await link.request("x", Leave(peer_id="a"), 0.2)
    assert info.value.code == "timeout"
