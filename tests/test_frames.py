"""Frame encoding/decoding: round trips, zero copy, alignment, and every kind of bad frame."""

from __future__ import annotations

import gc
import struct
import warnings
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.errors import (
    BadMagic,
    BadTensorSpec,
    FrameTooLarge,
    HeaderTooLarge,
    MalformedHeader,
    ProtocolError,
    TruncatedFrame,
    UnsupportedDtype,
    UnsupportedVersion,
)
from protocol.frames import (
    DTYPES,
    MAGIC,
    PREFIX_BYTES,
    PROTOCOL_VERSION,
    FrameTensors,
    Limits,
    decode_frame,
    dtype_name,
    encode_frame,
    frame_nbytes,
    join_frame,
    parse_prefix,
)

# ----------------------------------------------------------------------------- helpers


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).to(torch.bool)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


def round_trip(
    tensors: dict[str, torch.Tensor], fields: dict[str, Any] | None = None
) -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
    return decode_frame(join_frame(encode_frame("test", fields or {}, tensors)))


def address_range(buf: bytearray | bytes) -> tuple[int, int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    return base, base + len(buf)


def mv_address(view: memoryview) -> int:
    address: int = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
    return address


def header_of(frame: bytes) -> dict[str, Any]:
    header_len = parse_prefix(frame)
    return msgpack.unpackb(frame[PREFIX_BYTES : PREFIX_BYTES + header_len], raw=False)  # type: ignore[no-any-return]


def craft(
    header: Any = None,
    tail: bytes = b"",
    *,
    raw_header: bytes | None = None,
    magic: bytes = MAGIC,
    version: int = PROTOCOL_VERSION,
    flags: int = 0,
    reserved: int = 0,
) -> bytes:
    """A frame assembled by hand, possibly wrong on purpose."""
    hb = raw_header if raw_header is not None else msgpack.packb(header, use_bin_type=True)
    out = struct.pack("<4sBBHI", magic, version, flags, reserved, len(hb)) + hb
    if tail:
        out += bytes(-len(out) % 64) + tail
    return out


def hdr(tensors: list[Any], fields: Any = None, msg_type: Any = "t") -> dict[str, Any]:
    return {"type": msg_type, "fields": {} if fields is None else fields, "tensors": tensors}


VALID_HEADER = msgpack.packb(hdr([["a", "float32", [2], 0, 8]]), use_bin_type=True)
VALID = craft(raw_header=VALID_HEADER, tail=bytes(8))


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", list(DTYPES))
def test_round_trip_every_dtype(name: str) -> None:
    dtype = DTYPES[name]
    assert dtype_name(dtype) == name
    t = sample(dtype, (3, 5))
    msg_type, fields, out = round_trip({"t": t}, {"k": 1})
    assert (msg_type, fields) == ("test", {"k": 1})
    assert out["t"].dtype == dtype
    assert out["t"].shape == (3, 5)
    assert torch.equal(out["t"], t)


@pytest.mark.parametrize(
    "t",
    [
        torch.tensor(3.5),
        torch.tensor(True),
        torch.tensor(7, dtype=torch.int64),
        torch.tensor(1.25, dtype=torch.bfloat16),
        torch.empty(0),
        torch.empty(2, 0, 3, dtype=torch.bfloat16),
        torch.arange(12.0).reshape(3, 4).t(),  # non-contiguous
        torch.arange(20, dtype=torch.int16)[::3],  # strided
        torch.arange(10.0)[3:7],  # storage offset
        torch.randn(4, 4, requires_grad=True),
        torch.randn(2, 3, 4).to(torch.bfloat16).permute(2, 0, 1),
    ],
    ids=lambda t: f"{t.dtype}-{tuple(t.shape)}-{'c' if t.is_contiguous() else 'nc'}",
)
def test_round_trip_shapes(t: torch.Tensor) -> None:
    _, _, out = round_trip({"t": t})
    assert out["t"].dtype == t.dtype
    assert out["t"].shape == t.shape
    assert torch.equal(out["t"], t.detach())


def test_round_trip_many_tensors_and_fields() -> None:
    tensors = {
        "w": sample(torch.float32, (7, 3)),
        "empty": torch.empty(0, dtype=torch.int8),
        "b": sample(torch.bfloat16, (5,)),
        "scalar": torch.tensor(2, dtype=torch.uint8),
        "mask": sample(torch.bool, (9,)),
    }
    fields = {
        "s": "héllo",
        "i": -(1 << 63),
        "u": (1 << 64) - 1,
        "f": 0.5,
        "b": True,
        "n": None,
        "nested": {"list": [1, [2, {"x": None}], "y"], "tuple": (1, 2)},
    }
    msg_type, got_fields, out = round_trip(tensors, fields)
    assert msg_type == "test"
    assert got_fields == {**fields, "nested": {"list": [1, [2, {"x": None}], "y"], "tuple": [1, 2]}}
    assert list(out) == list(tensors)
    for name, t in tensors.items():
        assert torch.equal(out[name], t)


def test_frame_without_tensors_ends_after_header() -> None:
    buffers = encode_frame("ping", {"n": 1})
    assert len(buffers) == 1
    frame = join_frame(buffers)
    assert len(frame) == PREFIX_BYTES + parse_prefix(frame)
    assert decode_frame(frame) == ("ping", {"n": 1}, {})
    # only empty tensors: still no tail
    frame = join_frame(encode_frame("ping", {}, {"e": torch.empty(0, 4)}))
    assert len(frame) == PREFIX_BYTES + parse_prefix(frame)
    assert decode_frame(frame)[2]["e"].shape == (0, 4)


def test_memoryview_input() -> None:
    frame = join_frame(encode_frame("t", {}, {"x": torch.arange(5.0)}))
    assert torch.equal(decode_frame(memoryview(frame))[2]["x"], torch.arange(5.0))
    inner = memoryview(b"junk" + frame + b"more")[4:-4]  # a slice of a bigger buffer
    assert torch.equal(decode_frame(inner)[2]["x"], torch.arange(5.0))


# ----------------------------------------------------------------------------- layout


def test_alignment_and_layout() -> None:
    tensors = {
        "a": torch.arange(3, dtype=torch.int8),
        "b": torch.arange(5.0, dtype=torch.float64),
        "e": torch.empty(0),
        "c": torch.ones(70, dtype=torch.bool),
    }
    buffers = encode_frame("layout", {"pad": "x" * 13}, tensors)
    frame = join_frame(buffers)
    assert frame_nbytes(buffers) == len(frame)
    header_len = parse_prefix(frame)
    header_end = PREFIX_BYTES + header_len
    tail_start = -(-header_end // 64) * 64
    assert frame[header_end:tail_start] == bytes(tail_start - header_end)
    table = header_of(frame)["tensors"]
    ends = []
    for name, dtype, shape, offset, nbytes in table:
        assert offset % 64 == 0
        t = tensors[name]
        assert (dtype, shape, nbytes) == (dtype_name(t.dtype), list(t.shape), t.nbytes)
        if nbytes:
            start = tail_start + offset
            assert frame[start : start + nbytes] == t.numpy().tobytes()
            ends.append(offset + nbytes)
    assert [row[3] for row in table] == [0, 64, 0, 128]
    assert len(frame) == tail_start + max(ends)  # no trailing padding
    # padding between tensors is zero
    assert frame[tail_start + 3 : tail_start + 64] == bytes(61)


# ----------------------------------------------------------------------------- zero copy


def test_encode_does_not_copy_contiguous_cpu_tensor() -> None:
    t = torch.arange(16, dtype=torch.float32)
    buffers = encode_frame("t", {}, {"t": t})
    views = [b for b in buffers if isinstance(b, memoryview)]
    assert len(views) == 1
    assert mv_address(views[0]) == t.data_ptr()
    assert views[0].nbytes == t.nbytes
    t[0] = 42.0  # the buffer sees later writes: same memory
    assert decode_frame(join_frame(buffers))[2]["t"][0].item() == 42.0


def test_encode_keeps_tensor_alive() -> None:
    buffers = encode_frame("t", {}, {"t": torch.full((1000,), 7, dtype=torch.bfloat16)})
    gc.collect()
    torch.full((1000,), 9, dtype=torch.bfloat16)  # would likely reuse freed memory
    out = decode_frame(join_frame(buffers))[2]["t"]
    assert torch.equal(out, torch.full((1000,), 7, dtype=torch.bfloat16))


def test_decode_is_zero_copy_into_bytearray() -> None:
    t = torch.arange(8, dtype=torch.int32)
    frame = bytearray(join_frame(encode_frame("t", {}, {"t": t, "b": t.to(torch.bfloat16)})))
    _, _, out = decode_frame(frame)
    lo, hi = address_range(frame)
    for x in out.values():
        assert lo <= x.data_ptr() and x.data_ptr() + x.nbytes <= hi
    for x in out.values():
        start = x.data_ptr() - lo
        frame[start : start + x.nbytes] = bytes(x.nbytes)
    assert out["t"].sum().item() == 0
    assert out["b"].sum().item() == 0


def test_decode_bytes_is_zero_copy_without_warning_and_keeps_buffer_alive() -> None:
    t = torch.randn(33)
    frame = join_frame(encode_frame("t", {}, {"t": t}))
    lo, hi = address_range(frame)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = decode_frame(frame)[2]["t"]
    assert lo <= out.data_ptr() < hi
    del frame
    gc.collect()
    assert torch.equal(out, t)


def test_frame_tensors_give_specs_without_views_and_views_on_lookup() -> None:
    h = torch.randn(2, 3).to(torch.bfloat16)
    frame = join_frame(
        encode_frame("t", {}, {"h": h, "n": torch.arange(5), "e": torch.empty(0, 4)})
    )
    tensors = decode_frame(frame)[2]
    assert isinstance(tensors, FrameTensors)
    assert list(tensors) == ["h", "n", "e"] and len(tensors) == 3
    assert "h" in tensors and "x" not in tensors and tensors.get("x") is None
    spec = tensors.spec("h")
    assert spec is not None and spec.dtype == torch.bfloat16 and spec.shape == (2, 3)
    assert bytes(spec.data) == h.view(torch.uint8).numpy().tobytes()
    assert tensors.spec("x") is None
    assert "h" not in tensors._made  # a spec makes no torch view
    view = tensors["h"]
    assert torch.equal(view, h) and tensors["h"] is view  # made once, then kept
    lo, hi = address_range(frame)
    assert lo <= view.data_ptr() < hi
    assert tensors["e"].shape == (0, 4) and torch.equal(tensors["n"], torch.arange(5))
    assert dict(tensors).keys() == {"h", "n", "e"}
    with pytest.raises(KeyError):
        tensors["x"]


# ----------------------------------------------------------------------------- bad frames


BAD_FRAMES: list[tuple[str, bytes, Limits, type[ProtocolError]]] = [
    ("empty", b"", Limits(), TruncatedFrame),
    ("truncated prefix", VALID[:7], Limits(), TruncatedFrame),
    ("bad magic", b"MRMX" + VALID[4:], Limits(), BadMagic),
    ("wrong version", craft(hdr([]), version=2), Limits(), UnsupportedVersion),
    ("unknown flags", craft(hdr([]), flags=1), Limits(), UnsupportedVersion),
    ("reserved bits", craft(hdr([]), reserved=1), Limits(), UnsupportedVersion),
    ("header too large", VALID, Limits(max_header_bytes=8), HeaderTooLarge),
    ("frame too large", VALID, Limits(max_frame_bytes=len(VALID) - 1), FrameTooLarge),
    ("truncated header", VALID[: PREFIX_BYTES + 5], Limits(), TruncatedFrame),
    ("truncated tail", VALID[:-1], Limits(), TruncatedFrame),
    ("tail missing", craft(hdr([["a", "float32", [2], 0, 8]])), Limits(), TruncatedFrame),
    ("garbage msgpack", craft(raw_header=b"\xc1\xc1\xc1"), Limits(), MalformedHeader),
    ("empty header", craft(raw_header=b""), Limits(), MalformedHeader),
    (
        "extra msgpack data",
        craft(raw_header=msgpack.packb(hdr([])) + b"\x00"),
        Limits(),
        MalformedHeader,
    ),
    ("bad utf-8", craft(raw_header=b"\xa2\xff\xfe"), Limits(), MalformedHeader),
    # lengths a tiny header declares beyond its own size
    ("array32 of 2^31-1", craft(raw_header=b"\xdd\x7f\xff\xff\xff"), Limits(), MalformedHeader),
    ("map32 of 2^31-1", craft(raw_header=b"\xdf\x7f\xff\xff\xff"), Limits(), MalformedHeader),
    ("str32 of 2^31-1", craft(raw_header=b"\xdb\x7f\xff\xff\xff"), Limits(), MalformedHeader),
    ("int map key", craft(raw_header=b"\x81\x01\x01"), Limits(), MalformedHeader),
    ("header not a map", craft([1, 2, 3]), Limits(), MalformedHeader),
    ("missing type", craft({"fields": {}, "tensors": []}), Limits(), MalformedHeader),
    ("extra key", craft({**hdr([]), "x": 1}), Limits(), MalformedHeader),
    ("type not str", craft(hdr([], msg_type=5)), Limits(), MalformedHeader),
    ("fields not a map", craft(hdr([], fields=[1])), Limits(), MalformedHeader),
    ("bin in fields", craft(hdr([], fields={"b": b"\x00"})), Limits(), MalformedHeader),
    (
        "ext in fields",
        craft(hdr([], fields={"e": msgpack.ExtType(1, b"x")})),
        Limits(),
        MalformedHeader,
    ),
    (
        "int map key",
        craft(raw_header=b"\x83\xa4type\xa1t\xa6fields\x81\x01\x01\xa7tensors\x90"),
        Limits(),
        MalformedHeader,
    ),
    ("tensors not a list", craft(hdr({})), Limits(), MalformedHeader),  # type: ignore[arg-type]
    (
        "entry wrong arity",
        craft(hdr([["a", "float32", [2], 0]]), bytes(8)),
        Limits(),
        MalformedHeader,
    ),
    ("entry not a list", craft(hdr(["a"]), bytes(8)), Limits(), MalformedHeader),
    ("name not str", craft(hdr([[1, "float32", [2], 0, 8]]), bytes(8)), Limits(), MalformedHeader),
    (
        "shape not ints",
        craft(hdr([["a", "float32", ["2"], 0, 8]]), bytes(8)),
        Limits(),
        MalformedHeader,
    ),
    ("shape bool", craft(hdr([["a", "uint8", [True], 0, 1]]), bytes(1)), Limits(), MalformedHeader),
    (
        "offset float",
        craft(hdr([["a", "float32", [2], 0.0, 8]]), bytes(8)),
        Limits(),
        MalformedHeader,
    ),
    (
        "unknown dtype",
        craft(hdr([["a", "complex64", [1], 0, 8]]), bytes(8)),
        Limits(),
        UnsupportedDtype,
    ),
    ("negative dim", craft(hdr([["a", "float32", [-2], 0, 8]]), bytes(8)), Limits(), BadTensorSpec),
    (
        "too many dims",
        craft(hdr([["a", "uint8", [1] * 3, 0, 1]]), bytes(1)),
        Limits(max_tensor_dims=2),
        BadTensorSpec,
    ),
    (
        "nbytes mismatch",
        craft(hdr([["a", "float32", [2], 0, 4]]), bytes(4)),
        Limits(),
        BadTensorSpec,
    ),
    (
        "huge empty shape",
        craft(hdr([["a", "uint8", [0, 2**64 - 1], 0, 0]])),
        Limits(),
        BadTensorSpec,
    ),
    (
        "overflowing empty shape",
        craft(hdr([["a", "uint8", [0, 2**40, 2**40], 0, 0]])),
        Limits(),
        BadTensorSpec,
    ),
    (
        "misaligned offset",
        craft(hdr([["a", "uint8", [4], 4, 4]]), bytes(8)),
        Limits(),
        BadTensorSpec,
    ),
    (
        "negative offset",
        craft(hdr([["a", "uint8", [4], -64, 4]]), bytes(8)),
        Limits(),
        BadTensorSpec,
    ),
    (
        "past the end",
        craft(hdr([["a", "float32", [4], 0, 16]]), bytes(8)),
        Limits(),
        TruncatedFrame,
    ),
    (
        "overlap",
        craft(hdr([["a", "uint8", [100], 0, 100], ["b", "uint8", [4], 64, 4]]), bytes(100)),
        Limits(),
        BadTensorSpec,
    ),
    (
        "duplicate names",
        craft(hdr([["a", "uint8", [4], 0, 4], ["a", "uint8", [4], 64, 4]]), bytes(68)),
        Limits(),
        BadTensorSpec,
    ),
    (
        "too many tensors",
        craft(hdr([["a", "uint8", [1], 0, 1], ["b", "uint8", [1], 64, 1]]), bytes(65)),
        Limits(max_tensors=1),
        BadTensorSpec,
    ),
    ("trailing bytes", VALID + b"\x00", Limits(), BadTensorSpec),
    ("padding after header only", craft(hdr([])) + bytes(20), Limits(), BadTensorSpec),
    (
        "bool byte not 0/1",
        craft(hdr([["m", "bool", [3], 0, 3]]), b"\x00\x01\x02"),
        Limits(),
        BadTensorSpec,
    ),
]


@pytest.mark.parametrize(
    ("frame", "limits", "cls"),
    [case[1:] for case in BAD_FRAMES],
    ids=[case[0] for case in BAD_FRAMES],
)
def test_bad_frame_raises_its_own_error(
    frame: bytes, limits: Limits, cls: type[ProtocolError]
) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_frame(frame, limits)
    assert type(info.value) is cls, f"{type(info.value).__name__}: {info.value}"
    assert info.value.code == cls.code
    assert isinstance(info.value, ValueError)
    assert str(info.value)


def test_error_codes_are_distinct_and_statuses_sane() -> None:
    classes = [
        BadMagic,
        BadTensorSpec,
        FrameTooLarge,
        HeaderTooLarge,
        MalformedHeader,
        TruncatedFrame,
        UnsupportedDtype,
        UnsupportedVersion,
    ]
    assert len({c.code for c in classes}) == len(classes)
    assert FrameTooLarge.http_status == HeaderTooLarge.http_status == 413
    assert MalformedHeader.http_status == ProtocolError.http_status == 400


def test_error_messages_are_concrete() -> None:
    prefix = struct.pack("<4sBBHI", MAGIC, PROTOCOL_VERSION, 0, 0, 2_000_000)
    with pytest.raises(
        HeaderTooLarge, match="frame declares header of 2000000 bytes, limit is 1048576"
    ):
        parse_prefix(prefix)
    with pytest.raises(FrameTooLarge, match=f"frame is {len(VALID)} bytes, limit is 10"):
        decode_frame(VALID, Limits(max_frame_bytes=10))
    with pytest.raises(BadTensorSpec, match=r"needs 8 bytes, table says 4"):
        decode_frame(craft(hdr([["a", "float32", [2], 0, 4]]), bytes(4)))
    with pytest.raises(UnsupportedDtype, match="complex64"):
        decode_frame(craft(hdr([["a", "complex64", [1], 0, 8]]), bytes(8)))


def test_parse_prefix_rejects_from_first_twelve_bytes() -> None:
    big = struct.pack("<4sBBHI", MAGIC, PROTOCOL_VERSION, 0, 0, 0xFFFFFFFF)
    with pytest.raises(HeaderTooLarge):
        parse_prefix(big)  # nothing else needed: no header bytes present
    with pytest.raises(BadMagic):
        parse_prefix(b"GET / HTTP/1.1")
    with pytest.raises(UnsupportedVersion):
        parse_prefix(struct.pack("<4sBBHI", MAGIC, 9, 0, 0, 10))
    with pytest.raises(TruncatedFrame):
        parse_prefix(MAGIC)
    assert parse_prefix(VALID[:PREFIX_BYTES]) == len(VALID_HEADER)
    assert parse_prefix(VALID) == len(VALID_HEADER)


def test_encode_rejects_bad_input() -> None:
    with pytest.raises(UnsupportedDtype):
        encode_frame("t", {}, {"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(UnsupportedDtype):
        dtype_name(torch.uint16)
    with pytest.raises(ValueError, match="bytes is not allowed"):
        encode_frame("t", {"raw": b"\x00"})
    with pytest.raises(ValueError, match="Tensor is not allowed"):
        encode_frame("t", {"oops": torch.zeros(1)})
    with pytest.raises(ValueError, match="not a str"):
        encode_frame("t", {"m": {1: 2}})
    with pytest.raises(ValueError, match="64 bits"):
        encode_frame("t", {"big": 1 << 64})
    with pytest.raises(ValueError, match=r"fields\['m'\]\[1\]\['x'\]: int -\d+ does not fit"):
        encode_frame("t", {"m": [0, {"x": -(1 << 63) - 1}]})  # found where it is
    with pytest.raises(ValueError, match="cannot encode header of 't'"):
        encode_frame("t", {"s": "\ud800"})  # a lone surrogate is no UTF-8
    with pytest.raises(ValueError, match="non-empty str"):
        encode_frame("", {})
    with pytest.raises(ValueError, match="nest deeper"):
        deep: list[Any] = []
        for _ in range(100):
            deep = [deep]
        encode_frame("t", {"deep": deep})
    with pytest.raises(ValueError, match="dense"):
        encode_frame("t", {}, {"s": torch.zeros(3).to_sparse()})


def test_deeply_nested_header_is_rejected() -> None:
    deep: Any = 0
    for _ in range(40):
        deep = [deep]
    with pytest.raises(MalformedHeader, match="nest deeper"):
        decode_frame(craft(hdr([], fields={"d": deep})))
    with pytest.raises(MalformedHeader):  # msgpack's own stack limit
        decode_frame(craft(raw_header=b"\x91" * 5000))


# ----------------------------------------------------------------------------- fuzzing


def _valid_frames() -> list[bytes]:
    return [
        VALID,
        join_frame(encode_frame("ping", {"a": [1, {"b": None}], "s": "x"})),
        join_frame(
            encode_frame(
                "multi",
                {"step": 3},
                {
                    "w": torch.arange(6.0).reshape(2, 3),
                    "m": torch.tensor([True, False]),
                    "e": torch.empty(0),
                    "b": torch.ones(3, dtype=torch.bfloat16),
                },
            )
        ),
    ]


VALID_FRAMES = _valid_frames()
FUZZ_LIMITS = [Limits(), Limits(max_frame_bytes=300, max_header_bytes=100, max_tensors=2)]


def check_decode(buf: bytes | bytearray, limits: Limits) -> None:
    try:
        _, _, tensors = decode_frame(buf, limits)
    except ProtocolError:
        return
    assert len(buf) <= limits.max_frame_bytes
    assert sum(t.nbytes for t in tensors.values()) <= len(buf)
    lo, hi = address_range(buf) if len(buf) else (0, 0)
    for t in tensors.values():
        if t.numel():
            assert lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi


FUZZ = settings(
    max_examples=700,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)


@FUZZ
@given(st.binary(max_size=400), st.sampled_from(FUZZ_LIMITS), st.integers(-1, 400))
def test_fuzz_random_bytes(data: bytes, limits: Limits, header_len: int) -> None:
    check_decode(data, limits)
    if header_len >= 0:  # a valid prefix in front of random bytes: exercises msgpack
        header_len = min(header_len, len(data))
        check_decode(
            struct.pack("<4sBBHI", MAGIC, PROTOCOL_VERSION, 0, 0, header_len) + data, limits
        )


@FUZZ
@given(
    st.sampled_from(VALID_FRAMES),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=6),
    st.one_of(st.none(), st.integers(0, 10_000)),
    st.binary(max_size=70),
    st.sampled_from(FUZZ_LIMITS),
)
def test_fuzz_mutated_valid_frames(
    frame: bytes,
    flips: list[tuple[int, int]],
    cut: int | None,
    extra: bytes,
    limits: Limits,
) -> None:
    buf = bytearray(frame)
    for pos, value in flips:
        buf[pos % len(buf)] = value
    if cut is not None:
        del buf[cut % (len(buf) + 1) :]
    buf += extra
    check_decode(buf, limits)
    check_decode(bytes(buf), limits)


_ints = st.one_of(
    st.integers(-3, 300), st.sampled_from([64, 128, 2**31, 2**63 - 1, -(2**63), 2**64 - 1])
)
_entry = st.one_of(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.sampled_from([*DTYPES, "complex64", ""]),
        st.lists(st.one_of(st.just(0), _ints), max_size=4),
        _ints,
        _ints,
    ).map(list),
    st.lists(st.one_of(st.none(), st.booleans(), _ints, st.text(max_size=3)), max_size=6),
)


@settings(FUZZ, max_examples=500)
@given(st.lists(_entry, max_size=4), st.integers(0, 400), st.sampled_from(FUZZ_LIMITS))
def test_fuzz_tensor_tables(table: list[Any], tail: int, limits: Limits) -> None:
    check_decode(craft(hdr(table), bytes(range(256)) * 2)[: PREFIX_BYTES + 64 + tail], limits)
    check_decode(craft(hdr(table), b"\x01" * tail), limits)
