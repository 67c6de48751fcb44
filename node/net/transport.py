"""HTTP transport: frames over aiohttp, client and server side.

Owns how a message becomes an HTTP request or response: ``POST /rpc`` with one frame as
the body, written straight from the frame's buffers (tensors from their own memory; only a
frame under 64 KiB is joined, into one write), and the reverse on receipt (the body is read
once into one buffer of its declared length, after that length has been checked against the
frame limit, and decoded into zero-copy tensor views).
Implements ``swarm.seams.Transport``. Does not own what messages mean.

In a keyed swarm (``protocol.auth``) every request carries an ``X-Murmur-Auth`` proof and
every successful reply must carry one too: ``read_frame`` checks a request's body before it
is decoded, ``sealed_response`` seals a reply, and frames of a megabyte or more are hashed
on a worker thread (``digest_of``) so the event loop does not stall on a state transfer.

Also keeps plain-number traffic statistics (``TrafficStats``: bytes by message kind, requests
by outcome, a latency histogram per kind) for ``node.metrics`` to export at scrape time: the
client side's on ``HttpTransport.stats``, the server side's (request bodies read by
``read_frame``) per aiohttp application, from ``server_stats(app)``. No Prometheus here.
"""

from __future__ import annotations

import asyncio
import bisect
import time
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
from aiohttp import payload, web
from yarl import URL

from node.net.tcp import CongestionControl
from protocol.auth import AUTH_HEADER, Incoming, SwarmAuth, frame_digest
from protocol.errors import FrameTooLarge, ProtocolError
from protocol.frames import SMALL_FRAME_BYTES, Limits, frame_nbytes
from protocol.messages import Ack, Error, Message, decode_message, encode_message
from swarm.admission import TokenBuckets
from swarm.seams import TransportError

CONTENT_TYPE = "application/x-murmuration-frame"
RPC_PATH = "/rpc"
RELAY_PATH = "/relay"
"""``GET``: a node that cannot be dialled attaches (a WebSocket, ``node.net.relay``);
``POST /relay/<peer id>``: a frame for the attached node."""
RELAY_REFUSAL_HEADER = "X-Murmur-Relay"
"""Set on a relay's own refusals (``relay_gone``, ``relay_busy``), so a sender tries its
next relay; a refusal by the relayed node itself passes through without it."""

Served = tuple[int, str | None, bytes]
"""A reply as a relay carries it: HTTP status, the ``X-Murmur-Auth`` seal (or None), frame."""

SEALED_REFUSALS_PER_S = 10.0
"""Refusals as stale sealed with this node's time, at most, a second (one signature each);
beyond that they go unsealed, as other refusals do."""


@dataclass(frozen=True)
class Route:
    """How to reach a peer that cannot be dialled (``node.net.relay``)."""

    peer_id: str
    relays: tuple[str, ...]
    """Its relays' addresses, tried in turn (``POST /relay/<peer id>``)."""
    relay_ids: tuple[str, ...] = ()
    """The peer ids at those addresses, where the peer table knows them ("" where not): a
    relay's seal on its own refusal as stale is read only from the relay it was sent to."""
    local: Callable[[str | None, bytes, float], Awaitable[Served]] | None = None
    """Set when this node is one of its relays: the exchange over its WebSocket."""


