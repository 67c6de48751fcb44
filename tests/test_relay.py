"""Relays (``node.net.relay``): a node nobody can dial serves through a peer that can.

The process tests run real ``node join`` processes on 127.0.0.1. A node that "cannot be
dialled" announces ``127.0.0.9`` while it listens on ``127.0.0.1`` only, so any request sent
straight to its announced address is refused by the kernel: whatever reaches it came through
a relay (``tests/test_nat.py`` does the same behind a real masquerading router). The unit
tests check the pieces against hand-made examples: the WebSocket messages, where requests
for relayed peers go, the routing penalty, a relay's proof checks and the peer table's rule
that others cannot change a peer's relays.
"""

from __future__ import annotations

import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from node.client import fetch_status, request_eval
from node.demo import LocalSwarm, wait_ready
from node.display import format_status
from node.net.relay import (
    MAX_RELAYS,
    REPLY,
    REQUEST,
    RelayHub,
    RelayRoutes,
    pack_reply,
    pack_request,
    unpack,
)
from protocol.auth import AUTH_HEADER, Identity, SwarmAuth, frame_digest
from protocol.errors import AuthBadMac, AuthMisdirected, MalformedMessage
from protocol.frames import join_frame
from protocol.messages import Hello, PeerRecord, decode_message, encode_message
from swarm.peers import PeerTable
from swarm.routing import RELAY_PENALTY, route_weights
from tests.helpers import FAST_SWARM, accounted, kill_nodes, wait_for

UNDIALLABLE = ["--announce", "127.0.0.9", "--set", "net.force_relay=true"]
"""A node whose announced address refuses connections, serving through relays."""
SETTINGS = {
    **FAST_SWARM,
    "swarm.num_block_stages": "1",
    "balance.benchmark_s": "0",
    "train.hop_timeout_s": "5",
    "train.microbatch_deadline_s": "20",
    "membership.ttl_s": "8",
}


# ---- the pieces -------------------------------------------------------------------------


def test_relay_messages_round_trip_and_malformed_ones_are_refused() -> None:
    body = b"\x00frame\xff" * 10
    assert unpack(pack_request(7, "10.0.0.5", "v=1,ts=1", body), 1 << 20) == (
        REQUEST,
        7,
        "10.0.0.5",
        "v=1,ts=1",
        body,
    )
    assert unpack(pack_reply(7, 409, None, b"e"), 1 << 20) == (REPLY, 7, 409, None, b"e")
    bad = [
        b"\xc1",  # not msgpack
        msgpack.packb([REQUEST, 1, "h", None]),  # 4 fields
        msgpack.packb([9, 1, "h", None, b""]),  # unknown kind
        msgpack.packb([REQUEST, "1", "h", None, b""]),  # id not an int
        msgpack.packb([REQUEST, 1, 404, None, b""]),  # a request's origin is a host
        msgpack.packb([REPLY, 1, "200", None, b""]),  # a reply's status is a number
        msgpack.packb([REPLY, 1, 200, 5, b""]),  # header not a string
        msgpack.packb([REPLY, 1, 200, None, "text"]),  # frame not bytes
    ]
    for data in bad:
        with pytest.raises(MalformedMessage):
            unpack(data, 1 << 20)
    with pytest.raises(MalformedMessage, match="exceeds"):
        unpack(pack_request(1, "h", None, b"x" * 10_000), 1000)


def record(
    peer_id: str, address: str, relays: list[str] | None = None, version: int = 1
) -> PeerRecord:
    return PeerRecord(
        peer_id=peer_id, address=address, stage=1, relays=relays or [], version=version
    )


def hub(capacity: int = 8) -> RelayHub:
    return RelayHub(
        peer_id="me", auth=None, max_frame_bytes=1 << 20, capacity=capacity, max_bytes_per_s=0
    )


