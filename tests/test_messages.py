"""Typed messages: round trips, strict field checking, unknown types, kept frames."""

import dataclasses

import pytest
import torch

from protocol.errors import MalformedMessage, ProtocolError, UnknownMessageType
from protocol.frames import SMALL_FRAME_BYTES, encode_frame, frame_nbytes, join_frame
from protocol.messages import (
    MESSAGE_TYPES,
    Ack,
    Backward,
    DialBack,
    DialBackResult,
    DialProbe,
    Dropped,
    Error,
    FetchState,
    Forward,
    GossipFollow,
    GossipReply,
    GossipRequest,
    HeadBackup,
    Hello,
    Hop,
    Leave,
    MoveAnswer,
    MoveRequest,
    Obituary,
    PeerRecord,
    Ping,
    Pong,
    Probe,
    RingChunk,
    Rollback,
    StageState,
    StageSummary,
    Welcome,
    decode_message,
    encode_message,
    expect,
    prepare,
)


def roundtrip(msg):  # type: ignore[no-untyped-def]
    return decode_message(join_frame(encode_message(msg)))


def test_every_message_type_round_trips() -> None:
    rec = PeerRecord(peer_id="ab", address="1.2.3.4:5", stage=2, step=7, throughput=1.5, loss=None)
    path = [Hop(0, "h", "1.1.1.1:1"), Hop(1, "b", "2.2.2.2:2")]
    h = torch.randn(2, 3, 4).to(torch.bfloat16)
    msgs = [
        Hello(swarm="s", fingerprint="f", sender=rec, peers=[rec]),
        Welcome(swarm="s", fingerprint="f", sender=rec, peers=[], observed_host="9.9.9.9"),
        Leave(peer_id="ab", incarnation=3),
        Ping(sender="ab", news=[rec], deaths=[Obituary("cd", 4, left=True)]),
        Ping(sender="ab", stages=[StageSummary(5, 3, 2, 12.5, 40, 1.25, "1.2.3.4:5")]),
        Welcome("s", "f", rec, [], "9.9.9.9", stages=[StageSummary(0, 0, 0, 0.0, 0, 0.0)]),
        Pong(sender=rec, news=[], deaths=[Obituary("cd", 4)]),
        Pong(),
        Probe(sender="ab", target="cd"),
        Forward(
            mb_id="m",
            target_stage=2,
            path=path,
            eval=False,
            meta={"codec": "bf16"},
            tensors={"h": h},
        ),
        Backward(mb_id="m", index=1, path=path, meta={}, tensors={"g": h}),
        Dropped(mb_id="m", stage=2, sender="p" * 32),
        Ack(),
        Error(code="busy", message="queue full"),
        FetchState(stage=1),
        StageState(stage=1, step=3, samples=96, tensors={"param.w": torch.ones(3)}),
        GossipRequest(
            stage=1, round=4, sender="ab", meta={"codec": "fp32"}, tensors={"phi": torch.ones(2)}
        ),
        GossipFollow(stage=1, round=4, sender="ab"),
        GossipReply(round=4, meta={}, tensors={"phi": torch.zeros(2)}),
        RingChunk(
            round_id="dp:1:7",
            members_hash="h",
            phase="reduce",
            step=0,
            meta={},
            tensors={"c": torch.ones(5)},
        ),
        HeadBackup(step=3, sender="p" * 32, tensors={"param.lm_head.weight": torch.ones(2, 2)}),
        Rollback(stage=2, step=40, sender="p" * 32),
        DialBack(address="10.0.0.7:7070", nonce="n1", sender="p" * 32),
        DialProbe(nonce="n1"),
        DialBackResult(reached=False, observed_host="10.0.0.9", detail="refused"),
        MoveRequest(stage=1, target=3, sender="p" * 32),
        MoveAnswer(granted=False, reason="a mate leaves first"),
    ]
    assert {type(m) for m in msgs} == set(MESSAGE_TYPES.values())
    for msg in msgs:
        out = roundtrip(msg)
        assert type(out) is type(msg)
        assert out == msg  # tensors are excluded from equality; compare them below
        assert out.tensors.keys() == msg.tensors.keys()
        for k, t in msg.tensors.items():
            assert torch.equal(out.tensors[k], t)


def test_nested_records_become_dataclasses() -> None:
    out = roundtrip(
        Forward(mb_id="m", target_stage=1, path=[Hop(0, "h", "a:1")], eval=True, meta={})
    )
    assert isinstance(out, Forward) and out.path == [Hop(0, "h", "a:1")]