LARGE_DIGEST_BYTES = 1 << 20
"""Frames from this size on are hashed on a worker thread (hashlib releases the GIL)."""

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds of the request latency histogram: a loopback ack to a slow state transfer."""


@dataclass
class Histogram:
    """A fixed-bucket histogram of plain numbers (Prometheus semantics: ``le`` upper bounds)."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    """Observations per bucket, not cumulative; the last entry is the ``+Inf`` bucket."""
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bound >= value
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations <= bound)`` pairs, ending with ``(inf, count)``."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


@dataclass
class TrafficStats:
    """What one side of the transport moved, by message kind (the wire ``TYPE``)."""

    sent_bytes: Counter[str] = field(default_factory=Counter)
    received_bytes: Counter[str] = field(default_factory=Counter)
    requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    """Requests by (kind, outcome): "ok" or the error code (refusals, timeout, unreachable)."""
    latency_s: dict[str, Histogram] = field(default_factory=dict)
    """Seconds from sending a request to its reply (or error), by request kind."""

    def observe_request(self, kind: str, outcome: str, seconds: float) -> None:
        self.requests[kind, outcome] += 1
        self.latency_s.setdefault(kind, Histogram()).observe(seconds)


_SERVER_STATS: weakref.WeakKeyDictionary[web.Application, TrafficStats] = (
    weakref.WeakKeyDictionary()
)


def server_stats(app: web.Application) -> TrafficStats:
    """Bytes of the requests ``read_frame`` decoded for ``app``'s handlers."""
    stats = _SERVER_STATS.get(app)
    if stats is None:
        stats = _SERVER_STATS[app] = TrafficStats()
    return stats


class FramePayload(payload.Payload):
    """An aiohttp body written from a frame's parts: buffer by buffer, or joined if small."""

    def __init__(self, buffers: Sequence[bytes | memoryview]) -> None:
        super().__init__(buffers, content_type=CONTENT_TYPE)
        self._buffers = buffers
        self._size = frame_nbytes(buffers)

    @property
    def buffers(self) -> Sequence[bytes | memoryview]:
        return self._buffers

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


_ACK = Ack()
ACK_FRAME = b"".join(encode_message(_ACK))
"""The frame of a plain ``Ack``, the most common reply, encoded once: sent as it is, and a
reply equal to it is known without decoding (``bench/perf.py``, hop latency)."""


def frame_body(buffers: Sequence[bytes | memoryview]) -> bytes | FramePayload:
    """An HTTP body for a frame: a small one (``SMALL_FRAME_BYTES``) as one ``bytes``, a large
    one written from its buffers as they are (tensors from their own memory).

    aiohttp sends ``bytes`` with less work than a ``Payload`` of its own (``bench/perf.py``,
    hop latency). A frame ``protocol.messages.prepare`` joined already is sent as it is."""
    if len(buffers) == 1 and type(buffers[0]) is bytes:
        return buffers[0]
    if frame_nbytes(buffers) <= SMALL_FRAME_BYTES:
        return b"".join(buffers)
    return FramePayload(buffers)


