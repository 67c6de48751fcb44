"""Hostile and broken input against a real node's HTTP handler, one case at a time.

Each test starts a real ``Node`` in this process: its aiohttp server on 127.0.0.1 port 0
and a block-stage replica built from the seed (no worker runs, so accepted work stays
queued and nothing trains). A raw HTTP client then posts what a broken or hostile peer
would: every case must come back as an ``Error`` frame with its stable code and HTTP
status, be counted as ``rejected_<code>``, be logged at most once per code in a burst,
and leave the node serving with its weights untouched.
"""

from __future__ import annotations

import asyncio
import logging
import math
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgpack
import pytest
import torch

from node.config import resolve_config
from node.daemon import Node
from node.roles.head import HeadRole, Pending
from protocol.frames import join_frame
from protocol.messages import (
    Ack,
    Backward,
    Dropped,
    Error,
    Forward,
    GossipFollow,
    GossipRequest,
    HeadBackup,
    Hello,
    Hop,
    Message,
    MoveAnswer,
    MoveRequest,
    Obituary,
    PeerRecord,
    Ping,
    RingChunk,
    Rollback,
    decode_message,
    encode_message,
)
from protocol.quant import encode_tensor

pytestmark = pytest.mark.timeout(60)

HEAD = "00000000000000aa"
"""A head peer the node knows (in its table); its microbatches are admitted."""
OTHER = "00000000000000bb"
"""Another replica of the node's stage, known too."""
STRANGER = "00000000000000ff"
"""A peer the node has never heard of."""

SETTINGS = {
    "net.listen": "127.0.0.1:0",
    "net.zeroconf": False,
    "net.max_frame_bytes": 1 << 20,
    "node.stage": "1",
    "swarm.num_block_stages": 2,
    "sync.hold_s": 0.05,
    "balance.benchmark_s": 0,
}


async def start_node(peer_id: str | None = None, **settings: Any) -> Node:
    node = Node(resolve_config(overrides={**SETTINGS, **settings}), peer_id)
    await node.start_server()
    await node.take_stage(int(node.config.node.stage))
    now = node.clock.now()
    for peer_id, stage in ((HEAD, 0), (OTHER, node.state.stage)):
        node.table.observe(
            PeerRecord(peer_id=peer_id, address="127.0.0.1:9", stage=stage, ready=True), now
        )
    return node


@pytest.fixture
async def make_node() -> AsyncIterator[Callable[..., Any]]:
    nodes: list[Node] = []

    async def make(**settings: Any) -> Node:
        nodes.append(await start_node(**settings))
        return nodes[-1]

    yield make
    for node in nodes:
        await node.close()


async def post(node: Node, body: bytes | Message) -> tuple[int, Message]:
    data = body if isinstance(body, bytes) else join_frame(encode_message(body))
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://{node.state.address}/rpc", data=data) as resp,
    ):
        return resp.status, decode_message(await resp.read())


async def refused(node: Node, body: bytes | Message, code: str, status: int) -> Error:
    got_status, reply = await post(node, body)
    assert isinstance(reply, Error), reply
    assert (reply.code, got_status) == (code, status), reply
    assert node.counters[f"rejected_{code}"] >= 1
    return reply


def forward(
    h: torch.Tensor | None = None,
    *,
    mb_id: str = "00000000.1.1",
    stage: int = 1,
    sender: str = HEAD,
    codec: str = "fp32",
) -> Forward:
    tensors, meta = encode_tensor(torch.zeros(2, 8, 128) if h is None else h, codec, name="h")
    return Forward(
        mb_id=mb_id,
        target_stage=stage,
        path=[Hop(0, sender, "127.0.0.1:9")],
        eval=True,
        meta=meta,
        tensors=tensors,
    )


def raw_frame(header: Any, version: int = 1, tail: bytes = b"") -> bytes:
    packed = header if isinstance(header, bytes) else msgpack.packb(header)
    return struct.pack("<4sBBHI", b"MRMR", version, 0, 0, len(packed)) + packed + tail


