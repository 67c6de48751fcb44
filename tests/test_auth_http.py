"""A keyed node's HTTP server, for real on 127.0.0.1, against good, stranger's, wrong-key,
replayed, tampered and impersonating requests (the daemon's handlers, no model loaded)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest

from node.client import NodeRefused, post_to_node
from node.config import resolve_config
from node.daemon import Node
from node.net.transport import LARGE_DIGEST_BYTES, RPC_PATH, HttpTransport, digest_of
from node.stage.export import fetch_stage_state
from protocol.auth import AUTH_HEADER, Identity, SwarmAuth, frame_digest
from protocol.frames import Limits, join_frame
from protocol.messages import (
    Ack,
    Error,
    Hello,
    Leave,
    Message,
    PeerRecord,
    Welcome,
    decode_message,
    encode_message,
)
from swarm.seams import TransportError

pytestmark = pytest.mark.timeout(60)

KEY = "a swarm key for the tests"
ALICE = Identity.from_seed(bytes(range(32)))
MALLORY = Identity.from_seed(bytes(32 * [7]))


async def started(**settings: str) -> Node:
    config = resolve_config(
        overrides={"net.listen": "127.0.0.1:0", "net.zeroconf": "false", **settings}
    )
    node = Node(config)
    await node.start_server()
    return node


@pytest.fixture
async def keyed() -> AsyncIterator[Node]:
    node = await started(**{"net.swarm_key": KEY})
    yield node
    await node.close()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def hello(node: Node, who: Identity) -> Hello:
    record = PeerRecord(peer_id=who.peer_id, address="127.0.0.1:9", stage=1)
    return Hello(
        swarm=node.config.swarm.name, fingerprint=node.fingerprint, sender=record, peers=[]
    )


def signed(
    node: Node, msg: Message, who: Identity = ALICE, key: str = KEY, now: float | None = None
) -> tuple[dict[str, str], bytes]:
    buffers = encode_message(msg)
    sent = SwarmAuth(key.encode(), who).sign_request(
        node.state.address, "POST", RPC_PATH, frame_digest(buffers), now or time.time()
    )
    return {AUTH_HEADER: sent.header}, join_frame(buffers)


async def post(
    session: aiohttp.ClientSession, node: Node, headers: dict[str, str], body: bytes
) -> tuple[int, Message]:
    async with session.post(
        f"http://{node.state.address}{RPC_PATH}", data=body, headers=headers
    ) as r:
        return r.status, decode_message(await r.read())


async def test_members_talk_and_replies_are_sealed(keyed: Node) -> None:
    transport = HttpTransport(Limits(), SwarmAuth(KEY.encode(), ALICE))
    await transport.start()
    try:
        reply = await transport.request(keyed.state.address, hello(keyed, ALICE), timeout_s=5)
        assert isinstance(reply, Welcome) and reply.sender.peer_id == keyed.peer_id
        assert ALICE.peer_id in {p.peer_id for p in keyed.table.records()}
        await transport.request(keyed.state.address, Leave(peer_id=ALICE.peer_id), timeout_s=5)
        assert ALICE.peer_id not in {p.peer_id for p in keyed.table.records()}
    finally:
        await transport.close()
    assert keyed.status()["auth"] == "swarm_key"
    assert keyed.peer_id == keyed.identity.peer_id
    assert not any(k.startswith("rejected_") for k in keyed.counters)


async def test_strangers_replays_forgeries_and_impersonators_are_refused(
    keyed: Node, session: aiohttp.ClientSession
) -> None:
    leave = Leave(peer_id=ALICE.peer_id)
    good_headers, good_body = signed(keyed, leave)
    _, other_body = signed(keyed, Leave(peer_id=MALLORY.peer_id))
    cases: list[tuple[str, Callable[[], tuple[dict[str, str], bytes]], int, str]] = [
        ("no key", lambda: ({}, good_body), 401, "auth_missing"),
        (
            "wrong key",
            lambda: signed(keyed, leave, key="not the swarm's key!"),
            401,
            "auth_bad_mac",
        ),
        ("tampered", lambda: (good_headers, other_body), 401, "auth_bad_mac"),
        ("stale", lambda: signed(keyed, leave, now=time.time() - 300), 401, "auth_stale"),
        ("impersonating", lambda: signed(keyed, leave, who=MALLORY), 403, "identity_mismatch"),
        ("garbled", lambda: ({AUTH_HEADER: "v=1,ts=oops"}, good_body), 401, "auth_malformed"),
    ]
    status, reply = await post(session, keyed, good_headers, good_body)
    assert (status, reply) == (200, Ack())
    status, reply = await post(session, keyed, good_headers, good_body)  # the same bytes again
    assert (status, getattr(reply, "code", None)) == (401, "auth_replay")
    for what, make, want_status, code in cases:
        status, reply = await post(session, keyed, *make())
        assert isinstance(reply, Error), what
        assert (status, reply.code) == (want_status, code), (what, reply)
    counters = keyed.status()["counters"]
    expected = Counter(f"rejected_{code}" for code in ["auth_replay", *(c[3] for c in cases)])
    assert {k: v for k, v in counters.items() if k.startswith("rejected_")} == expected
    # /eval and /profile cost the swarm work: a keyed node wants a proof there too
    for path in ["/eval", "/profile"]:
        async with session.post(f"http://{keyed.state.address}{path}") as r:
            assert r.status == 401 and "auth_missing" in (await r.json())["error"], path
    proof = SwarmAuth(KEY.encode(), ALICE).sign_request(
        keyed.state.address, "POST", "/profile", frame_digest([]), time.time()
    )
    async with session.post(
        f"http://{keyed.state.address}/profile", headers={AUTH_HEADER: proof.header}
    ) as r:  # let in, and this node has no stage to profile
        assert r.status == 409 and "not_ready" in (await r.json())["error"]
    # /status stays open (read-only operator information, documented in SECURITY.md)
    async with session.get(f"http://{keyed.state.address}/status") as r:
        assert r.status == 200 and KEY not in await r.text()


async def test_a_refusal_as_stale_is_sealed_with_the_nodes_time(
    keyed: Node, session: aiohttp.ClientSession
) -> None:
    """Over real HTTP: the refusal carries the node's time under a seal the requester can
    check (``SEALED_REFUSALS_PER_S`` of them a second; then unsealed); the transport reports
    every seal's time, a successful reply's and a stale refusal's."""
    from node.net.transport import SEALED_REFUSALS_PER_S
    from protocol.auth import parse_proof

    alice = SwarmAuth(KEY.encode(), ALICE)
    seen: list[tuple[str, float, float, float]] = []
    transport = HttpTransport(Limits(), alice)
    transport.sealed_time = lambda *sample: seen.append(sample)
    await transport.start()
    try:
        await transport.request(keyed.state.address, hello(keyed, ALICE), timeout_s=5)
        alice.clock_offset_s = -300.0  # her proofs now read five minutes early
        with pytest.raises(TransportError) as e:
            await transport.request(keyed.state.address, Leave(peer_id=ALICE.peer_id), 5)
        assert e.value.code == "auth_stale"
    finally:
        await transport.close()
    assert [who for who, *_ in seen] == [keyed.peer_id, keyed.peer_id]
    for _, sent, sealed, received in seen:  # the node's clock is this machine's
        assert sent - 0.01 <= sealed <= received + 0.01
    sealed_headers = 0
    for _ in range(int(SEALED_REFUSALS_PER_S) + 5):  # a flood: signatures are not free
        headers, body = signed(keyed, Leave(peer_id=ALICE.peer_id), now=time.time() - 300)
        url = f"http://{keyed.state.address}{RPC_PATH}"
        async with session.post(url, data=body, headers=headers) as r:
            assert r.status == 401
            seal = r.headers.get(AUTH_HEADER)
            if seal is not None:
                sealed_headers += 1
                assert parse_proof(seal).to == ALICE.peer_id
    assert SEALED_REFUSALS_PER_S - 2 <= sealed_headers <= SEALED_REFUSALS_PER_S + 2
    assert keyed.counters["rejected_auth_stale"] == int(SEALED_REFUSALS_PER_S) + 6

    # the operator's commands on a machine whose clock is off: stamped again, once
    operator = SwarmAuth(KEY.encode(), Identity.generate())
    operator.clock_offset_s = -300.0
    with pytest.raises(NodeRefused, match="not_ready"):  # let in: this node has no stage
        await asyncio.to_thread(post_to_node, keyed.state.address, "/profile", operator, 10)
    assert operator.clock_offset_s == pytest.approx(0.0, abs=1.0)
    assert keyed.counters["rejected_auth_stale"] == int(SEALED_REFUSALS_PER_S) + 7


