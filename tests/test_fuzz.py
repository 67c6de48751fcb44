"""Fuzzing the frame decoder and a real node's message handlers with hypothesis.

Thousands of generated inputs per run, each checked for the two promises a node makes to
whoever reaches its port: decoding either returns a message or raises a ``ProtocolError``
(never another exception), and nothing a frame *declares* (header length, tensor shapes
and byte counts) is allocated before it is checked against the bytes that actually came:
decoded tensors are views of the received buffer, so their bytes never exceed it, and the
decoder's own allocations stay small. Handlers on a real node answer every well-formed
message with a reply or a refusal (``Refused``, ``ProtocolError``), never a crash, and the
node's weights stay as they were.
"""

from __future__ import annotations

import asyncio
import math
import struct
import tracemalloc
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.config import resolve_config
from node.daemon import Node
from node.stage.model import model_fingerprint
from protocol.errors import ProtocolError
from protocol.frames import DTYPES, MAGIC, PROTOCOL_VERSION, Limits, decode_frame, join_frame
from protocol.messages import (
    MESSAGE_TYPES,
    Backward,
    FetchState,
    Forward,
    GossipFollow,
    GossipRequest,
    HeadBackup,
    Hello,
    Hop,
    Leave,
    Message,
    Obituary,
    PeerRecord,
    Ping,
    Probe,
    RingChunk,
    Rollback,
    decode_message,
    encode_message,
)
from protocol.quant import encode_tensor
from swarm.seams import Refused
from tests.test_hostile import HEAD, OTHER, SETTINGS, STRANGER, start_node

pytestmark = pytest.mark.timeout(120)

LIMITS = Limits(max_frame_bytes=1 << 20, max_header_bytes=1 << 16)
FUZZ = settings(
    max_examples=2000,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,  # the same thousands of cases every run: failures reproduce
)
PREFIX = struct.Struct("<4sBBHI")

_int64 = st.integers(-(1 << 63), (1 << 64) - 1)
_scalars = st.none() | st.booleans() | _int64 | st.floats() | st.text(max_size=8)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=4,
)
_FIELD_NAMES = sorted(
    {
        "mb_id",
        "target_stage",
        "path",
        "eval",
        "meta",
        "route",
        "swarm",
        "fingerprint",
        "sender",
        "peers",
        "peer_id",
        "index",
        "stage",
        "round",
        "code",
        "message",
        "step",
        "samples",
        "round_id",
        "members_hash",
        "phase",
        "detail",
        "observed_host",
    }
)


def frame(header: Any, tail: bytes = b"", version: int = PROTOCOL_VERSION) -> bytes:
    packed = msgpack.packb(header)
    return PREFIX.pack(MAGIC, version, 0, 0, len(packed)) + packed + tail


def check_decode(buf: bytes) -> Message | None:
    """Decode ``buf``: a message whose tensors fit in ``buf``, or a ProtocolError (None)."""
    try:
        msg = decode_message(buf, LIMITS)
    except ProtocolError:
        return None
    assert sum(t.numel() * t.element_size() for t in msg.tensors.values()) <= len(buf)
    return msg


# ---- the frame decoder -------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=600))
def test_random_bytes(buf: bytes) -> None:
    check_decode(buf)
    check_decode(MAGIC + bytes([PROTOCOL_VERSION]) + buf)  # past the magic, into the header


_SEEDS = [
    join_frame(encode_message(m))
    for m in (
        Leave(peer_id="p"),
        Forward(
            mb_id="a.1.1",
            target_stage=1,
            path=[Hop(0, HEAD, "h:1")],
            eval=False,
            meta=encode_tensor(torch.ones(1, 2, 4), "int8", name="h")[1],
            tensors=encode_tensor(torch.ones(1, 2, 4), "int8", name="h")[0],
        ),
        RingChunk(
            round_id="dp:1:3",
            members_hash="x",
            phase="reduce",
            step=0,
            meta={},
            tensors={"c": torch.arange(5.0), "b": torch.ones(3, dtype=torch.bool)},
        ),
    )
]


@FUZZ
@given(
    st.sampled_from(_SEEDS),
    st.lists(
        st.tuples(st.sampled_from(["flip", "cut", "insert", "u32"]), st.integers(0, 4096), _int64),
        min_size=1,
        max_size=4,
    ),
)
def test_mutated_valid_frames(seed: bytes, mutations: list[tuple[str, int, int]]) -> None:
    buf = bytearray(seed)
    for kind, at, value in mutations:
        at %= max(1, len(buf))
        if kind == "flip" and buf:
            buf[at] ^= 1 << (value % 8)
        elif kind == "cut":
            del buf[at:]
        elif kind == "insert":
            buf[at:at] = bytes([value % 256]) * (1 + value % 7)
        elif kind == "u32" and len(buf) >= at + 4:
            buf[at : at + 4] = struct.pack("<I", value % (1 << 32))
    check_decode(bytes(buf))