async def test_frame_faults_are_refused_with_their_codes(make_node: Any) -> None:
    node = await make_node()
    good = raw_frame({"type": "leave", "fields": {"peer_id": "x"}, "tensors": []})
    cases = [
        (b"\0" * ((1 << 20) + 1), "frame_too_large", 413),
        (b"GET / HTTP/1.0 garbage", "bad_magic", 400),
        (b"MRMR", "truncated_frame", 400),
        (good[:-3], "truncated_frame", 400),
        (raw_frame({"type": "leave"}, version=2), "unsupported_version", 400),
        (struct.pack("<4sBBHI", b"MRMR", 1, 0, 0, 1 << 30), "header_too_large", 413),
        (raw_frame(b"\xc1\xc1\xc1"), "malformed_header", 400),
        (raw_frame([1, 2, 3]), "malformed_header", 400),
        (raw_frame({"type": "teleport", "fields": {}, "tensors": []}), "unknown_message_type", 400),
        (
            raw_frame({"type": "forward", "fields": {"mb_id": 3}, "tensors": []}),
            "malformed_message",
            400,
        ),
        (
            raw_frame(
                {"type": "leave", "fields": {}, "tensors": [["t", "complex64", [1], 0, 8]]},
                tail=bytes(64),
            ),
            "unsupported_dtype",
            400,
        ),
        (
            raw_frame(
                {
                    "type": "leave",
                    "fields": {},
                    "tensors": [["t", "float32", [1 << 20], 0, 1 << 22]],
                }
            ),
            "truncated_frame",
            400,
        ),
    ]
    for body, code, status in cases:
        await refused(node, body, code, status)
    assert node.state.ready and node.work.qsize() == 0


async def test_activation_faults_are_refused(make_node: Any) -> None:
    node = await make_node()
    before = {k: v.clone() for k, v in node.runner.module.state_dict().items()}
    nan = torch.zeros(2, 8, 128)
    nan[1, 3, 7] = float("nan")
    wrong_dtype = forward()
    wrong_dtype.tensors["h"] = torch.zeros(2, 8, 128, dtype=torch.int32)
    overflowing = forward(torch.ones(2, 8, 128), codec="int8")  # codes x scale beyond float32
    overflowing.tensors["h.scales"] = torch.full_like(overflowing.tensors["h.scales"], 1e37)
    cases = [
        (forward(torch.zeros(2, 8, 64)), "bad_shape", 400),
        (forward(torch.zeros(2, 8)), "bad_shape", 400),
        (forward(torch.zeros(1, 200, 128)), "bad_shape", 400),
        (wrong_dtype, "bad_tensor_spec", 400),
        (forward(nan), "non_finite", 400),
        (forward(torch.full((1, 2, 128), float("inf")), codec="bf16"), "non_finite", 400),
        (overflowing, "non_finite", 400),
        (forward(stage=2), "wrong_stage", 409),
        (forward(mb_id=""), "bad_microbatch_id", 400),
        (forward(mb_id="x" * 1000), "bad_microbatch_id", 400),
    ]
    for msg, code, status in cases:
        await refused(node, msg, code, status)
    assert node.work.qsize() == 0
    after = node.runner.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


async def test_duplicate_and_stale_microbatches(make_node: Any) -> None:
    node = await make_node()
    status, reply = await post(node, forward(mb_id="00000000.7.1"))
    assert (status, reply) == (200, Ack(queue=1))  # our queue, this job included
    await refused(node, forward(mb_id="00000000.7.1"), "duplicate_microbatch", 409)
    assert node.work.qsize() == 1  # the copy was not queued
    path = [
        Hop(0, HEAD, "127.0.0.1:9"),
        Hop(1, node.peer_id, node.state.address),
        Hop(2, OTHER, "x:1"),
    ]
    tensors, meta = encode_tensor(torch.zeros(2, 8, 128), "fp32", name="g")
    back = Backward(mb_id="00000000.9.1", index=1, path=path, meta=meta, tensors=tensors)
    await refused(node, back, "unknown_microbatch", 410)  # stale: never saved, or expired


async def test_a_microbatchs_ack_says_the_queue_and_rate_of_the_moment(make_node: Any) -> None:
    # the sender's router weighs this replica by them (swarm.routing), not by a record that
    # a large swarm republishes every few minutes or hours
    node = await make_node()
    assert (await post(node, forward(mb_id="00000000.1.1")))[1] == Ack(queue=1)
    node.runner.seed_rate(12.5)
    assert (await post(node, forward(mb_id="00000000.2.1")))[1] == Ack(queue=2, service_rate=12.5)