def frame_response(
    msg: Message, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    if type(msg) is Ack and msg == _ACK and not msg.tensors and headers is None:
        return web.Response(status=status, body=ACK_FRAME, content_type=CONTENT_TYPE)
    return _response(frame_body(encode_message(msg)), status, headers)


def _response(
    body: bytes | FramePayload, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    if isinstance(body, bytes):
        return web.Response(status=status, body=body, content_type=CONTENT_TYPE, headers=headers)
    return web.Response(status=status, body=body, headers=headers)


async def sealed_response(msg: Message, incoming: Incoming | None) -> web.Response:
    """A successful reply, sealed in a keyed swarm for the request ``incoming`` admitted."""
    if incoming is None:
        return frame_response(msg)
    buffers = encode_message(msg)
    header = incoming.seal_reply(await digest_of(buffers))
    return _response(frame_body(buffers), headers={AUTH_HEADER: header})


class StaleSeals:
    """Seals this node's refusals of requests as stale with its time
    (``SwarmAuth.seal_refusal``), so that a member whose clock is far off learns the
    swarm's time from members (``node.net.swarmtime``): at most ``SEALED_REFUSALS_PER_S`` a
    second, each costing a signature; beyond that they go unsealed, as other refusals do.
    The node's server and its relay hub each hold one."""

    def __init__(self, auth: SwarmAuth | None) -> None:
        self.auth = auth
        self._budget = TokenBuckets(SEALED_REFUSALS_PER_S, SEALED_REFUSALS_PER_S, 1)

    def headers(self, stale_proof: str | None, refusal: Message) -> dict[str, str] | None:
        """The headers of ``refusal``, a refusal of the request whose proof header was
        ``stale_proof``: its seal, or None (an open swarm, a proof that does not parse, or
        over the budget)."""
        if self.auth is None or not self._budget.allow(0, time.monotonic()):
            return None
        seal = self.auth.seal_refusal(
            stale_proof, frame_digest(encode_message(refusal)), time.time()
        )
        return None if seal is None else {AUTH_HEADER: seal}


async def digest_of(buffers: Sequence[bytes | bytearray | memoryview]) -> bytes:
    """SHA-256 of a frame (``protocol.auth.frame_digest``); a large one off the event loop."""
    if sum(memoryview(b).nbytes for b in buffers) < LARGE_DIGEST_BYTES:
        return frame_digest(buffers)
    return await asyncio.to_thread(frame_digest, buffers)


async def read_frame(
    request: web.Request, limits: Limits, incoming: Incoming | None = None
) -> Message:
    """Decode a request body, refusing an oversized one before reading it and, in a keyed
    swarm (``incoming``: the proof whose header passed), a forged one before decoding it."""
    body = await read_body(request, limits)
    return await open_frame(body, limits, incoming, server_stats(request.app))


async def read_body(request: web.Request, limits: Limits) -> bytes | bytearray:
    """A request's frame, refused before it is read when it declares too many bytes."""
    declared = request.content_length
    if declared is not None and declared > limits.max_frame_bytes:
        raise FrameTooLarge(f"request declares {declared} bytes, limit is {limits.max_frame_bytes}")
    return await _read_bounded(request.content, limits.max_frame_bytes, declared)


async def open_frame(
    body: bytes | bytearray, limits: Limits, incoming: Incoming | None, stats: TrafficStats
) -> Message:
    """A received frame checked (its proof, in a keyed swarm) and decoded; counted in
    ``stats``, by kind or as invalid."""
    if len(body) > limits.max_frame_bytes:
        raise FrameTooLarge(f"frame of {len(body)} bytes, limit is {limits.max_frame_bytes}")
    try:
        if incoming is not None:
            incoming.verify(await digest_of([body]))
        msg = decode_message(body, limits)
    except ProtocolError:
        stats.received_bytes["invalid"] += len(body)
        raise
    stats.received_bytes[msg.TYPE] += len(body)
    return msg


def response_frame(resp: web.Response) -> bytes:
    """The frame a response made here carries (for a relay to pass on)."""
    body = resp.body
    if isinstance(body, FramePayload):
        return b"".join(bytes(b) for b in body.buffers)
    assert isinstance(body, bytes), type(body)
    return body


async def _read_bounded(
    stream: aiohttp.StreamReader, max_bytes: int, declared: int | None = None
) -> bytes | bytearray:
    """The whole body, refused once it passes ``max_bytes``.

    A body that arrives in one chunk is returned as it is, at once when it has its declared
    length (a small frame, the common case: no second read to see the end). A longer one with
    a declared length is copied into one buffer of that length chunk by chunk as it arrives,
    each chunk released at once: keeping them all and joining at the end holds twice the
    memory and, for large frames, takes several times as long (every chunk is fresh,
    page-faulted memory; ``bench/perf.py``, wire throughput).
    """
    if declared is not None and declared > max_bytes:
        raise FrameTooLarge(f"body declares {declared} bytes, limit is {max_bytes}")
    chunk = await stream.readany()
    if len(chunk) == declared:  # the HTTP parser delivers no more than the declared length
        return chunk
    chunks: list[bytes] = []
    buf: bytearray | None = None
    total = 0
    while chunk:
        end = total + len(chunk)
        if end > max_bytes:
            raise FrameTooLarge(f"body exceeds the {max_bytes}-byte frame limit")
        if buf is not None:
            buf[total:end] = chunk
        elif declared is not None and total == 0 and end < declared:
            buf = bytearray(declared)
            buf[:end] = chunk
        else:
            chunks.append(chunk)
        total = end
        chunk = await stream.readany()
    if buf is not None:
        del buf[total:]  # a body cut short stays short: decoding reports it truncated
        return buf
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class HttpTransport:
    """``Transport`` over HTTP/1.1 keep-alive connections (one pool per node)."""

    def __init__(
        self,
        limits: Limits,
        auth: SwarmAuth | None = None,
        congestion: CongestionControl | None = None,
    ) -> None:
        self.limits = limits
        self.auth = auth
        """Seals requests and checks replies in a keyed swarm; None in an open one."""
        self.congestion = congestion or CongestionControl("")
        """The congestion control of its connections (``node.net.tcp``); by default the
        system's."""
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[str, URL] = {}
        """``POST /rpc`` URL by peer address, parsed once (parsing took 3 % of a hop)."""
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}
        self.bytes_sent = 0
        self.bytes_received = 0
        self.stats = TrafficStats()
        self.routes: Callable[[str, str], Route | None] = lambda address, peer_id: None
        """Where a request for a peer that cannot be dialled goes (``node.net.relay``)."""
        self.sealed_time: Callable[[str, float, float, float], None] = lambda *sample: None
        """Called with each sealed reply's time in a keyed swarm: (sealer's peer id, sent at,
        sealed at, received at; wall-clock seconds, ``node.net.swarmtime``)."""

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0, keepalive_timeout=30, socket_factory=self.congestion.socket_factory()
        )
        self._session = aiohttp.ClientSession(connector=connector)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self, address: str, msg: Message, timeout_s: float, peer_id: str = ""
    ) -> Message:
        """Send ``msg`` (to ``peer_id`` when known, see ``swarm.seams.Transport``); return the
        reply, or raise ``TransportError`` (``Error`` replies too)."""
        assert self._session is not None, "transport not started"
        buffers = encode_message(msg)
        t0 = time.monotonic()
        try:
            reply = await self._exchange(address, msg, buffers, timeout_s, peer_id)
        except TransportError as e:
            self.stats.observe_request(msg.TYPE, e.code, time.monotonic() - t0)
            raise
        outcome = reply.code if isinstance(reply, Error) else "ok"
        self.stats.observe_request(msg.TYPE, outcome, time.monotonic() - t0)
        if isinstance(reply, Error):
            raise TransportError(reply.code, reply.message)
        return reply

    async def _exchange(
        self,
        address: str,
        msg: Message,
        buffers: Sequence[bytes | memoryview],
        timeout_s: float,
        peer_id: str,
    ) -> Message:
        """POST one frame, straight or through a relay, and decode the reply frame (an
        ``Error`` reply is returned)."""
        route = self.routes(address, peer_id)
        if route is not None:
            peer_id = route.peer_id
        sent = None
        if self.auth is not None:
            digest = await digest_of(buffers)
            sent = self.auth.sign_request(
                address, "POST", RPC_PATH, digest, time.time(), peer_id=peer_id
            )
        header = sent.header if sent is not None else None
        size = frame_nbytes(buffers)
        sent_at = time.time()
        relay_id = ""  # the relay that carried it, where known: it may seal a stale refusal
        if route is None:
            status, seal, raw, _ = await self._post(
                self._url(address), frame_body(buffers), header, timeout_s, address
            )
        else:
            status, seal, raw, relay_id = await self._relayed(
                route, buffers, header, timeout_s, address
            )
        received_at = time.time()
        self.bytes_sent += size
        self.bytes_received += len(raw)
        self.stats.sent_bytes[msg.TYPE] += size
        try:
            if sent is not None:  # a sealed reply is checked before it is decoded
                sent.open_reply(status, seal, await digest_of([raw]), relay_id)
            reply = _ACK if raw == ACK_FRAME else decode_message(raw, self.limits)
            if sent is not None:
                sent.check_reply(reply)
        except ProtocolError as e:
            self.stats.received_bytes["invalid"] += len(raw)
            raise TransportError(e.code, f"bad reply from {address} (HTTP {status}): {e}") from None
        self.stats.received_bytes[reply.TYPE] += len(raw)
        if sent is not None and sent.sealed_by is not None and sent.sealed_ts is not None:
            self.sealed_time(sent.sealed_by, sent_at, sent.sealed_ts, received_at)
        return reply

    async def _post(
        self,
        url: URL,
        body: bytes | FramePayload,
        header: str | None,
        timeout_s: float,
        address: str,
    ) -> tuple[int, str | None, bytes | bytearray, str | None]:
        """One HTTP exchange: (status, reply seal, reply frame, a relay's own refusal code)."""
        assert self._session is not None
        try:
            # aiohttp's own deadline (covering the reply's body), not a second timer.
            async with self._session.post(
                url,
                data=body,
                headers={AUTH_HEADER: header} if header is not None else None,
                timeout=self._timeout(timeout_s),
            ) as resp:
                raw = await _read_bounded(
                    resp.content, self.limits.max_frame_bytes, resp.content_length
                )
        except TimeoutError:
            raise TransportError(
                "timeout", f"{address} did not answer within {timeout_s:.1f}s"
            ) from None
        except (aiohttp.ClientError, OSError) as e:
            raise TransportError("unreachable", f"{address}: {e or type(e).__name__}") from None
        except FrameTooLarge as e:
            raise TransportError(e.code, f"reply from {address}: {e}") from None
        headers = resp.headers
        return resp.status, headers.get(AUTH_HEADER), raw, headers.get(RELAY_REFUSAL_HEADER)

    async def _relayed(
        self,
        route: Route,
        buffers: Sequence[bytes | memoryview],
        header: str | None,
        timeout_s: float,
        address: str,
    ) -> tuple[int, str | None, bytes | bytearray, str]:
        """The exchange with a peer that cannot be dialled: over its WebSocket when this node
        is its relay, else through its relays in turn (the next one when a relay is down or
        refuses; not after a timeout, when the frame may have been delivered). Returns the
        reply as ``_post`` does, with the peer id of the relay that carried it ("" for none
        or not known)."""
        why = "it names no relay"
        if route.local is not None:
            try:
                return (*await route.local(header, b"".join(buffers), timeout_s), "")
            except TransportError as e:
                if e.code == "timeout" or not route.relays:
                    raise
                why = f"{e.code}: {e.message}"
        ids = route.relay_ids or ("",) * len(route.relays)
        for relay, relay_id in zip(route.relays, ids, strict=True):
            url = self._url(f"{relay}{RELAY_PATH}/{route.peer_id}", path="")
            try:
                status, seal, raw, refusal = await self._post(
                    url, frame_body(buffers), header, timeout_s, f"{address} via {relay}"
                )
            except TransportError as e:
                if e.code == "timeout":
                    raise
                why = e.message
                continue
            if refusal is None:
                return status, seal, raw, relay_id
            why = f"relay {relay} refused: {refusal}"
        raise TransportError("unreachable", f"{address} (relayed): {why}")

    def _url(self, address: str, path: str = RPC_PATH) -> URL:
        url = self._urls.get(address)
        if url is None:
            if len(self._urls) >= 4096:  # peers come and go: forget them all now and then
                self._urls.clear()
            try:
                url = URL(f"http://{address}{path}")
            except ValueError as e:
                raise TransportError("unreachable", f"bad address {address!r}: {e}") from None
            self._urls[address] = url
        return url

    def _timeout(self, seconds: float) -> aiohttp.ClientTimeout:
        timeout = self._timeouts.get(seconds)
        if timeout is None:
            if len(self._timeouts) >= 64:
                self._timeouts.clear()
            timeout = self._timeouts[seconds] = aiohttp.ClientTimeout(total=seconds)
        return timeout
