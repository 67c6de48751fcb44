"""Relays: how a node that nobody can dial serves a stage anyway, through a peer that can.

Connection reversal, as libp2p's circuit relays and hivemind's relays do it: a node behind a
NAT opens WebSockets *out* to one or more reachable peers, its relays, and names them in its
record (``PeerRecord.relays``). A request for it goes to one of them as
``POST /relay/<peer id>``; the relay passes the frame down the WebSocket, the node serves it
as it serves any ``/rpc`` request (``node.server``), and the reply comes back the same way.
When the sender is itself the relay (the common case: a public head and a NATed block node)
it writes to the WebSocket directly, one hop and not two.

Frames and proofs are not touched on the way: a request's proof (``protocol.auth``) is made
for the relayed node and checked by it, and its reply's seal by the sender, so in a keyed
swarm a relay can drop traffic but cannot forge or alter it. A relay checks the proof of what
it forwards too (meant for the attached node, swarm MAC, signature, fresh nonce), so a
stranger cannot use it, and a node attaches only with a proof of its identity over the
WebSocket's opening request. A stale request the relay refuses itself, sealed with its own
time, which the sender reads from the relay it sent to (``Route.relay_ids``), as it would a
node's. A relay serves at most ``net.relay_capacity`` nodes and
``net.relay_max_bytes_per_s`` bytes a second; beyond that it refuses with ``relay_busy``.

Owns: the WebSocket messages (``pack_request``, ``pack_reply``, ``unpack``), the relay's side
(``RelayHub``), the relayed node's side (``RelayClient``: relays chosen by round-trip time
and free slots, requests served, a dead relay replaced) and where a request for a relayed
peer goes (``RelayRoutes``, read by ``node.net.transport``). Does not own what frames mean
(``node.server``) or when a node needs relays (``node.services.reachability``, the daemon).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgpack
from aiohttp import web

from node.config import parse_hostport
from node.net.tcp import CongestionControl
from node.net.transport import (
    CONTENT_TYPE,
    RELAY_PATH,
    RELAY_REFUSAL_HEADER,
    RPC_PATH,
    Route,
    Served,
    StaleSeals,
    digest_of,
    read_body,
)
from protocol.auth import AUTH_HEADER, SwarmAuth, frame_digest
from protocol.errors import AuthStale, MalformedMessage, ProtocolError
from protocol.frames import Limits
from protocol.messages import Error, PeerRecord, encode_message
from swarm.seams import TransportError

log = logging.getLogger(__name__)

REQUEST, REPLY = 0, 1
FROM_RELAY = "(its relay)"
"""A request's origin when the relay itself sends it (never a host: a relay names the host
a passed-on request came from as its socket reports it)."""
REFRESH_S = 0.5
"""How stale the relays of peers in ``RelayRoutes`` may be (a table scan per half second)."""
MAX_RELAYS = 4
"""Relays of one peer a sender tries; a record may list more, the rest are ignored."""
RELAY_TIMEOUT_S = 120.0
"""Longest a relay waits for a relayed node's reply (a state transfer on a thin uplink)."""
CONNECT_TIMEOUT_S = 5.0
"""Longest attaching to a relay may take (a TCP connection and the WebSocket handshake): a
candidate that does not answer (a peer behind a NAT announcing a private address) costs no
more than this."""
HEARTBEAT_S = 10.0
"""WebSocket ping interval. A ping's answer must come within half of it (aiohttp's rule), and
crosses the relayed node's uplink, whose queue may hold a second and more (and a dropped
answer waits a retransmission timeout on top): at 2 s, a 0.5 Mbit/s uplink with a 1 s queue
lost its relay within seconds of a full queue. A relay that died is noticed within one and a
half (a closed connection at once)."""
PROBED = 4
"""Candidate relays a node connects to at once when it needs one; it keeps the best."""
ATTACH_GRACE_S = 1.0
"""Once one candidate relay has answered, how much longer the others may take, to be
compared with it (by round-trip time and free slots), before they are given up."""
RETRY_FAILED_S = 30.0
"""How long a node leaves a relay that refused it or could not be reached."""
RETRY_LOST_S = 2.0
"""How long a node leaves a relay whose link it held and lost (a peer still live is tried
again soon: it may be the only one that can relay; one that died is refused and then left
for ``RETRY_FAILED_S``)."""
WS_OVERHEAD_BYTES = 4096
"""Room for the WebSocket message's fields around a frame of the largest allowed size."""