async def test_records_with_impossible_figures_are_refused(make_node: Any) -> None:
    # routing divides by a record's queue and rate, CheckFree weighs by its gradient norm: a
    # negative or non-finite figure (a ZeroDivisionError in every sender's router before
    # this check) is refused where it is decoded, and nothing else of the message is taken
    node = await make_node()
    fine = PeerRecord(peer_id=STRANGER, address="127.0.0.1:9", stage=1)
    for bad in ({"queue": -1}, {"throughput": float("inf")}, {"grad_norm": float("nan")}):
        ping = Ping(HEAD, [fine, PeerRecord(peer_id=OTHER, address="x:1", stage=1, **bad)], [])
        reply = await refused(node, ping, "malformed_message", 400)
        assert "ping.news[1]" in reply.message
        hello = Hello(
            swarm=node.config.swarm.name,
            fingerprint=node.fingerprint,
            sender=PeerRecord(peer_id=STRANGER, address="127.0.0.1:9", stage=0, **bad),
            peers=[],
        )
        await refused(node, hello, "malformed_message", 400)
    assert STRANGER not in node.table and node.table.get(OTHER) == PeerRecord(
        peer_id=OTHER, address="127.0.0.1:9", stage=1, ready=True
    )
    assert (await post(node, forward()))[0] == 200  # and it serves on


async def test_an_obituary_that_would_leave_no_higher_incarnation_is_refused(
    make_node: Any,
) -> None:
    # a node answers a report of its death with a higher incarnation: one at 2**64 - 1 made
    # it answer with 2**64, which msgpack cannot encode, and every message it sent failed
    node = await make_node()
    before = node.membership.own().incarnation
    for incarnation in (2**64 - 1, 2**53 - 1):
        ping = Ping(HEAD, [], [Obituary(node.peer_id, incarnation)])
        await refused(node, ping, "malformed_message", 400)
    assert node.membership.own().incarnation == before
    ping = Ping(HEAD, [], [Obituary(node.peer_id, before)])  # a false alarm: answered
    assert (await post(node, ping))[0] == 200
    assert node.membership.own().incarnation == before + 1


async def test_head_refuses_stale_and_foreign_microbatches(make_node: Any) -> None:
    node = await make_node(**{"node.stage": "0"})
    last = Hop(2, OTHER, "127.0.0.1:9")
    node.table.observe(PeerRecord(peer_id=OTHER, address="x:1", stage=2, ready=True), 0.0)
    home = forward(stage=0, sender=OTHER)
    stale = Forward(**{**home.__dict__, "path": [Hop(0, node.peer_id, node.state.address), last]})
    await refused(node, stale, "stale_microbatch", 410)
    foreign = Forward(**{**home.__dict__, "path": [Hop(0, HEAD, "x:2"), last]})
    await refused(node, foreign, "not_on_path", 400)


async def test_a_drop_notice_re_issues_only_a_pending_microbatch_of_the_head(
    make_node: Any,
) -> None:
    block = await make_node()
    notice = Dropped(mb_id="00000000.1.1.00ff00ff00ff00ff", stage=1, sender=OTHER)
    await refused(block, notice, "wrong_stage", 409)  # only a head takes drop notices
    node = await make_node(**{"node.stage": "0"})
    node.table.observe(PeerRecord(peer_id=OTHER, address="x:1", stage=1, ready=True), 0.0)
    await refused(node, Dropped(mb_id="m" * 129, stage=1, sender=OTHER), "bad_microbatch_id", 400)
    await refused(node, Dropped(mb_id="m", stage=-1, sender=OTHER), "malformed_message", 400)
    await refused(node, Dropped(mb_id="m", stage=1, sender=STRANGER), "unknown_peer", 403)
    await refused(node, notice, "stale_microbatch", 410)  # not pending here: nothing to re-issue
    role = node.role
    assert isinstance(role, HeadRole)
    ids = torch.zeros(2, 8, dtype=torch.long)
    pending = Pending(1, ids, ids, attempt=1, deadline_s=1e12, mb_id=notice.mb_id)
    role.pending[notice.mb_id] = pending
    assert (await post(node, notice)) == (200, Ack())
    assert pending.deadline_s == 0.0  # the head's loop re-issues it on its next turn
    assert node.counters["drop_notices"] == 1
    pending.deadline_s = math.inf  # its gradient is being applied: left to finish
    assert (await post(node, notice)) == (200, Ack(detail="finishing"))
    assert pending.deadline_s == math.inf and node.counters["drop_notices"] == 1