def test_missing_field_is_malformed() -> None:
    buf = join_frame(encode_frame("leave", {}, {}))
    with pytest.raises(MalformedMessage, match="peer_id"):
        decode_message(buf)


@pytest.mark.parametrize(
    "fields",
    [
        {"mb_id": 5, "target_stage": 1, "path": [], "eval": False, "meta": {}},
        {"mb_id": "m", "target_stage": "1", "path": [], "eval": False, "meta": {}},
        {"mb_id": "m", "target_stage": True, "path": [], "eval": False, "meta": {}},
        {"mb_id": "m", "target_stage": 1, "path": [{"stage": 0}], "eval": False, "meta": {}},
        {"mb_id": "m", "target_stage": 1, "path": "x", "eval": False, "meta": {}},
        {"mb_id": "m", "target_stage": 1, "path": [], "eval": 1, "meta": {}},
        {"mb_id": "m", "target_stage": 1, "path": [], "eval": False, "meta": []},
    ],
)
def test_mistyped_fields_are_malformed(fields: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(MalformedMessage) as info:
        decode_message(join_frame(encode_frame("forward", fields, {})))
    assert info.value.code == "malformed_message"


def test_unknown_type() -> None:
    with pytest.raises(UnknownMessageType) as info:
        decode_message(join_frame(encode_frame("launch_missiles", {}, {})))
    assert isinstance(info.value, ProtocolError) and info.value.code == "unknown_message_type"


def test_extra_fields_are_ignored_for_forward_compatibility() -> None:
    out = decode_message(join_frame(encode_frame("leave", {"peer_id": "x", "new_field": 1}, {})))
    assert out == Leave(peer_id="x")


def test_expect() -> None:
    assert expect(Ack(), Ack) == Ack()
    with pytest.raises(MalformedMessage, match="busy"):
        expect(Error(code="busy", message="full"), Ack)
    with pytest.raises(MalformedMessage, match="expected"):
        expect(Leave(peer_id="x"), Ack)


def _hop(**overrides: object) -> dict[str, object]:
    return {"stage": 0, "peer_id": "h", "address": "a:1", **overrides}


@pytest.mark.parametrize(
    ("msg_type", "fields", "message"),
    [
        (
            "forward",
            {
                "mb_id": "m",
                "target_stage": 1,
                "eval": False,
                "meta": {},
                "path": [_hop(), {"stage": 1, "peer_id": "b"}],
            },
            "forward.path[1] lacks field 'address'",
        ),
        (
            "forward",
            {
                "mb_id": "m",
                "target_stage": 1,
                "eval": False,
                "meta": {},
                "path": [_hop(), _hop(), _hop(stage="2")],
            },
            "forward.path[2].stage: str is not int",
        ),
        (
            "forward",
            {"mb_id": "m", "target_stage": 1, "eval": False, "meta": {}, "path": 3},
            "forward.path: int is not list",
        ),
        (
            "hello",
            {
                "swarm": "s",
                "fingerprint": "f",
                "peers": [],
                "sender": {"peer_id": "p", "address": "a:1", "stage": 0, "loss": "low"},
            },
            "hello.sender.loss: str is not float | None",
        ),
        (
            "welcome",
            {"swarm": "s", "fingerprint": "f", "peers": [], "observed_host": "h"},
            "welcome lacks field 'sender'",
        ),
    ],
)
def test_a_refusal_says_where_the_bad_field_is(
    msg_type: str, fields: dict[str, object], message: str
) -> None:
    with pytest.raises(MalformedMessage) as info:
        decode_message(join_frame(encode_frame(msg_type, fields)))
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("msg", "message"),
    [
        (
            Ping("a", [PeerRecord("p", "a:1", 1), PeerRecord("q", "a:1", 1, queue=-2)], []),
            "ping.news[1]: queue -2 is negative",
        ),
        (
            Pong(sender=PeerRecord("p", "a:1", 1, throughput=float("inf"))),
            "pong.sender: throughput inf is not a finite number >= 0",
        ),
        (Pong(wall_ms=-5), "pong: wall_ms -5 is negative"),
        (
            Welcome("s", "f", PeerRecord("p", "a:1", 0, loss=float("nan")), [], "h"),
            "welcome.sender: loss nan is not finite",
        ),
        (
            Hello("s", "f", PeerRecord("p", "a:1", 2, step_s=-1.0), []),
            "hello.sender: step_s -1.0 is not a finite number >= 0",
        ),
        (
            Hello("s", "f", PeerRecord("p", "a:1", 2, round_s=float("nan")), []),
            "hello.sender: round_s nan is not a finite number >= 0",
        ),
        (Ack(queue=-5), "ack: queue -5 is below -1"),
        (
            GossipRequest(stage=1, round=2, sender="p", meta={}, propose=True, upload_s=-1.0),
            "gossip_request: upload_s -1.0 is not a finite number >= 0",
        ),
        (
            GossipReply(round=2, meta={}, incoming=True, upload_s=float("inf")),
            "gossip_reply: upload_s inf is not a finite number >= 0",
        ),
        (StageState(stage=1, step=-1, samples=0), "stage_state: step -1 is negative"),
        (HeadBackup(step=-3, sender="p"), "head_backup: step -3 is negative"),
        (Rollback(stage=2, step=-1, sender="p"), "rollback: step -1 is negative"),
        (
            Ping("a", [], [Obituary("p", 2**64 - 1)]),
            "ping.deaths[0]: incarnation 18446744073709551615 leaves its subject no higher one",
        ),
        (
            Pong(sender=PeerRecord("p", "a:1", 1, version=2**53)),
            "pong.sender: version 9007199254740992 is above 2**53 - 1",
        ),
        (Ack(service_rate=float("inf")), "ack: rate 0.0 or service_rate inf is not finite >= 0"),
        (
            Ping(
                "a",
                stages=[StageSummary(3, 2, 1, 1.0, 0, 0.0), StageSummary(4, -1, 0, 0.0, 0, 0.0)],
            ),
            "ping.stages[1]: replicas -1 is negative",
        ),
        (
            Ping("a", stages=[StageSummary(3, 2, 3, 1.0, 0, 0.0)]),
            "ping.stages[0]: ready 3 is above replicas 2",
        ),
        (
            Welcome(
                "s",
                "f",
                PeerRecord("p", "a:1", 0),
                [],
                "h",
                stages=[StageSummary(1, 2, 2, float("nan"), 0, 0.0)],
            ),
            "welcome.stages[0]: throughput nan is not a finite number >= 0",
        ),
        (
            Ping("a", stages=[StageSummary(3, 2, 2, 1.0, 0, -5.0)]),
            "ping.stages[0]: age_s -5.0 is not a finite number >= 0",
        ),
        (
            Ping("a", stages=[StageSummary(-2, 2, 2, 1.0, 0, 0.0)]),
            "ping.stages[0]: stage -2 is negative",
        ),
    ],
)
def test_figures_no_honest_peer_sends_are_malformed(msg: object, message: str) -> None:
    # routing divides by a record's rate and queue, recovery weighs by its gradient norm; a
    # state copied with a negative step would become the copier's own step, which every
    # peer would then refuse in its records
    with pytest.raises(MalformedMessage) as info:
        roundtrip(msg)
    assert str(info.value) == message