# ---- the WebSocket messages -------------------------------------------------------------


def pack_request(req_id: int, origin: str, header: str | None, body: bytes | bytearray) -> bytes:
    """Relay to node: a request from ``origin`` (the sender's host, as the relay saw it)."""
    return msgpack.packb([REQUEST, req_id, origin, header, body])


def pack_reply(req_id: int, status: int, header: str | None, body: bytes) -> bytes:
    """Node to relay: the reply to request ``req_id``."""
    return msgpack.packb([REPLY, req_id, status, header, body])


def unpack(data: bytes, max_bytes: int) -> tuple[int, int, Any, str | None, bytes]:
    """``(kind, id, origin or status, header, frame)``; anything else is malformed."""
    if len(data) > max_bytes + WS_OVERHEAD_BYTES:
        raise MalformedMessage(f"relay message of {len(data)} bytes exceeds the frame limit")
    try:
        fields = msgpack.unpackb(data, use_list=True, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise MalformedMessage(f"relay message is not msgpack: {e}") from None
    if not (isinstance(fields, list) and len(fields) == 5):
        raise MalformedMessage("relay message is not a list of 5 fields")
    kind, req_id, third, header, body = fields
    third_type = str if kind == REQUEST else int
    if (
        kind not in (REQUEST, REPLY)
        or type(req_id) is not int
        or type(third) is not third_type
        or not (header is None or isinstance(header, str))
        or not isinstance(body, bytes)
    ):
        raise MalformedMessage("relay message fields have the wrong types")
    return kind, req_id, third, header, body


# ---- the relay's side -------------------------------------------------------------------


@dataclass
class RelayStats:
    """What a relay moved, for ``node status`` and the metrics."""

    bytes: Counter[str] = field(default_factory=Counter)
    """Frame bytes relayed, by direction: "to_node" (requests) and "from_node" (replies)."""
    requests: Counter[str] = field(default_factory=Counter)
    """Requests relayed, by outcome: "ok" or the refusal's code."""
    attaches: Counter[str] = field(default_factory=Counter)
    """Attach attempts by outcome."""


@dataclass
class _Attached:
    ws: web.WebSocketResponse
    pending: dict[int, asyncio.Future[Served]] = field(default_factory=dict)
    next_id: int = 0
    since: float = field(default_factory=time.monotonic)


class RelayRefused(TransportError):
    """The relay itself refused (gone, busy): another relay may do."""


class RelayHub:
    """Relays for the nodes attached to this one (up to ``capacity``)."""

    def __init__(
        self,
        *,
        peer_id: str,
        auth: SwarmAuth | None,
        max_frame_bytes: int,
        capacity: int,
        max_bytes_per_s: float,
        tamper: bool = False,
    ) -> None:
        self.peer_id = peer_id
        self.auth = auth
        self.max_frame_bytes = max_frame_bytes
        self.limits = Limits(max_frame_bytes=max_frame_bytes)
        self.capacity = capacity
        self.max_bytes_per_s = max_bytes_per_s
        self.tamper = tamper
        """Testing only (``net.debug_relay_tamper``): flip a byte of every relayed frame."""
        self.enabled: Callable[[], bool] = lambda: True
        """Whether this node may relay now (the daemon: not while it is relayed itself)."""
        self.on_attach: Callable[[str], None] = lambda peer_id: None
        """Called with the peer id of each node that attaches (the daemon: a reachability
        check it can now answer)."""
        self.stats = RelayStats()
        self._stale_seals = StaleSeals(auth)
        self._nodes: dict[str, _Attached] = {}
        self._budget = max_bytes_per_s
        self._budget_at = time.monotonic()

    def slots(self) -> int:
        """Nodes this one could still take (0 when it does not relay)."""
        if not self.enabled() or self.capacity <= 0:
            return 0
        return max(0, self.capacity - len(self._nodes))

    def attached(self, peer_id: str) -> bool:
        return peer_id in self._nodes

    def status(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity if self.enabled() else 0,
            "nodes": sorted(self._nodes),
            "bytes": dict(self.stats.bytes),
            "requests": dict(self.stats.requests),
            "attaches": dict(self.stats.attaches),
        }

    async def close(self) -> None:
        for node in list(self._nodes.values()):
            await node.ws.close()

    # ---- a node attaches ------------------------------------------------------------------

    async def handle_attach(self, request: web.Request) -> web.StreamResponse:
        """``GET /relay?peer=<id>``: the WebSocket of a node that cannot be dialled."""
        try:
            peer_id = self._attacher(request)
        except ProtocolError as e:
            self.stats.attaches[e.code] += 1
            return web.json_response({"error": f"{e.code}: {e}"}, status=e.http_status)
        if self.slots() <= 0 and peer_id not in self._nodes:
            self.stats.attaches["relay_busy"] += 1
            why = "this node does not relay" if not self.enabled() else "no free relay slot"
            return web.json_response({"error": f"relay_busy: {why}"}, status=503)
        ws = web.WebSocketResponse(
            heartbeat=HEARTBEAT_S, max_msg_size=self.max_frame_bytes + WS_OVERHEAD_BYTES
        )
        await ws.prepare(request)
        old = self._nodes.get(peer_id)
        node = self._nodes[peer_id] = _Attached(ws)
        if old is not None:  # the node came back on a new connection: the old one is dead
            await old.ws.close()
        self.stats.attaches["ok"] += 1
        log.info("relaying for %s (%s)", peer_id[:8], request.remote)
        self.on_attach(peer_id)
        try:
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.BINARY:
                    continue
                self._on_reply(node, msg.data)
        finally:
            if self._nodes.get(peer_id) is node:
                del self._nodes[peer_id]
                log.info("stopped relaying for %s", peer_id[:8])
            for fut in node.pending.values():
                if not fut.done():
                    fut.set_exception(RelayRefused("relay_gone", "the relayed node went away"))
        return ws

    def _attacher(self, request: web.Request) -> str:
        """The attaching node's peer id: its proof's signer in a keyed swarm."""
        peer_id = request.query.get("peer", "")
        if self.auth is None:
            if not 0 < len(peer_id) <= 64:
                raise MalformedMessage("attaching needs ?peer=<peer id>")
            return peer_id
        incoming = self.auth.accept(
            request.headers.get(AUTH_HEADER), "GET", RELAY_PATH, time.time()
        )
        incoming.verify(frame_digest([]))
        return incoming.signer

    def _on_reply(self, node: _Attached, data: bytes) -> None:
        try:
            kind, req_id, status, header, body = unpack(data, self.max_frame_bytes)
        except ProtocolError as e:
            self.stats.requests["malformed_reply"] += 1
            log.warning("dropped a malformed message from a relayed node: %s", e)
            return
        fut = node.pending.get(req_id)
        if kind != REPLY or fut is None or fut.done():
            self.stats.requests["unexpected_reply"] += 1
            return
        self.stats.bytes["from_node"] += len(body)
        fut.set_result((status, header, body))

    # ---- a frame for an attached node -----------------------------------------------------

    async def handle_forward(self, request: web.Request) -> web.Response:
        """``POST /relay/<peer id>``: pass a frame to an attached node, return its reply."""
        peer_id = request.match_info.get("peer", "")
        try:
            header = request.headers.get(AUTH_HEADER)
            incoming = None
            if self.auth is not None:  # strangers do not get relayed: the cheap checks first
                incoming = self.auth.accept_for(peer_id, header, "POST", RPC_PATH, time.time())
            body = await read_body(request, self.limits)
            if incoming is not None:
                incoming.verify(await digest_of([body]))  # a large frame off the loop
            status, reply_header, reply = await self.exchange(
                peer_id, header, body, request.remote or "?", RELAY_TIMEOUT_S
            )
        except AuthStale as e:  # not passed on; sealed with this relay's time, as a node's
            return self._refusal(e.code, str(e), e.http_status, relay=False, stale_proof=header)
        except ProtocolError as e:
            return self._refusal(e.code, str(e), e.http_status, relay=False)
        except RelayRefused as e:
            return self._refusal(e.code, e.message, 502 if e.code == "relay_gone" else 503)
        except TransportError as e:
            return self._refusal(e.code, e.message, 504)
        headers = {AUTH_HEADER: reply_header} if reply_header else None
        return web.Response(status=status, body=reply, headers=headers, content_type=CONTENT_TYPE)

    def _refusal(
        self,
        code: str,
        message: str,
        status: int,
        relay: bool = True,
        stale_proof: str | None = None,
    ) -> web.Response:
        """Count and answer a refusal: ``relay``, the relay's own (the sender tries its next
        relay); one of a request as stale (its proof header, ``stale_proof``) is sealed with
        this relay's time (``StaleSeals``), which the sender reads from its relay alone."""
        self.stats.requests[code] += 1
        refusal = Error(code=code, message=message)
        headers = {RELAY_REFUSAL_HEADER: code} if relay else None
        if stale_proof is not None:
            headers = self._stale_seals.headers(stale_proof, refusal)
        return web.Response(
            status=status,
            body=b"".join(bytes(b) for b in encode_message(refusal)),
            headers=headers,
            content_type=CONTENT_TYPE,
        )

    async def exchange(
        self,
        peer_id: str,
        header: str | None,
        body: bytes | bytearray,
        origin: str,
        timeout_s: float,
    ) -> Served:
        """Send a frame down ``peer_id``'s WebSocket and wait for its reply."""
        node = self._nodes.get(peer_id)
        if node is None:
            raise RelayRefused("relay_gone", f"peer {peer_id[:8]} is not attached to this relay")
        if not self._spend(len(body)):
            raise RelayRefused("relay_busy", f"over {self.max_bytes_per_s:.0f} relayed bytes/s")
        req_id, node.next_id = node.next_id, node.next_id + 1
        fut: asyncio.Future[Served] = asyncio.get_running_loop().create_future()
        node.pending[req_id] = fut
        if self.tamper and body:
            body = bytes([body[0], body[1] ^ 1, *body[2:]]) if len(body) > 1 else body
        try:
            await node.ws.send_bytes(pack_request(req_id, origin, header, body))
            self.stats.bytes["to_node"] += len(body)
            served = await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            self.stats.requests["timeout"] += 1
            raise TransportError("timeout", f"relayed node {peer_id[:8]} did not answer") from None
        except (ConnectionError, RuntimeError) as e:
            raise RelayRefused("relay_gone", f"relayed node {peer_id[:8]}: {e}") from None
        finally:
            node.pending.pop(req_id, None)
        self._spend(len(served[2]))
        self.stats.requests["ok"] += 1
        return served

    def _spend(self, nbytes: int) -> bool:
        """A token bucket of ``max_bytes_per_s`` (one second's burst); False when empty."""
        if self.max_bytes_per_s <= 0:
            return True
        now = time.monotonic()
        self._budget = min(
            self.max_bytes_per_s, self._budget + (now - self._budget_at) * self.max_bytes_per_s
        )
        self._budget_at = now
        if self._budget <= 0:
            return False
        self._budget -= nbytes  # a frame larger than the bucket passes once it is full
        return True


# ---- where requests for relayed peers go -------------------------------------------------


class RelayRoutes:
    """The relays of relayed peers, from the peer table, by peer id and by address."""

    def __init__(self, hub: RelayHub, records: Callable[[], Iterable[PeerRecord]]) -> None:
        self.hub = hub
        self.records = records
        """The peer table's records, read again at most every ``REFRESH_S``."""
        self._by_peer: dict[str, Route] = {}
        self._by_address: dict[str, Route | None] = {}
        """None: two relayed peers announce the address (private networks repeat)."""
        self._read_at = float("-inf")

    def update(self, records: Iterable[PeerRecord]) -> None:
        """Take the relays of the peers in ``records``."""
        records = list(records)
        at = {p.address: p.peer_id for p in records if not p.relays}  # who each relay is
        by_peer: dict[str, Route] = {}
        by_address: dict[str, Route | None] = {}
        for p in records:
            if p.relays:
                relays = tuple(p.relays[:MAX_RELAYS])
                ids = tuple(at.get(r, "") for r in relays)
                route = by_peer[p.peer_id] = Route(p.peer_id, relays, ids)
                by_address[p.address] = None if p.address in by_address else route
        self._by_peer, self._by_address = by_peer, by_address

    def route(self, address: str, peer_id: str) -> Route | None:
        """Where a request for ``peer_id`` at ``address`` goes; None: straight there. Without
        a peer id only an address that one relayed peer announces is routed."""
        now = time.monotonic()
        if now - self._read_at > REFRESH_S:
            self._read_at = now
            self.update(self.records())
        route = self._by_peer.get(peer_id) if peer_id else self._by_address.get(address)
        pid = route.peer_id if route is not None else peer_id
        if pid and self.hub.attached(pid):  # this node is its relay: over its WebSocket
            relays, ids = (route.relays, route.relay_ids) if route else ((), ())
            return Route(pid, relays, ids, local=self._local(pid))
        return route

    def _local(self, peer_id: str) -> Callable[[str | None, bytes, float], Awaitable[Served]]:
        async def exchange(header: str | None, body: bytes, timeout_s: float) -> Served:
            return await self.hub.exchange(peer_id, header, body, FROM_RELAY, timeout_s)

        return exchange


# ---- the relayed node's side ------------------------------------------------------------


@dataclass
class _Link:
    address: str
    peer_id: str
    ws: aiohttp.ClientWebSocketResponse
    rtt_s: float
    """How long attaching took: a TCP connection and one HTTP exchange."""
    slots: int
    """Nodes the relay could still take when it was chosen."""
    task: asyncio.Task[None] | None = None


def _cost(link: _Link) -> float:
    """Round-trip time, weighted up as a relay's free slots run out (its load)."""
    return link.rtt_s * (1.0 + 1.0 / max(1, link.slots))


class RelayClient:
    """This node's relays: kept ``want`` of them, attached, serving what they bring."""

    def __init__(
        self,
        *,
        peer_id: str,
        auth: SwarmAuth | None,
        max_frame_bytes: int,
        want: int,
        serve: Callable[[str | None, bytes, str, bool], Awaitable[Served]],
        congestion: CongestionControl | None = None,
    ) -> None:
        self.peer_id = peer_id
        self.congestion = congestion or CongestionControl("")
        """The congestion control of its links (``node.net.tcp``; by default the system's):
        what it serves goes up them."""
        self.auth = auth
        self.max_frame_bytes = max_frame_bytes
        self.want = want
        self.serve = serve
        """Serve one relayed frame: ``(proof header, frame, sender's host, first-hand) ->
        reply``. First-hand: the relay itself sent it, so its host is the one this node
        connected to, not the relay's word (a dial-back may then be answered)."""
        self.served: Counter[str] = Counter()
        self._links: dict[str, _Link] = {}
        self._avoid: dict[str, float] = {}
        """Relays not tried again before a time (``time.monotonic``), by address."""
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        """Link readers and the requests they hand on, held until each ends."""

    @property
    def addresses(self) -> list[str]:
        """The relays in use, best (lowest round-trip time) first."""
        return [
            link.address
            for link in sorted(self._links.values(), key=lambda link: link.rtt_s)
            if not link.ws.closed
        ]

    def status(self) -> list[dict[str, Any]]:
        return [
            {"address": link.address, "peer_id": link.peer_id, "rtt_ms": round(link.rtt_s * 1e3, 1)}
            for link in sorted(self._links.values(), key=lambda link: link.rtt_s)
        ]

    async def top_up(self, candidates: Sequence[PeerRecord]) -> bool:
        """Drop dead relays and attach to new ones until ``want`` are held; True if the set
        changed. Candidates: peers offering free slots, not tried and failed lately."""
        before = set(self.addresses)
        for address, link in list(self._links.items()):
            if link.ws.closed:
                del self._links[address]
                log.warning("relay %s went away", address)
        now = time.monotonic()
        missing = self.want - len(self._links)
        fresh = [
            p
            for p in candidates
            if p.relay_slots > 0
            and p.peer_id != self.peer_id
            and p.address not in self._links
            and now >= self._avoid.get(p.address, float("-inf"))
        ]
        if missing > 0 and fresh:
            fresh.sort(key=lambda p: -p.relay_slots)
            links = sorted(await self._probe(fresh[:PROBED]), key=_cost)
            for link in links[:missing]:
                self._links[link.address] = link
                log.info("attached to relay %s (%.1f ms)", link.address, link.rtt_s * 1e3)
            for link in links[missing:]:
                await link.ws.close()
        return set(self.addresses) != before

    async def _probe(self, relays: Sequence[PeerRecord]) -> list[_Link]:
        """Attach to ``relays`` at once; once one has answered, those still connecting get
        ``ATTACH_GRACE_S`` more, and are given up after it and left alone as failed ones
        are (a NATed candidate's private address can swallow a connection until its
        timeout; a node short of relays tops up at its next housekeeping)."""
        tasks = {asyncio.create_task(self._attach(p)): p for p in relays}
        pending: set[asyncio.Task[_Link | None]] = set(tasks)
        while pending and not any(t.done() and t.result() is not None for t in tasks):
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=ATTACH_GRACE_S)
        for task in pending:
            task.cancel()
            self._avoid[tasks[task].address] = time.monotonic() + RETRY_FAILED_S
        await asyncio.gather(*pending, return_exceptions=True)
        return [link for t in tasks if not t.cancelled() and (link := t.result()) is not None]

    async def _attach(self, relay: PeerRecord) -> _Link | None:
        if self._session is None:
            connector = aiohttp.TCPConnector(socket_factory=self.congestion.socket_factory())
            self._session = aiohttp.ClientSession(connector=connector)
        headers = None
        if self.auth is not None:
            sent = self.auth.sign_request(
                relay.address,
                "GET",
                RELAY_PATH,
                frame_digest([]),
                time.time(),
                peer_id=relay.peer_id,
            )
            headers = {AUTH_HEADER: sent.header}
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                ws = await self._session.ws_connect(
                    f"http://{relay.address}{RELAY_PATH}?peer={self.peer_id}",
                    headers=headers,
                    heartbeat=HEARTBEAT_S,
                    max_msg_size=self.max_frame_bytes + WS_OVERHEAD_BYTES,
                    timeout=aiohttp.ClientWSTimeout(ws_close=CONNECT_TIMEOUT_S),
                    receive_timeout=None,
                )
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            self._avoid[relay.address] = time.monotonic() + RETRY_FAILED_S
            why = str(e) or f"no answer in {CONNECT_TIMEOUT_S:.0f} s"
            log.info("relay %s refused or unreachable: %s", relay.address, why)
            return None
        link = _Link(relay.address, relay.peer_id, ws, time.monotonic() - t0, relay.relay_slots)
        # Read it from the first moment, while other candidates are still being tried: the
        # relay's pings are answered only by a reader, and it drops a link that leaves them
        # unanswered for a heartbeat and a half.
        link.task = asyncio.create_task(self._serve_link(link))
        self._tasks.add(link.task)  # held until it ends: a spare link's, once closed
        link.task.add_done_callback(self._tasks.discard)
        return link

    async def _serve_link(self, link: _Link) -> None:
        try:
            async for msg in link.ws:
                if msg.type != aiohttp.WSMsgType.BINARY:
                    continue
                task = asyncio.create_task(self._handle(link, msg.data))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            if self._links.get(link.address) is link:  # one in use died (not a spare closed)
                self._avoid[link.address] = time.monotonic() + RETRY_LOST_S

    async def _handle(self, link: _Link, data: bytes) -> None:
        try:
            kind, req_id, origin, header, body = unpack(data, self.max_frame_bytes)
        except ProtocolError as e:
            self.served["malformed"] += 1
            log.warning("dropped a malformed message from relay %s: %s", link.address, e)
            return
        if kind != REQUEST:
            self.served["malformed"] += 1
            return
        firsthand = origin == FROM_RELAY  # over the connection this node opened to it
        host = parse_hostport(link.address)[0] if firsthand else origin
        status, reply_header, reply = await self.serve(header, body, host, firsthand)
        self.served["ok" if status == 200 else "refused"] += 1
        # a relay that died meanwhile: the sender's request fails and is retried elsewhere
        with contextlib.suppress(ConnectionError, RuntimeError):
            if not link.ws.closed:
                await link.ws.send_bytes(pack_reply(req_id, status, reply_header, reply))

    async def close(self) -> None:
        for link in self._links.values():
            await link.ws.close()
            if link.task is not None:
                link.task.cancel()
        self._links.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None