async def test_unknown_and_banned_peers_are_refused(make_node: Any) -> None:
    node = await make_node()
    await refused(node, forward(sender=STRANGER), "unknown_peer", 403)
    gossip = GossipRequest(stage=1, round=0, sender=STRANGER, meta={})
    await refused(node, gossip, "unknown_peer", 403)
    follow = GossipFollow(stage=1, round=0, sender=STRANGER)
    await refused(node, follow, "unknown_peer", 403)
    await refused(node, HeadBackup(step=1, sender=STRANGER), "unknown_peer", 403)
    await refused(node, Rollback(stage=2, step=1, sender=STRANGER), "unknown_peer", 403)
    await refused(node, MoveRequest(stage=1, target=2, sender=STRANGER), "unknown_peer", 403)
    # a known peer, but not a head node: its "head backup" is not kept
    await refused(node, HeadBackup(step=1, sender=OTHER), "wrong_stage", 409)
    assert node.recovery.head_backup is None
    assert (await post(node, HeadBackup(step=1, sender=HEAD)))[0] == 200
    assert node.recovery.head_backup is not None and node.recovery.head_backup[0] == 1
    node.guard.ban(HEAD, "gossip", "too_far", "test")
    await refused(node, forward(), "banned", 403)
    hello = Hello(
        swarm=node.config.swarm.name,
        fingerprint=node.fingerprint,
        sender=PeerRecord(peer_id=HEAD, address="127.0.0.1:9", stage=0),
        peers=[],
    )
    await refused(node, hello, "banned", 403)
    assert node.counters["peers_banned"] == 1
    assert node.counters["weights_refused:gossip:too_far"] == 1
    # a stranger may still introduce itself; then it is known
    hello = Hello(
        swarm=node.config.swarm.name,
        fingerprint=node.fingerprint,
        sender=PeerRecord(peer_id=STRANGER, address="127.0.0.1:9", stage=0),
        peers=[],
    )
    assert (await post(node, hello))[0] == 200
    assert (await post(node, forward(sender=STRANGER)))[0] == 200


async def test_a_flooding_peer_is_rate_limited_and_others_are_not(make_node: Any) -> None:
    node = await make_node(**{"net.rate_limit_per_s": 0.5, "net.rate_limit_burst": 3})
    for i in range(3):
        assert (await post(node, forward(mb_id=f"00000000.{i}.1")))[0] == 200
    await refused(node, forward(mb_id="00000000.9.1"), "rate_limited", 429)
    assert (await post(node, forward(mb_id="00000000.9.1", sender=OTHER)))[0] == 200


async def test_queued_work_is_bounded_in_jobs_and_bytes(make_node: Any) -> None:
    node = await make_node(**{"train.max_queue": 2})
    for i in range(2):
        assert (await post(node, forward(mb_id=f"00000000.{i}.1")))[0] == 200
    await refused(node, forward(mb_id="00000000.5.1"), "busy", 503)
    one_job = 2 * 8 * 128 * 4
    node = await make_node(**{"net.max_queued_bytes": 2 * one_job + 1})
    for i in range(2):
        assert (await post(node, forward(mb_id=f"00000000.{i}.1")))[0] == 200
    await refused(node, forward(mb_id="00000000.5.1"), "overloaded", 503)
    node.work._queue.get_nowait()  # the worker took one: room again
    node.work._job_bytes.pop(min(node.work._job_bytes))
    assert (await post(node, forward(mb_id="00000000.6.1")))[0] == 200


async def test_gossip_and_ring_faults(make_node: Any) -> None:
    node = await make_node()
    wrong = GossipRequest(stage=2, round=0, sender=OTHER, meta={})
    await refused(node, wrong, "wrong_stage", 409)
    await refused(node, GossipFollow(stage=2, round=0, sender=OTHER), "wrong_stage", 409)
    # a round this replica never offered anything to: no contribution to follow
    await refused(node, GossipFollow(stage=1, round=-1, sender=OTHER), "stale", 409)
    ring = await make_node(**{"sync.method": "diloco"})
    ring.table.observe(PeerRecord(peer_id=OTHER, address="x:1", stage=1, ready=True), 0.0)
    for round_id, code, status in (
        ("nonsense", "bad_round_id", 400),
        ("diloco:1:x", "bad_round_id", 400),
        ("diloco:2:5", "wrong_stage", 409),
    ):
        chunk = RingChunk(round_id=round_id, members_hash="h", phase="reduce", step=0, meta={})
        await refused(ring, chunk, code, status)
    chunk = RingChunk(round_id="diloco:1:5", members_hash="h", phase="sideways", step=0, meta={})
    await refused(ring, chunk, "bad_ring_step", 400)
    # a schedule place no honest member sends (the ring carries it beside the chunk)
    for side in ([float("nan")], [1.0] * 9):
        chunk = RingChunk("diloco:1:5", "h", "reduce", 0, {}, side=side)
        await refused(ring, chunk, "malformed_message", 400)
    ring.sync.forget_stale_rounds()  # must not choke on anything a peer sent