async def test_open_and_keyed_nodes_do_not_talk(keyed: Node) -> None:
    stranger = HttpTransport(Limits())
    member = HttpTransport(Limits(), SwarmAuth(KEY.encode(), ALICE))
    open_node = await started()
    await stranger.start()
    await member.start()
    try:
        with pytest.raises(TransportError) as e:
            await stranger.request(keyed.state.address, hello(keyed, ALICE), timeout_s=5)
        assert e.value.code == "auth_missing"
        with pytest.raises(TransportError) as e:  # an unsealed reply proves no membership
            await member.request(open_node.state.address, hello(open_node, ALICE), timeout_s=5)
        assert e.value.code == "auth_missing"
        reply = await stranger.request(
            open_node.state.address, hello(open_node, ALICE), timeout_s=5
        )
        assert isinstance(reply, Welcome)
        assert open_node.status()["auth"] == "open"
    finally:
        await stranger.close()
        await member.close()
        await open_node.close()


def test_a_keyed_node_takes_no_foreign_peer_id() -> None:
    config = resolve_config(overrides={"net.swarm_key": KEY})
    with pytest.raises(ValueError, match="identity"):
        Node(config, peer_id="0" * 16)
    assert Node(config, identity=ALICE).peer_id == ALICE.peer_id
    assert Node(resolve_config(), peer_id="0" * 16).peer_id == "0" * 16  # open: the test hook


async def test_large_frames_are_hashed_off_the_loop_to_the_same_digest() -> None:
    big = [b"head", memoryview(bytes(range(256)) * (LARGE_DIGEST_BYTES // 256 + 1))]
    assert await digest_of(big) == frame_digest(big) == await digest_of([b"".join(big)])
    assert await digest_of([b"small"]) == frame_digest([b"small"])


async def test_node_export_seals_its_state_fetches(keyed: Node) -> None:
    member = SwarmAuth(KEY.encode(), ALICE)
    with pytest.raises(ValueError, match="auth_missing"):
        await asyncio.to_thread(fetch_stage_state, keyed.state.address, 1, 5.0)
    # past the proof, the node answers for itself: it serves no stage yet
    with pytest.raises(ValueError, match="not_ready"):
        await asyncio.to_thread(fetch_stage_state, keyed.state.address, 1, 5.0, member)
