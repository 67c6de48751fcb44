"""Reading a request or reply body: one buffer of the declared length, bounded by the limit
and by the request's deadline."""

from __future__ import annotations

import asyncio
import time
from unittest import mock

import aiohttp
import pytest
from aiohttp import web

from node.net.transport import ACK_FRAME, HttpTransport, _read_bounded
from protocol.errors import FrameTooLarge
from protocol.frames import Limits
from protocol.messages import Ack
from swarm.seams import TransportError
from tests.helpers import rpc_app


def stream(chunks: list[bytes]) -> aiohttp.StreamReader:
    """A reader fed one chunk per event-loop turn, as a socket would feed it."""
    loop = asyncio.get_running_loop()
    reader = aiohttp.StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=loop)

    async def feed() -> None:
        for chunk in chunks:
            await asyncio.sleep(0)
            reader.feed_data(chunk)
        reader.feed_eof()

    task = loop.create_task(feed())
    FEEDERS.add(task)  # keep a reference until it is done
    task.add_done_callback(FEEDERS.discard)
    return reader


FEEDERS: set[asyncio.Task[None]] = set()


async def test_chunks_land_in_one_buffer_of_the_declared_length() -> None:
    chunks = [bytes([i]) * 1000 for i in range(5)]
    body = await _read_bounded(stream(chunks), 10_000, declared=5000)
    assert isinstance(body, bytearray) and body == b"".join(chunks)


async def test_single_chunk_is_returned_without_a_copy() -> None:
    chunk = b"x" * 100
    body = await _read_bounded(stream([chunk]), 10_000, declared=100)
    assert body is chunk


async def test_a_body_of_its_declared_length_returns_without_waiting_for_the_end() -> None:
    loop = asyncio.get_running_loop()
    reader = aiohttp.StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=loop)
    chunk = b"y" * 64
    reader.feed_data(chunk)  # and no end of stream yet
    assert await asyncio.wait_for(_read_bounded(reader, 1000, declared=64), 1.0) is chunk


async def test_body_cut_short_stays_short() -> None:
    body = await _read_bounded(stream([b"a" * 10, b"b" * 10]), 1000, declared=500)
    assert body == b"a" * 10 + b"b" * 10


async def test_without_a_declared_length_chunks_are_joined() -> None:
    body = await _read_bounded(stream([b"a", b"b", b"c"]), 1000)
    assert body == b"abc"


@pytest.mark.parametrize("declared", [None, 10])
async def test_limits_are_enforced(declared: int | None) -> None:
    with pytest.raises(FrameTooLarge):
        await _read_bounded(stream([b"a" * 8, b"b" * 8]), 12, declared=declared)
    with pytest.raises(FrameTooLarge):
        await _read_bounded(stream([b"a"]), 12, declared=13)


@pytest.mark.parametrize("stall", ["before_reply", "mid_body"])
async def test_a_peer_that_stalls_is_a_timeout_within_the_deadline(stall: str) -> None:
    """The deadline covers the whole exchange, the reply's body included: a peer that sends
    its headers and half a frame, then nothing, is a ``timeout`` and not a hang."""
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        if stall == "before_reply":
            await release.wait()
        response = web.StreamResponse(headers={"Content-Length": str(len(ACK_FRAME))})
        await response.prepare(request)
        await response.write(ACK_FRAME[:5])
        await release.wait()
        return response

    transport = HttpTransport(Limits())
    await transport.start()
    async with rpc_app(handler) as (_, address):
        try:
            t0 = time.monotonic()
            with pytest.raises(TransportError) as info:
                await transport.request(address, Ack(), timeout_s=0.3)
            assert info.value.code == "timeout"
            assert 0.25 < time.monotonic() - t0 < 2.0
            assert transport.stats.requests["ack", "timeout"] == 1
        finally:
            release.set()
            await transport.close()


async def test_a_bad_address_is_unreachable_not_a_crash() -> None:
    transport = HttpTransport(Limits())
    await transport.start()
    try:
        with pytest.raises(TransportError) as info:
            await transport.request("not an address:port", Ack(), timeout_s=1.0)
        assert info.value.code == "unreachable"
    finally:
        await transport.close()