def test_figures_at_their_bounds_are_fine() -> None:
    record = PeerRecord("p", "a:1", 0, loss=None, data_shard=-1, grad_norm=0.0)
    assert roundtrip(Pong(sender=record)).sender == record
    assert roundtrip(Ack(queue=-1)) == Ack()


def _forward(numel: int) -> Forward:
    tensors = {"h": torch.arange(numel, dtype=torch.float32)}
    meta = {"codec": "fp32", "name": "h", "shape": [numel], "dtype": "float32"}
    return Forward("m.1.1", 1, [Hop(0, "p", "a:1")], False, meta, tensors=tensors)


def test_a_message_is_encoded_once_and_its_frame_kept() -> None:
    msg = _forward(16)
    frame = encode_message(msg)
    assert encode_message(msg) is frame
    copy = dataclasses.replace(msg, mb_id="m.2.1")  # another message: encoded afresh
    assert encode_message(copy) is not frame
    assert roundtrip(copy).mb_id == "m.2.1" and roundtrip(msg).mb_id == "m.1.1"
    assert copy != msg and dataclasses.replace(copy, mb_id="m.1.1") == msg  # not a field


def test_prepare_joins_a_small_frame_and_keeps_a_large_one_zero_copy() -> None:
    small = _forward(16)
    assert prepare(small) is small
    (joined,) = encode_message(small)
    assert type(joined) is bytes and joined == join_frame(encode_message(_forward(16)))
    large = _forward(SMALL_FRAME_BYTES // 4 + 1)
    prepare(large)
    buffers = encode_message(large)
    assert frame_nbytes(buffers) > SMALL_FRAME_BYTES and len(buffers) > 1
    tensor = large.tensors["h"]
    views = [b for b in buffers if isinstance(b, memoryview)]
    assert torch.frombuffer(views[0], dtype=torch.uint8).data_ptr() == tensor.data_ptr()
    assert torch.equal(decode_message(join_frame(buffers)).tensors["h"], tensor)