async def test_a_handler_bug_is_an_internal_error_not_a_crash(
    make_node: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = await make_node()

    def boom(*args: Any) -> None:
        raise RuntimeError("handler bug")

    monkeypatch.setattr(node.membership, "handle_hello", boom)
    hello = Hello(swarm="s", fingerprint="f", sender=PeerRecord("p", "a:1", 0), peers=[])
    await refused(node, hello, "internal_error", 500)
    assert (await post(node, forward()))[0] == 200


async def test_each_kind_of_refusal_is_logged_once_per_burst(
    make_node: Any, caplog: pytest.LogCaptureFixture
) -> None:
    node = await make_node()
    with caplog.at_level(logging.WARNING, logger="node.daemon"):
        for _ in range(20):
            await post(node, b"GET / HTTP/1.0")
            await post(node, forward(torch.zeros(2, 8, 64)))
    assert node.counters["rejected_bad_magic"] == 20
    assert node.counters["rejected_bad_shape"] == 20
    refusals = [r for r in caplog.records if "refused request" in r.getMessage()]
    assert len(refusals) == 2, [r.getMessage() for r in refusals]


async def test_a_move_request_to_nowhere_is_refused_and_a_replicas_is_answered(
    make_node: Any,
) -> None:
    node = await make_node()
    for target in (0, 1, 3, -1):  # the head stage, its own stage, past the last, negative
        await refused(node, MoveRequest(stage=1, target=target, sender=OTHER), "bad_move", 400)
    assert node.balancer.answers == {"granted": 0, "refused": 0}
    status, reply = await post(node, MoveRequest(stage=1, target=2, sender=OTHER))
    assert status == 200 and reply == MoveAnswer(granted=True, reason="")
    # the stage-mate let go is leaving: another may not leave meanwhile, nor may we
    status, reply = await post(node, MoveRequest(stage=1, target=2, sender=HEAD))
    assert isinstance(reply, MoveAnswer) and not reply.granted, reply
    assert "moves first" in reply.reason
    assert node.balancer.answers == {"granted": 1, "refused": 1}
    assert not node.balancer.lock.want(node.clock.now())
    assert node.state.serving


async def test_a_peer_that_never_finishes_joining_holds_refills_only_until_the_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stranger says hello as a replica of stage 1 that is not ready, and heartbeats so.
    Stage 2 is empty and this node, the lower id of stage 1's two ready replicas, is the
    one to refill it; a refill waits while a replica joins (it may be the refill), but for
    this one only ``balance.transit_limit_s``: then the node moves, and says why."""
    caplog.set_level(logging.INFO)
    limit_s = 2.0
    node = await start_node(
        "0000000000000011",
        **{"recovery.refill_wait_s": 0.2, "balance.transit_limit_s": limit_s},
    )
    try:
        stuck = PeerRecord(peer_id=STRANGER, address="127.0.0.1:9", stage=1, incarnation=1)
        hello = Hello(
            swarm=node.config.swarm.name, fingerprint=node.fingerprint, sender=stuck, peers=[]
        )
        assert (await post(node, hello))[0] == 200
        start = node.clock.now()
        while node.state.stage == 1 and node.clock.now() - start < limit_s + 3:
            assert (await post(node, Ping(STRANGER, [stuck], [])))[0] == 200  # a heartbeat
            waited = node.clock.now() - start
            await node.recovery.check()
            if node.state.stage == 1:
                await asyncio.sleep(0.2)
        assert node.state.stage == 2 and node.state.serving, node.recovery.empty_since
        assert limit_s <= waited < limit_s + 1.0, waited  # not before the limit, soon after
        assert node.counters["transit_overdue"] == 1
        assert "no longer wait for it" in caplog.text and "stage 2 empty for" in caplog.text
        assert node.table.get(STRANGER) == stuck  # still known, still not counted ready
    finally:
        await node.close()