def test_routes_go_through_relays_by_peer_id_or_by_an_unshared_address() -> None:
    peers = [
        record("a", "192.168.1.2:7070", ["1.1.1.1:7070", "2.2.2.2:7070"]),
        record("b", "192.168.1.2:7070", ["3.3.3.3:7070"]),  # the same private address
        record("c", "192.168.7.9:7070", [f"{k}.0.0.1:1" for k in range(9)]),
        record("d", "5.5.5.5:7070"),  # dialled directly
    ]
    peers.append(record("r1", "1.1.1.1:7070"))  # the table knows one of a's relays
    routes = RelayRoutes(hub(), lambda: peers)
    route = routes.route("192.168.1.2:7070", "a")
    assert route is not None and route.relays == ("1.1.1.1:7070", "2.2.2.2:7070")
    assert route.relay_ids == ("r1", "")  # who each relay is, where known
    assert route.local is None
    route = routes.route("192.168.1.2:7070", "b")  # by peer id: no ambiguity
    assert route is not None and route.relays == ("3.3.3.3:7070",)
    assert routes.route("192.168.1.2:7070", "") is None  # two peers share it: ambiguous
    by_address = routes.route("192.168.7.9:7070", "")
    assert by_address is not None and by_address.peer_id == "c"
    assert len(by_address.relays) == MAX_RELAYS  # a long list is cut
    assert routes.route("5.5.5.5:7070", "d") is None
    assert routes.route("5.5.5.5:7070", "") is None


def test_the_relay_itself_talks_to_an_attached_peer_over_its_websocket() -> None:
    h = hub()
    routes = RelayRoutes(h, lambda: [record("a", "192.168.1.2:7070", ["me:1"])])
    h._nodes["a"] = object()  # type: ignore[assignment]  # attached (the socket is not used)
    route = routes.route("192.168.1.2:7070", "a")
    assert route is not None and route.local is not None and route.relays == ("me:1",)
    # attached but not yet in the table (it has just joined): still reachable, one hop
    h._nodes["z"] = object()  # type: ignore[assignment]
    route = routes.route("192.168.3.3:7070", "z")
    assert route is not None and route.local is not None and route.relays == ()


async def serving(h: RelayHub) -> tuple[Any, str]:
    """``h`` attaching nodes on 127.0.0.1: (its runner, to clean up; its address)."""
    from aiohttp import web

    from node.net.transport import RELAY_PATH

    app = web.Application()
    app.router.add_get(RELAY_PATH, h.handle_attach)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


async def reverse(header: str | None, frame: bytes, origin: str, firsthand: bool) -> Any:
    """A relayed node's serving, for the tests: the frame reversed."""
    return 200, None, frame[::-1]


