"""Reading a request or reply body: one buffer of the declared length, bounded by the limit."""

from __future__ import annotations

import asyncio
from unittest import mock

import aiohttp
import pytest

from node.transport import _read_bounded
from protocol.errors import FrameTooLarge


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