_dims = st.lists(st.integers(0, 1 << 40) | st.integers(-3, 8), max_size=9)
_table_entries = st.lists(
    st.tuples(
        st.text(max_size=4),
        st.sampled_from([*DTYPES, "complex64", ""]),
        _dims,
        st.integers(-64, 1 << 40) | st.sampled_from([0, 64, 128]),
        st.integers(-8, 1 << 62) | st.integers(0, 256),
    ).map(list)
    | _values,
    max_size=3,
)


@settings(FUZZ, max_examples=1000)
@given(
    st.sampled_from([*sorted(MESSAGE_TYPES), "teleport", ""]),
    st.dictionaries(st.sampled_from(_FIELD_NAMES), _values, max_size=4),
    _table_entries,
    st.binary(max_size=128),
)
def test_structured_headers_and_tensor_tables(
    msg_type: str, fields: dict[str, Any], table: list[Any], tail: bytes
) -> None:
    header = {"type": msg_type, "fields": fields, "tensors": table}
    body = frame(header)
    check_decode(body + bytes(-len(body) % 64) + tail)
    check_decode(body + tail)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.integers(0, (1 << 32) - 1),
    st.lists(st.integers(1, 1 << 40), min_size=1, max_size=8),
    st.integers(0, 1 << 62),
)
def test_declared_sizes_are_refused_before_anything_is_allocated(
    header_len: int, shape: list[int], nbytes: int
) -> None:
    """A frame declaring a huge header or tensor costs what it sent, not what it declared."""
    huge_header = PREFIX.pack(MAGIC, PROTOCOL_VERSION, 0, 0, header_len) + b"\x80"
    huge_tensor = frame(
        {
            "type": "leave",
            "fields": {"peer_id": "p"},
            "tensors": [["t", "float32", shape, 0, nbytes]],
        }
    )
    for buf in (huge_header, huge_tensor):
        tracemalloc.start()
        try:
            with pytest.raises(ProtocolError):
                decode_frame(buf, LIMITS)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 64 * 1024 + 8 * len(buf), peak


# ---- a real node's handlers ----------------------------------------------------------------


SELF = "00000000000000cc"
"""Peer id of the fuzzed node (so generated paths can name it)."""
_CONFIG = resolve_config(overrides=SETTINGS)
SWARM = _CONFIG.swarm.name
FINGERPRINT = model_fingerprint(_CONFIG.model, _CONFIG.swarm.num_block_stages, _CONFIG.swarm.seed)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[asyncio.AbstractEventLoop, Node, Node]]:
    """A NoLoCo replica of stage 1 and a DiLoCo one (which takes ring chunks), on one loop."""
    loop = asyncio.new_event_loop()
    fuzz = {"net.rate_limit_per_s": 0, "sync.hold_s": 0.001, "net.max_frame_bytes": 1 << 26}
    node = loop.run_until_complete(start_node(SELF, **fuzz))
    ring = loop.run_until_complete(start_node(SELF, **fuzz, **{"sync.method": "diloco"}))
    yield loop, node, ring
    for n in (node, ring):
        loop.run_until_complete(n.close())
    loop.close()


_peer_ids = st.sampled_from([HEAD, OTHER, STRANGER, SELF]) | st.text(max_size=20)
_stages = st.sampled_from([0, 1, 1, 2]) | st.integers(-2, 4) | _int64
_hops = st.builds(Hop, _stages, _peer_ids, st.text(max_size=20))
_mb_ids = st.from_regex(r"[0-9a-f]{8}\.[0-9]{1,4}\.[0-9]", fullmatch=True) | st.text(max_size=140)
_small_shapes = st.sampled_from([(1, 4, 128), (2, 3, 128), (1, 200, 128), (1, 4, 64), (4, 128)]) | (
    st.lists(st.integers(0, 4), max_size=4).map(tuple)
)