async def test_a_relay_that_answered_stays_attached_while_a_silent_candidate_is_tried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node tries its candidate relays at once and keeps the best. The one that answered
    must be read from the first moment: a relay drops a link whose pings go unanswered, and
    a candidate that takes the connection and never answers (a NATed peer announcing its
    private address) is waited for up to ``ATTACH_GRACE_S`` after the first answer (before,
    up to ``CONNECT_TIMEOUT_S``: a NATed joiner learned it was NATed and then waited 5 s
    for a relay), then left alone a while."""
    import asyncio

    import node.net.relay as relay_mod

    monkeypatch.setattr(relay_mod, "HEARTBEAT_S", 2.0)  # a short test
    monkeypatch.setattr(relay_mod, "CONNECT_TIMEOUT_S", 4 * relay_mod.HEARTBEAT_S)
    monkeypatch.setattr(relay_mod, "ATTACH_GRACE_S", 2.5 * relay_mod.HEARTBEAT_S)
    h = hub()
    runner, relay_at = await serving(h)
    held: list[asyncio.StreamWriter] = []
    silent = await asyncio.start_server(lambda _r, w: held.append(w), "127.0.0.1", 0)
    silent_at = f"127.0.0.1:{silent.sockets[0].getsockname()[1]}"

    client = relay_mod.RelayClient(
        peer_id="n" * 16, auth=None, max_frame_bytes=1 << 20, want=2, serve=reverse
    )
    candidates = [
        PeerRecord(peer_id="s" * 16, address=silent_at, stage=1, relay_slots=9),
        PeerRecord(peer_id="r" * 16, address=relay_at, stage=1, relay_slots=1),
    ]
    try:
        t0 = time.monotonic()
        topping = asyncio.create_task(client.top_up(candidates))
        while not h.attached("n" * 16):
            await asyncio.sleep(0.02)
        # served while the silent candidate is still being tried, as pings must be
        assert await h.exchange("n" * 16, None, b"abc", "127.0.0.1", 2.0) == (200, None, b"cba")
        assert not topping.done()
        assert await topping
        took = time.monotonic() - t0  # the silent one was waited for, but not out
        assert relay_mod.ATTACH_GRACE_S - 0.1 <= took < relay_mod.CONNECT_TIMEOUT_S - 1.0
        assert client.addresses == [relay_at] and h.attached("n" * 16)
        await asyncio.sleep(2 * relay_mod.HEARTBEAT_S)  # pings keep being answered
        assert client.addresses == [relay_at] and h.attached("n" * 16)
        assert not await client.top_up(candidates)  # the silent one is left alone a while
    finally:
        await client.close()
        silent.close()
        for w in held:
            w.close()
        await runner.cleanup()


async def test_a_link_the_relay_dropped_is_attached_again_within_seconds() -> None:
    """A relay drops a link whose pings wait too long (a thin uplink's queue): while the
    relay is still a live peer the node attaches to it again at its next housekeeping after
    ``RETRY_LOST_S``, not after ``RETRY_FAILED_S`` (half a minute unreachable, when it is
    the only relay); one that refuses it is left alone that long."""
    import asyncio

    import node.net.relay as relay_mod

    h = hub()
    runner, relay_at = await serving(h)

    client = relay_mod.RelayClient(
        peer_id="n" * 16, auth=None, max_frame_bytes=1 << 20, want=1, serve=reverse
    )
    candidates = [PeerRecord(peer_id="r" * 16, address=relay_at, stage=1, relay_slots=8)]
    try:
        assert await client.top_up(candidates)
        await wait_for_async(lambda: h.attached("n" * 16), 5.0)
        await h._nodes["n" * 16].ws.close()  # as when its heartbeat gave up on the link
        await wait_for_async(lambda: not client.addresses, 5.0)
        assert not await client.top_up(candidates)  # too soon to try it again
        await asyncio.sleep(relay_mod.RETRY_LOST_S + 0.1)
        assert await client.top_up(candidates) and client.addresses == [relay_at]
        await wait_for_async(lambda: h.attached("n" * 16), 5.0)
        assert await h.exchange("n" * 16, None, b"abc", "127.0.0.1", 2.0) == (200, None, b"cba")
        h.capacity = 0  # now it refuses: then it is left alone for long
        await h._nodes["n" * 16].ws.close()
        await wait_for_async(lambda: not client.addresses, 5.0)
        await asyncio.sleep(relay_mod.RETRY_LOST_S + 0.1)
        assert not await client.top_up(candidates)  # tried again, refused
        h.capacity = 8
        await asyncio.sleep(relay_mod.RETRY_LOST_S + 0.1)
        assert not await client.top_up(candidates) and client.addresses == []
    finally:
        await client.close()
        await runner.cleanup()


async def wait_for_async(cond: Any, timeout_s: float) -> None:
    import asyncio

    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, "timed out"
        await asyncio.sleep(0.02)


async def test_a_relay_refuses_a_stale_request_sealed_with_its_own_time() -> None:
    """Over real HTTP, in a keyed swarm: a sender whose clock reads five minutes early sends
    to a node behind a relay. The relay refuses the request as stale without passing it on,
    sealed with its time; the sender reads that time from the relay it sent to (and only
    when its table says who that relay is), as it reads a node's own stale refusal. A fresh
    request then goes through to the node."""
    import asyncio

    from aiohttp import web

    from node.net.relay import RelayClient
    from node.net.transport import RELAY_PATH, HttpTransport, Route
    from protocol.frames import Limits
    from protocol.messages import Ack, Leave
    from swarm.seams import TransportError

    key = secrets.token_bytes(32)
    relay_auth, node_auth, sender_auth = (SwarmAuth(key, Identity.generate()) for _ in range(3))
    relay_id, node_id = relay_auth.identity.peer_id, node_auth.identity.peer_id
    h = RelayHub(
        peer_id=relay_id, auth=relay_auth, max_frame_bytes=1 << 20, capacity=2, max_bytes_per_s=0
    )
    app = web.Application()
    app.router.add_get(RELAY_PATH, h.handle_attach)
    app.router.add_post(RELAY_PATH + "/{peer}", h.handle_forward)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    relay_at = f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    served: list[bytes] = []

    async def serve(header: str | None, frame: bytes, origin: str, firsthand: bool) -> Any:
        served.append(frame)  # the node's side: answer with its own seal
        incoming = node_auth.accept(header, "POST", "/rpc", time.time())
        incoming.verify(frame_digest([frame]))
        ack = b"".join(bytes(b) for b in encode_message(Ack()))
        return 200, incoming.seal_reply(frame_digest([ack])), ack

    client = RelayClient(
        peer_id=node_id, auth=node_auth, max_frame_bytes=1 << 20, want=1, serve=serve
    )
    seen: list[tuple[str, float, float, float]] = []
    sender = HttpTransport(Limits(), sender_auth)
    sender.sealed_time = lambda *sample: seen.append(sample)
    known = Route(node_id, (relay_at,), (relay_id,))
    await sender.start()
    try:
        relay = PeerRecord(peer_id=relay_id, address=relay_at, stage=0, relay_slots=2)
        assert await client.top_up([relay])
        while not h.attached(node_id):
            await asyncio.sleep(0.02)
        sender_auth.clock_offset_s = -300.0
        for route, learned in ((known, [relay_id]), (Route(node_id, (relay_at,)), [])):
            sender.routes = lambda address, peer_id, route=route: route
            seen.clear()
            with pytest.raises(TransportError) as e:
                await sender.request("10.9.9.9:7070", Leave(peer_id=node_id), 5, node_id)
            assert e.value.code == "auth_stale", e.value
            assert [who for who, *_ in seen] == learned
            for _, sent, sealed, received in seen:  # the relay's clock is this machine's
                assert sent - 0.01 <= sealed <= received + 0.01
        assert served == [] and h.stats.requests["auth_stale"] == 2  # never passed on
        sender_auth.clock_offset_s = 0.0
        sender.routes = lambda address, peer_id: known
        await sender.request("10.9.9.9:7070", Leave(peer_id=node_id), 5, node_id)
        assert len(served) == 1 and [who for who, *_ in seen[-1:]] == [node_id]
    finally:
        await sender.close()
        await client.close()
        await runner.cleanup()


def test_routing_halves_a_relayed_replica_unless_this_node_is_its_relay() -> None:
    direct = PeerRecord(peer_id="d", address="5.5.5.5:1", stage=1, throughput=10.0)
    relayed = PeerRecord(
        peer_id="r", address="192.168.1.2:1", stage=1, throughput=10.0, relays=["6.6.6.6:1"]
    )
    w = route_weights([direct, relayed], {}, now=0.0, here="7.7.7.7:1")
    assert w == [10.0, 10.0 / RELAY_PENALTY]
    assert route_weights([direct, relayed], {}, now=0.0, here="6.6.6.6:1") == [10.0, 10.0]


def test_a_relay_checks_that_a_request_is_meant_for_the_node_it_passes_it_to() -> None:
    key = secrets.token_bytes(32)
    sender, relay, target = (SwarmAuth(key, Identity.generate()) for _ in range(3))
    body = frame_digest([b"frame"])
    now = time.time()
    sent = sender.sign_request("x:1", "POST", "/rpc", body, now, peer_id=target.identity.peer_id)
    incoming = relay.accept_for(target.identity.peer_id, sent.header, "POST", "/rpc", now)
    incoming.verify(body)  # MAC, signature and nonce hold at the relay
    target.accept(sent.header, "POST", "/rpc", now).verify(body)  # and at the node
    with pytest.raises(AuthMisdirected):  # meant for another peer than the one it is relayed to
        relay.accept_for("f" * 32, sent.header, "POST", "/rpc", now)
    stranger = SwarmAuth(secrets.token_bytes(32), Identity.generate())
    to = target.identity.peer_id
    forged = stranger.sign_request("x:1", "POST", "/rpc", body, now, peer_id=to)
    with pytest.raises(AuthBadMac):  # a stranger's request is not passed on
        relay.accept_for(to, forged.header, "POST", "/rpc", now).verify(body)


def test_nobody_but_the_peer_changes_its_relays_while_it_is_heard_directly() -> None:
    table = PeerTable("me", ttl_s=10.0)
    table.observe(record("b", "192.168.1.2:7070", ["1.1.1.1:7070"]), now=0.0, direct=True)
    # a member passes on a record of b naming itself as b's relay: not taken
    table.observe(record("b", "192.168.1.2:7070", ["6.6.6.6:666"], version=2), now=1.0)
    assert table.get("b").relays == ["1.1.1.1:7070"]  # type: ignore[union-attr]
    b_moved = record("b", "192.168.1.2:7070", ["2.2.2.2:7070"], version=3)
    table.observe(b_moved, now=2.0, direct=True)
    assert table.get("b").relays == ["2.2.2.2:7070"]  # type: ignore[union-attr]


# ---- real processes ---------------------------------------------------------------------


@pytest.fixture
def swarms(tmp_path: Path) -> Iterator[Any]:
    started: list[LocalSwarm] = []

    def make(**settings: str) -> LocalSwarm:
        s = LocalSwarm(tmp_path, {**SETTINGS, **settings})
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop(grace_s=5.0)


def counters(address: str) -> dict[str, int]:
    c: dict[str, int] = fetch_status(address)["counters"]
    return c


def all_accounted(head: dict[str, Any]) -> bool:
    """Every microbatch the head issued completed, was retried or dropped, or is pending."""
    issued, ended = accounted(head["counters"], head["pending"])
    return issued == ended


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_node_nobody_can_dial_serves_its_stage_through_the_head(swarms: Any) -> None:
    s = swarms()
    head = s.start_node(0)
    head_id = wait_ready(head, 90, s)["peer_id"]
    block = s.start_node(1, extra=UNDIALLABLE)
    st = wait_ready(block, 90, s)
    assert st["address"].startswith("127.0.0.9:")  # what peers would dial: nobody answers
    assert st["reachability"]["state"] == "relayed"
    assert [v["peer_id"] for v in st["relay"]["via"]] == [head_id]
    wait_for(lambda: counters(head).get("microbatches_completed", 0) >= 20, 120, "20 relayed mbs")
    head_st = fetch_status(head)
    assert head_st["relay"]["nodes"] == [st["peer_id"]]  # the head relays for it, one hop
    assert head_st["relay"]["requests"]["ok"] >= 40  # forwards and their backwards' acks
    assert head_st["relay"]["capacity"] == 8
    assert "relaying for 1 of up to 8 nodes" in format_status(head_st)
    block_st = fetch_status(block)
    assert block_st["relay"]["served"]["ok"] >= 20 and block_st["relay"]["capacity"] == 0
    evals = request_eval(head)
    assert evals < 5.6  # the eval microbatch went through the relay too and came back
    logs = "".join(p.read_text(errors="replace") for p in s.log_dir.glob("stage1-*.log"))
    assert "reachability: relayed" in logs and f"via {head}" in logs
    # a new replica copies the stage's weights from the relayed one: the state comes up the
    # WebSocket and through the head
    second = s.start_node(1)
    assert wait_ready(second, 90, s)["step"] > 0
    logs = "".join(p.read_text(errors="replace") for p in s.log_dir.glob("stage1-*.log"))
    assert f"from {st['peer_id'][:8]}" in logs


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_relayed_node_the_heads_table_does_not_hold_trains_through_its_neighbours(
    swarms: Any,
) -> None:
    # four stages, neighbourhood tables: the undiallable node serves stage 2, which the head
    # knows only by its summary; its relays are chosen while it joins, when its table holds
    # everyone, so the head may be one (a relay serves whoever dials it)
    s = swarms(**{"swarm.num_block_stages": "3"})
    head = s.start_node(0)
    wait_ready(head, 90, s)
    ends = {stage: s.start_node(stage) for stage in (1, 3)}
    for address in ends.values():
        wait_ready(address, 90, s)
    block = s.start_node(2, extra=UNDIALLABLE)
    st = wait_ready(block, 90, s)
    assert st["reachability"]["state"] == "relayed"
    assert {v["address"] for v in st["relay"]["via"]} <= {head, *ends.values()}
    wait_for(lambda: counters(head).get("microbatches_completed", 0) >= 10, 120, "10 mbs")
    head_st = fetch_status(head)
    assert "2" not in head_st["peers"] and head_st["stages"]["2"]["ready"] == 1
    assert not head_st["stages"]["2"]["contact"]  # a relayed replica is nobody's contact
    assert all_accounted(head_st), head_st["counters"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_when_its_relay_dies_a_node_moves_to_another_and_training_goes_on(swarms: Any) -> None:
    # head: relays for nobody; two relays serve stage 2; the undiallable node serves stage 1
    s = swarms(**{"swarm.num_block_stages": "2"})
    head = s.start_node(0, extra=["--set", "net.relay_capacity=0"])
    wait_ready(head, 90, s)
    relays = [s.start_node(2) for _ in range(2)]
    for address in relays:
        wait_ready(address, 90, s)
    block = s.start_node(1, extra=UNDIALLABLE)
    wait_ready(block, 90, s)
    via = wait_for(
        lambda: len(v := fetch_status(block)["relay"]["via"]) == 2 and v, 30, "two relays"
    )
    assert {v["address"] for v in via} == set(relays)
    wait_for(lambda: counters(head).get("microbatches_completed", 0) >= 10, 120, "10 mbs")
    first = via[0]["address"]
    kill_nodes(s, [first])
    killed_at = time.monotonic()
    before = counters(head).get("microbatches_completed", 0)
    wait_for(
        lambda: counters(head).get("microbatches_completed", 0) >= before + 20,
        120,
        "20 more microbatches after the relay died",
    )
    resumed_s = time.monotonic() - killed_at
    st = fetch_status(block)
    assert [v["address"] for v in st["relay"]["via"]] == [r for r in relays if r != first]
    assert st["reachability"]["state"] == "relayed"
    head_st = fetch_status(head)
    assert all_accounted(head_st), head_st["counters"]
    print(f"20 microbatches completed {resumed_s:.1f}s after the relay in use was killed")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_node_that_lost_its_only_relay_attaches_to_another(swarms: Any) -> None:
    # two relay-only nodes (no stage); the undiallable node keeps one relay at a time
    s = swarms()
    head = s.start_node(0, extra=["--set", "net.relay_capacity=0"])
    wait_ready(head, 90, s)
    relays = [s.start_node("relay") for _ in range(2)]
    for address in relays:
        wait_for(lambda a=address: fetch_status(a)["relay"]["capacity"] == 8, 60, "a relay")
    st = fetch_status(relays[0])
    assert st["relay_only"] and st["stage"] == -1 and "relay (no stage)" in format_status(st)
    block = s.start_node(1, extra=[*UNDIALLABLE, "--set", "net.relays=1"])
    wait_ready(block, 90, s)
    (first,) = (v["address"] for v in fetch_status(block)["relay"]["via"])
    wait_for(lambda: counters(head).get("microbatches_completed", 0) >= 10, 120, "10 mbs")
    kill_nodes(s, [first])
    killed_at = time.monotonic()
    (other,) = (r for r in relays if r != first)
    wait_for(
        lambda: [v["address"] for v in fetch_status(block)["relay"]["via"]] == [other],
        30,
        "the node to attach to the other relay",
    )
    attached_s = time.monotonic() - killed_at
    before = counters(head).get("microbatches_completed", 0)
    wait_for(
        lambda: counters(head).get("microbatches_completed", 0) >= before + 10,
        120,
        "10 more microbatches through the new relay",
    )
    assert fetch_status(block)["reachability"]["state"] == "relayed"
    assert all_accounted(fetch_status(head))
    print(f"attached to the other relay {attached_s:.1f}s after the first was killed")


def post(address: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://{address}{path}", data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_in_a_keyed_swarm_a_relay_cannot_alter_frames_nor_serve_strangers(
    swarms: Any, tmp_path: Path
) -> None:
    key_file = tmp_path / "swarm.key"
    key_file.write_text(secrets.token_hex(32))
    s = swarms(**{"net.swarm_key_file": str(key_file)})
    # a relay that flips a byte of every frame it passes on
    head = s.start_node(0, extra=["--set", "net.debug_relay_tamper=true"])
    wait_ready(head, 90, s)
    block = s.start_node(1, extra=UNDIALLABLE)
    block_id = wait_for(
        lambda: (st := fetch_status(block))["reachability"]["state"] == "relayed" and st,
        90,
        "the block node to attach to its relay",
    )["peer_id"]
    # the altered requests are refused by the node they were meant for
    wait_for(lambda: counters(block).get("rejected_auth_bad_mac", 0) >= 3, 90, "refusals")
    assert counters(head).get("microbatches_completed", 0) == 0
    # a stranger with another key can neither attach nor be relayed
    stranger = SwarmAuth(secrets.token_bytes(32), Identity.generate())
    me = record(stranger.identity.peer_id, "9.9.9.9:1")
    hello = encode_message(Hello(swarm="demo", fingerprint="?", sender=me, peers=[]))
    sent = stranger.sign_request(
        head, "POST", "/rpc", frame_digest(hello), time.time(), peer_id=block_id
    )
    refused_before = counters(block).get("rejected_auth_bad_mac", 0)
    status, body = post(head, f"/relay/{block_id}", join_frame(hello), {AUTH_HEADER: sent.header})
    assert status == 401 and decode_message(body).code == "auth_bad_mac"  # type: ignore[attr-defined]
    status, _ = post(head, f"/relay/{block_id}", join_frame(hello), {})  # no proof at all
    assert status == 401
    assert fetch_status(head)["relay"]["requests"].get("auth_bad_mac", 0) >= 1
    attach = stranger.sign_request(head, "GET", "/relay", frame_digest([]), time.time())
    req = urllib.request.Request(
        f"http://{head}/relay?peer={stranger.identity.peer_id}",
        headers={AUTH_HEADER: attach.header, "Connection": "Upgrade", "Upgrade": "websocket"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=10)
    assert refused.value.code == 401
    # none of the stranger's requests reached the block node (the tampered ones go on)
    assert fetch_status(head)["relay"]["nodes"] == [block_id]
    assert counters(block).get("rejected_auth_missing", 0) == 0
    assert counters(block).get("rejected_auth_bad_mac", 0) >= refused_before
