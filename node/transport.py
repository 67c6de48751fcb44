"""HTTP transport: frames over aiohttp, client and server side.

Owns how a message becomes an HTTP request or response: ``POST /rpc`` with one frame as
the body, written straight from the frame's buffers (tensors from their own memory, no
joined copy), and the reverse on receipt (the body is read once, after its declared length
has been checked against the frame limit, and decoded into zero-copy tensor views).
Implements ``swarm.seams.Transport``. Does not own what messages mean.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp
from aiohttp import payload, web

from protocol.errors import FrameTooLarge, ProtocolError
from protocol.frames import Limits, frame_nbytes
from protocol.messages import Error, Message, decode_message, encode_message
from swarm.seams import TransportError

CONTENT_TYPE = "application/x-murmuration-frame"
RPC_PATH = "/rpc"


class FramePayload(payload.Payload):
    """An aiohttp body written buffer by buffer from a frame's parts."""

    def __init__(self, buffers: Sequence[bytes | memoryview]) -> None:
        super().__init__(buffers, content_type=CONTENT_TYPE)
        self._buffers = buffers
        self._size = frame_nbytes(buffers)

    async def write(self, writer: aiohttp.abc.AbstractStreamWriter) -> None:
        for buf in self._buffers:
            await writer.write(buf)

    async def write_with_length(
        self, writer: aiohttp.abc.AbstractStreamWriter, content_length: int | None
    ) -> None:
        await self.write(writer)

    async def as_bytes(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return b"".join(bytes(b) for b in self._buffers)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        raise TypeError("a frame is binary; it has no text decoding")


def frame_response(msg: Message, status: int = 200) -> web.Response:
    return web.Response(status=status, body=FramePayload(encode_message(msg)))


async def read_frame(request: web.Request, limits: Limits) -> Message:
    """Decode a request body, refusing an oversized one before reading it."""
    declared = request.content_length
    if declared is not None and declared > limits.max_frame_bytes:
        raise FrameTooLarge(f"request declares {declared} bytes, limit is {limits.max_frame_bytes}")
    body = await _read_bounded(request.content, limits.max_frame_bytes)
    return decode_message(body, limits)


async def _read_bounded(stream: aiohttp.StreamReader, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    async for chunk in stream.iter_any():
        total += len(chunk)
        if total > max_bytes:
            raise FrameTooLarge(f"body exceeds the {max_bytes}-byte frame limit")
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class HttpTransport:
    """``Transport`` over HTTP/1.1 keep-alive connections (one pool per node)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._session: aiohttp.ClientSession | None = None
        self.bytes_sent = 0
        self.bytes_received = 0

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
        self._session = aiohttp.ClientSession(connector=connector)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, address: str, msg: Message, timeout_s: float) -> Message:
        """Send ``msg``; return the reply, or raise ``TransportError`` (``Error`` replies too)."""
        assert self._session is not None, "transport not started"
        body = FramePayload(encode_message(msg))
        try:
            async with asyncio.timeout(timeout_s):
                async with self._session.post(f"http://{address}{RPC_PATH}", data=body) as resp:
                    raw = await _read_bounded(resp.content, self.limits.max_frame_bytes)
        except TimeoutError:
            raise TransportError(
                "timeout", f"{address} did not answer within {timeout_s:.1f}s"
            ) from None
        except (aiohttp.ClientError, OSError) as e:
            raise TransportError("unreachable", f"{address}: {e or type(e).__name__}") from None
        except FrameTooLarge as e:
            raise TransportError(e.code, f"reply from {address}: {e}") from None
        self.bytes_sent += body.size or 0
        self.bytes_received += len(raw)
        try:
            reply = decode_message(raw, self.limits)
        except ProtocolError as e:
            raise TransportError(
                e.code, f"bad reply from {address} (HTTP {resp.status}): {e}"
            ) from None
        if isinstance(reply, Error):
            raise TransportError(reply.code, reply.message)
        return reply