@st.composite
def _activations(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Encoded tensors with their metadata, sometimes tampered with."""
    shape = draw(_small_shapes)
    fill = draw(st.sampled_from([0.0, 1.0, -3.5, math.nan, math.inf]))
    codec = draw(st.sampled_from(["fp32", "bf16", "int8"]))
    if codec == "int8" and not math.isfinite(fill):
        codec = "fp32"  # int8 has no code for NaN or infinity
    tensors, meta = encode_tensor(torch.full(shape, fill), codec, name=draw(st.sampled_from("hg")))
    tamper = draw(st.sampled_from(["none", "none", "none", "meta", "dtype", "drop"]))
    if tamper == "meta":
        meta = {**meta, draw(st.sampled_from(sorted(meta))): draw(_values)}
    elif tamper == "dtype":
        dtype = draw(st.sampled_from(list(DTYPES.values())))
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    elif tamper == "drop":
        tensors = {}
    return tensors, meta


def _with_tensors(cls: type[Message], **fields: Any) -> Any:
    return st.builds(
        lambda enc, **kw: cls(**kw, meta=enc[1], tensors=enc[0]), _activations(), **fields
    )


_head = Hop(0, HEAD, "127.0.0.1:9")
_records = st.builds(
    PeerRecord,
    _peer_ids,
    st.text(max_size=20),
    _stages,
    step=_int64,
    ready=st.booleans(),
    incarnation=_int64,
    version=_int64,
)
_messages = st.one_of(
    _with_tensors(  # what a head sends into stage 1, with fuzzed ids and activations
        Forward,
        mb_id=_mb_ids,
        target_stage=st.just(1),
        path=st.just([_head]),
        eval=st.booleans(),
    ),
    _with_tensors(
        Forward,
        mb_id=_mb_ids,
        target_stage=_stages,
        path=st.just([_head]) | st.lists(_hops, max_size=5),
        eval=st.booleans(),
        route=st.just([]) | st.lists(_stages, max_size=4),
    ),
    _with_tensors(
        Backward,
        mb_id=_mb_ids,
        index=st.just(1) | _stages,
        path=st.just([_head, Hop(1, SELF, "x:1"), Hop(2, OTHER, "x:2")])
        | st.lists(_hops, max_size=5),
    ),
    _with_tensors(
        GossipRequest,
        stage=_stages,
        round=st.integers(-1, 3) | _int64,
        sender=_peer_ids,
    ),
    st.builds(
        GossipFollow,
        stage=_stages,
        round=st.integers(-1, 3) | _int64,
        sender=_peer_ids,
    ),
    _with_tensors(
        RingChunk,
        round_id=st.sampled_from(["dp:1:0", "diloco:1:2", "diloco:2:2", "x", "::"])
        | st.text(max_size=12),
        members_hash=st.text(max_size=8),
        phase=st.sampled_from(["reduce", "gather", "?"]),
        step=st.integers(-1, 3) | _int64,
    ),
    st.builds(
        Hello,
        swarm=st.just(SWARM) | st.text(max_size=8),
        fingerprint=st.just(FINGERPRINT) | st.text(max_size=8),
        sender=_records,
        peers=st.lists(_records, max_size=3),
    ),
    st.builds(Leave, peer_id=st.text(max_size=20), incarnation=_int64),
    st.builds(
        Ping,
        sender=_peer_ids,
        news=st.lists(_records, max_size=3),
        deaths=st.lists(st.builds(Obituary, _peer_ids, _int64, st.booleans()), max_size=3),
    ),
    st.builds(Probe, sender=_peer_ids, target=_peer_ids),
    st.builds(FetchState, stage=_stages),
    st.builds(HeadBackup, step=_int64),
    st.builds(Rollback, stage=_stages, step=_int64),
)


@settings(FUZZ, max_examples=1500)
@given(_messages)
def test_handlers_answer_or_refuse_and_never_crash(
    served: tuple[asyncio.AbstractEventLoop, Node, Node], msg: Message
) -> None:
    loop, node, ring = served
    try:
        decoded = decode_message(join_frame(encode_message(msg)), node.server.limits)
    except ProtocolError:
        return
    except ValueError:  # not even encodable (an int beyond 64 bits): no peer can send it
        return
    target = ring if isinstance(decoded, RingChunk) else node
    try:
        reply = loop.run_until_complete(
            target.server._dispatch(decoded, "127.0.0.1", hearsay=False)
        )
        assert isinstance(reply, Message)
    except (ProtocolError, Refused):
        pass
    target.work.drop_all()  # no worker runs: keep the queue from filling up


def test_fuzzed_nodes_are_still_serving_with_their_weights_intact(
    served: tuple[asyncio.AbstractEventLoop, Node, Node],
) -> None:
    _, *nodes = served
    for node in nodes:
        assert node.state.ready and not node.state.leaving
        assert node.runner.step == 0
        assert all(torch.isfinite(p).all() for p in node.runner.module.parameters())
