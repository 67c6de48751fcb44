"""Frame encoding and decoding: the bytes every Murmuration message travels as.

Owns: the frame layout, its limits, the dtypes the wire carries, and turning
``(message type, fields, tensors)`` into buffers and back. Decoding validates everything a
peer could get wrong or forge, and does so before allocating anything large.

Does not own: what a message type means or which fields it needs (``protocol.messages``),
compression of tensor values (``protocol.quant``), or moving bytes (``node``). No sockets,
no asyncio, never pickle, never ``torch.load``.

Layout, all integers little-endian::

    prefix  12 bytes  struct "<4sBBHI": MAGIC b"MRMR", version u8, flags u8 (0),
                      reserved u16 (0), header_len u32
    header  header_len bytes of msgpack: a map
            {"type": str, "fields": map, "tensors": [[name, dtype, shape, offset, nbytes], ...]}
    padding zeros up to the first multiple of 64 at or after prefix + header
    tail    the tensors' raw bytes; each tensor starts at a 64-byte aligned offset relative
            to the start of the tail (zeros between), and the frame ends right after the
            last tensor's bytes. A frame without tensor bytes ends right after its header.

Tensors never travel as msgpack ``bin`` (that would copy): header fields hold only maps with
str keys, lists, str, int, float, bool and None. Empty tensors take no bytes and get offset 0.

Decoded tensors are zero-copy ``torch.frombuffer`` views into the received buffer. They
share its memory and keep it alive; when the buffer is ``bytes`` they are read-only by
contract (torch cannot mark a tensor read-only, so writing to one would mutate an immutable
``bytes`` object): clone before modifying in place.
"""

from __future__ import annotations

import itertools
import math
import struct
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple

import msgpack
import torch

from protocol.errors import (
    BadMagic,
    BadTensorSpec,
    FrameTooLarge,
    HeaderTooLarge,
    MalformedHeader,
    TruncatedFrame,
    UnsupportedDtype,
    UnsupportedVersion,
)

__all__ = [
    "ALIGN",
    "DEFAULT_LIMITS",
    "DTYPES",
    "FrameTensors",
    "MAGIC",
    "MAX_NESTING",
    "PREFIX_BYTES",
    "PROTOCOL_VERSION",
    "SMALL_FRAME_BYTES",
    "TensorSpec",
    "Limits",
    "decode_frame",
    "dtype_name",
    "encode_frame",
    "frame_nbytes",
    "join_frame",
    "parse_prefix",
]

PROTOCOL_VERSION: int = 1
MAGIC: bytes = b"MRMR"
_PREFIX = struct.Struct("<4sBBHI")
PREFIX_BYTES: int = _PREFIX.size
ALIGN: int = 64
"""Alignment of the tensor tail and of each tensor within it, in bytes."""
MAX_NESTING: int = 32
"""Deepest nesting of maps and lists allowed in header fields."""
SMALL_FRAME_BYTES: int = 1 << 16
"""A frame up to this size is best sent as one joined buffer: written piece by piece it would
leave as several TCP segments and wake the receiver for each (``bench/perf.py``, hop latency)."""

_ZEROS = bytes(ALIGN)
_INT_MIN = -(1 << 63)
_INT_MAX = (1 << 64) - 1
_HEADER_KEYS = frozenset({"type", "fields", "tensors"})
_NOT_WRITABLE = "The given buffer is not writable"
_quiet_views = False
"""True once torch's warning about views of read-only buffers has been issued (silenced)."""

assert PREFIX_BYTES == 12


@dataclass(frozen=True)
class Limits:
    """What a receiver accepts; checked before anything large is allocated."""

    max_frame_bytes: int = 1 << 30
    """Largest whole frame (prefix, header, padding and tensors), in bytes."""
    max_header_bytes: int = 1 << 20
    """Largest msgpack header, in bytes."""
    max_tensors: int = 4096
    """Most entries in the tensor table."""
    max_tensor_dims: int = 8
    """Most dimensions of one tensor."""

    def __post_init__(self) -> None:
        for name in ("max_frame_bytes", "max_header_bytes", "max_tensors", "max_tensor_dims"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"Limits.{name} must be a non-negative int, got {value!r}")


DEFAULT_LIMITS = Limits()

DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float64": torch.float64,
        "int8": torch.int8,
        "uint8": torch.uint8,
        "int16": torch.int16,
        "int32": torch.int32,
        "int64": torch.int64,
        "bool": torch.bool,
    }
)
"""Wire name -> torch dtype, for every dtype a frame can carry."""

_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of ``dtype``; ``UnsupportedDtype`` if frames cannot carry it."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise UnsupportedDtype(
            f"dtype {dtype} cannot travel in a frame; supported: {', '.join(DTYPES)}"
        ) from None


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# --------------------------------------------------------------------------- encoding


_SCALARS = (type(None), bool, int, float, str)
_SCALAR_KINDS = frozenset(_SCALARS)
"""What a header holds besides dicts and lists, as exact types (subclasses are converted)."""


def _is_plain(item: Any) -> bool:
    """True for a value that goes into a header as it is: None, bool, str, float, or an int
    that fits in 64 bits, of exactly that type (subclasses take ``_normalize``'s path)."""
    kind = type(item)
    return kind in _SCALAR_KINDS and (kind is not int or _INT_MIN <= item <= _INT_MAX)


def _normalize(value: Any, path: str, depth: int) -> Any:
    """Copy of a header field value as plain dicts and lists; ValueError, saying where, if
    it holds something a header cannot (only when ``_fields_ok`` refused the value: the
    fast path packs a plain one as it is)."""
    kind = type(value)
    if depth < MAX_NESTING:
        if kind is dict:
            out: dict[str, Any] = {}
            for key, item in value.items():
                if type(key) is not str:
                    return _normalize_slow(value, path, depth)
                out[key] = (
                    item if _is_plain(item) else _normalize(item, f"{path}[{key!r}]", depth + 1)
                )
            return out
        if kind is list:
            return [
                item if _is_plain(item) else _normalize(item, f"{path}[{i}]", depth + 1)
                for i, item in enumerate(value)
            ]
    return _normalize_slow(value, path, depth)


def _normalize_slow(value: Any, path: str, depth: int) -> Any:
    """``_normalize`` for everything but plain dicts and lists: scalars and their subclasses,
    other mappings and sequences, and the errors."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, float):
        return float(value)
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise ValueError(f"{path}: int {value} does not fit in 64 bits")
        return int(value)
    if depth >= MAX_NESTING:
        raise ValueError(f"{path}: fields nest deeper than {MAX_NESTING} levels")
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{path}: map key {key!r} is not a str")
            out[key] = item if _is_plain(item) else _normalize(item, f"{path}[{key!r}]", depth + 1)
        return out
    if isinstance(value, list | tuple):
        return [
            item if _is_plain(item) else _normalize(item, f"{path}[{i}]", depth + 1)
            for i, item in enumerate(value)
        ]
    if isinstance(value, bytes | bytearray | memoryview | torch.Tensor):
        raise ValueError(
            f"{path}: {type(value).__name__} is not allowed in header fields; "
            "send binary data as a tensor"
        )
    raise ValueError(
        f"{path}: {type(value).__name__} is not allowed in header fields "
        "(maps with str keys, lists, str, int, float, bool and None are)"
    )


def _byte_view(t: torch.Tensor) -> memoryview:
    """A flat byte memoryview over a contiguous CPU tensor's own memory; keeps it alive."""
    assert t.is_cpu and t.is_contiguous()
    if t.dim() == 0:  # a dtype view needs a dimension to widen
        t = t.reshape(1)
    # The ndarray's base is the uint8 view tensor, which holds the storage.
    view: memoryview = t.view(torch.uint8).numpy().data
    return view.cast("B")


def encode_frame(
    msg_type: str,
    fields: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor] | None = None,
) -> list[bytes | memoryview]:
    """Encode a message as the buffers to write, in order.

    The first buffer holds prefix, header and padding; each tensor is a memoryview of the
    tensor's own memory (no copy for a contiguous CPU tensor; others are made contiguous or
    moved to CPU first), interleaved with zero padding. ``ValueError`` (or
    ``UnsupportedDtype``) for a message that cannot be encoded.
    """
    if not isinstance(msg_type, str) or not msg_type:
        raise ValueError(f"message type must be a non-empty str, got {_short(msg_type)}")
    if not isinstance(fields, Mapping):
        raise ValueError(f"fields must be a mapping, got {type(fields).__name__}")
    # Fields made only of plain dicts, lists and scalars (what messages give) are packed as
    # they are; anything else is copied by ``_normalize``, which says where a bad value is.
    # Checking by type identity and formatting no paths halved a small frame's encoding
    # (``bench/perf.py``, hop latency).
    plain_fields = fields if _fields_ok(fields, 0) else _normalize(fields, "fields", 0)

    table: list[list[Any]] = []
    pieces: list[tuple[int, memoryview]] = []
    cursor = 0
    for name, tensor in (tensors or {}).items():
        if not isinstance(name, str):
            raise ValueError(f"tensor name {name!r} is not a str")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if tensor.layout != torch.strided:
            raise ValueError(f"tensor {name!r} has layout {tensor.layout}; only dense tensors")
        wire_dtype = dtype_name(tensor.dtype)
        t = tensor.detach() if tensor.requires_grad else tensor
        if not t.is_cpu:
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        nbytes = t.nbytes
        offset = 0
        if nbytes:
            offset = _align(cursor)
            pieces.append((offset, _byte_view(t)))
            cursor = offset + nbytes
        table.append([name, wire_dtype, list(t.shape), offset, nbytes])

    try:
        header: bytes = msgpack.packb(
            {"type": msg_type, "fields": plain_fields, "tensors": table}, use_bin_type=True
        )
    except OverflowError:  # an int beyond 64 bits, which the identity check lets through
        _normalize(fields, "fields", 0)  # raises, saying where
        raise AssertionError("unreachable: _normalize refuses what msgpack does") from None
    except (TypeError, ValueError) as exc:  # e.g. a str holding a lone surrogate
        raise ValueError(f"cannot encode header of {msg_type!r}: {exc}") from exc
    if len(header) > 0xFFFFFFFF:
        raise ValueError(f"header of {len(header)} bytes does not fit the u32 length field")
    prefix = _PREFIX.pack(MAGIC, PROTOCOL_VERSION, 0, 0, len(header))
    if not pieces:
        return [prefix + header]
    header_end = PREFIX_BYTES + len(header)
    buffers: list[bytes | memoryview] = [
        prefix + header + _ZEROS[: _align(header_end) - header_end]
    ]
    position = 0
    for offset, view in pieces:
        if offset > position:
            buffers.append(_ZEROS[: offset - position])
        buffers.append(view)
        position = offset + view.nbytes
    return buffers


def frame_nbytes(buffers: Iterable[bytes | memoryview]) -> int:
    """Total length in bytes of a frame given as buffers (memoryviews count bytes)."""
    total = 0
    for b in buffers:  # a plain loop: a generator costs a frame per call
        total += b.nbytes if isinstance(b, memoryview) else len(b)
    return total


def join_frame(buffers: Iterable[bytes | memoryview]) -> bytes:
    """The frame as one ``bytes`` (copies; for tests and small messages)."""
    return b"".join(buffers)


# --------------------------------------------------------------------------- decoding


def _byte_buffer(buf: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(buf)
    if not view.c_contiguous:
        raise ValueError("frame buffer must be contiguous")
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


def parse_prefix(prefix: bytes | memoryview, limits: Limits = DEFAULT_LIMITS) -> int:
    """Validate a frame's first 12 bytes and return its header length.

    Lets a streaming reader reject a frame before reading or allocating the rest. Checks
    magic (``BadMagic``), version, flags and reserved bits (``UnsupportedVersion``) and
    header length (``HeaderTooLarge``). Only the first 12 bytes are looked at; fewer raise
    ``TruncatedFrame``.
    """
    view = _byte_buffer(prefix)
    if view.nbytes < PREFIX_BYTES:
        raise TruncatedFrame(
            f"frame is {view.nbytes} bytes, shorter than its {PREFIX_BYTES}-byte prefix"
        )
    magic, version, flags, reserved, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise BadMagic(f"frame starts with {bytes(magic)!r}, expected {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise UnsupportedVersion(
            f"frame has protocol version {version}, this node speaks {PROTOCOL_VERSION}"
        )
    if flags != 0:
        raise UnsupportedVersion(
            f"frame sets flags {flags:#04x}, protocol version {PROTOCOL_VERSION} defines none"
        )
    if reserved != 0:
        raise UnsupportedVersion(
            f"frame sets reserved bits {reserved:#06x}, which must be 0 in version "
            f"{PROTOCOL_VERSION}"
        )
    if header_len > limits.max_header_bytes:
        raise HeaderTooLarge(
            f"frame declares header of {header_len} bytes, limit is {limits.max_header_bytes}"
        )
    assert isinstance(header_len, int)
    return header_len


def _short(value: Any, limit: int = 80) -> str:
    """repr of a peer-supplied value, cut so error messages stay small."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fields_ok(value: Any, depth: int) -> bool:
    """True if a header value holds only plain dicts (str keys), lists and scalars, by type
    identity (what msgpack decodes to, and what messages encode from; ints are not range
    checked: msgpack refuses those beyond 64 bits). No paths are formatted: only a refused
    value needs ``_check_field_value`` or ``_normalize`` to say where (``bench/perf.py``, hop
    latency). Plain loops: generator expressions cost a frame per container."""
    kind = type(value)
    if kind is dict:
        if depth >= MAX_NESTING:
            return False
        for key, item in value.items():
            if type(key) is not str:
                return False
            if type(item) not in _SCALAR_KINDS and not _fields_ok(item, depth + 1):
                return False
        return True
    if kind is list:
        if depth >= MAX_NESTING:
            return False
        for item in value:
            if type(item) not in _SCALAR_KINDS and not _fields_ok(item, depth + 1):
                return False
        return True
    return kind in _SCALAR_KINDS


def _check_field_value(value: Any, path: str, depth: int) -> None:
    """Reject decoded header values the encoder never produces (bin, ext, deep nesting),
    saying where."""
    if isinstance(value, _SCALARS):
        return
    if depth >= MAX_NESTING:
        raise MalformedHeader(f"{path}: fields nest deeper than {MAX_NESTING} levels")
    # Scalar items are checked in place: formatting a path for every item took about a
    # fifth of a small frame's decoding time (bench/perf.py); only containers need one.
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise MalformedHeader(f"{path}: map key {_short(key)} is not a str")
            if not isinstance(item, _SCALARS):
                _check_field_value(item, f"{path}[{_short(key, 40)}]", depth + 1)
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            if not isinstance(item, _SCALARS):
                _check_field_value(item, f"{path}[{i}]", depth + 1)
        return
    raise MalformedHeader(f"{path}: {type(value).__name__} is not allowed in header fields")


def _unpack_header(view: memoryview, header_len: int) -> tuple[str, dict[str, Any], list[Any]]:
    try:
        header = msgpack.unpackb(
            view,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=header_len,
            max_bin_len=header_len,
            max_array_len=header_len,
            max_map_len=header_len,
            max_ext_len=header_len,
        )
    except (msgpack.UnpackException, ValueError, TypeError, OverflowError) as exc:
        raise MalformedHeader(f"header is not valid msgpack: {exc or type(exc).__name__}") from exc
    if not isinstance(header, dict):
        raise MalformedHeader(f"header is a msgpack {type(header).__name__}, not a map")
    if header.keys() != _HEADER_KEYS:
        missing = sorted(_HEADER_KEYS - header.keys())
        extra = sorted(map(repr, header.keys() - _HEADER_KEYS))
        raise MalformedHeader(f"header keys: missing {missing}, unexpected {_short(extra)}")
    msg_type, fields, table = header["type"], header["fields"], header["tensors"]
    if not isinstance(msg_type, str) or not msg_type:
        raise MalformedHeader(f"header 'type' must be a non-empty str, got {_short(msg_type)}")
    if not isinstance(fields, dict):
        raise MalformedHeader(f"header 'fields' must be a map, got {type(fields).__name__}")
    if not _fields_ok(fields, 0):
        _check_field_value(fields, "fields", 0)
        raise AssertionError("unreachable: _check_field_value refuses what _fields_ok does")
    if not isinstance(table, list):
        raise MalformedHeader(f"header 'tensors' must be a list, got {type(table).__name__}")
    return msg_type, fields, table


class _Entry(NamedTuple):
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    numel: int
    offset: int
    nbytes: int


def _label(name: str) -> str:
    """How errors name a tensor (formatted only when one is raised)."""
    return f"tensor {_short(name)}"


def _parse_entry(index: int, entry: Any, tail_bytes: int, limits: Limits) -> _Entry:
    if not isinstance(entry, list) or len(entry) != 5:
        raise MalformedHeader(
            f"tensor table entry {index} must be [name, dtype, shape, offset, nbytes], got {_short(entry)}"
        )
    name, dtype_str, shape, offset, nbytes = entry
    if not isinstance(name, str):
        raise MalformedHeader(
            f"tensor table entry {index}: name must be a str, got {type(name).__name__}"
        )
    if not isinstance(dtype_str, str):
        raise MalformedHeader(
            f"{_label(name)}: dtype must be a str, got {type(dtype_str).__name__}"
        )
    if type(shape) is not list:
        raise MalformedHeader(f"{_label(name)}: shape must be a list of ints, got {_short(shape)}")
    negative = False
    for d in shape:
        if type(d) is not int:  # bool is an int subclass; msgpack true must not pass
            raise MalformedHeader(
                f"{_label(name)}: shape must be a list of ints, got {_short(shape)}"
            )
        negative = negative or d < 0
    if type(offset) is not int or type(nbytes) is not int:  # bool is an int subclass
        raise MalformedHeader(
            f"{_label(name)}: offset and nbytes must be ints, got {_short(offset)}, {_short(nbytes)}"
        )
    dtype = DTYPES.get(dtype_str)
    if dtype is None:
        raise UnsupportedDtype(
            f"{_label(name)} has dtype {_short(dtype_str)}; supported: {', '.join(DTYPES)}"
        )
    if len(shape) > limits.max_tensor_dims:
        raise BadTensorSpec(
            f"{_label(name)} has {len(shape)} dimensions, limit is {limits.max_tensor_dims}"
        )
    if negative:
        raise BadTensorSpec(f"{_label(name)} has a negative dimension in shape {shape}")
    numel = math.prod(shape)
    if numel == 0 and math.prod(max(d, 1) for d in shape) > limits.max_frame_bytes:
        # Nothing else bounds the other dimensions of an empty tensor; torch would overflow.
        raise BadTensorSpec(
            f"{_label(name)}: empty shape {shape} has dimensions larger than any frame "
            f"({limits.max_frame_bytes} bytes)"
        )
    itemsize = dtype.itemsize
    if nbytes != numel * itemsize:
        raise BadTensorSpec(
            f"{_label(name)}: shape {shape} of {dtype_str} needs {numel * itemsize} bytes, "
            f"table says {nbytes}"
        )
    if offset < 0 or offset % ALIGN:
        raise BadTensorSpec(
            f"{_label(name)}: offset {offset} is not a non-negative multiple of {ALIGN}"
        )
    if offset + nbytes > tail_bytes:
        raise TruncatedFrame(
            f"{_label(name)} occupies tail bytes [{offset}, {offset + nbytes}) "
            f"but the frame has only {tail_bytes} tail bytes"
        )
    return _Entry(name, dtype, tuple(shape), numel, offset, nbytes)


def _parse_table(table: list[Any], tail_bytes: int, limits: Limits) -> list[_Entry]:
    if len(table) > limits.max_tensors:
        raise BadTensorSpec(f"frame has {len(table)} tensors, limit is {limits.max_tensors}")
    entries: list[_Entry] = []
    names: set[str] = set()
    for index, raw in enumerate(table):
        entry = _parse_entry(index, raw, tail_bytes, limits)
        if entry.name in names:
            raise BadTensorSpec(f"tensor name {_short(entry.name)} appears more than once")
        names.add(entry.name)
        entries.append(entry)
    if len(entries) < 2:
        return entries
    ranges = sorted((e.offset, e.offset + e.nbytes, e.name) for e in entries if e.nbytes)
    for (_, prev_end, prev_name), (start, _, name) in itertools.pairwise(ranges):
        if start < prev_end:
            raise BadTensorSpec(
                f"tensors {_short(prev_name)} and {_short(name)} overlap: "
                f"{_short(name)} starts at {start}, {_short(prev_name)} ends at {prev_end}"
            )
    return entries


def decode_frame(
    buf: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS
) -> tuple[str, dict[str, Any], FrameTensors]:
    """Decode one whole frame into ``(msg_type, fields, tensors)``.

    Tensors are zero-copy views into ``buf`` (see the module docstring: read-only by
    contract when ``buf`` is ``bytes``), made when first looked up (``FrameTensors``). Every fault raises a distinct ``ProtocolError``,
    checked in this order before anything large is allocated: frame size, prefix
    (see ``parse_prefix``), header bounds, msgpack and header structure, then each tensor
    table entry, duplicate names, overlaps and trailing bytes. Bool tensors must hold only
    bytes 0 and 1.
    """
    view = _byte_buffer(buf)
    size = view.nbytes
    if size > limits.max_frame_bytes:
        raise FrameTooLarge(f"frame is {size} bytes, limit is {limits.max_frame_bytes}")
    header_len = parse_prefix(view, limits)
    header_end = PREFIX_BYTES + header_len
    if header_end > size:
        raise TruncatedFrame(
            f"frame declares header of {header_len} bytes but only "
            f"{size - PREFIX_BYTES} bytes follow the prefix"
        )
    msg_type, fields, table = _unpack_header(view[PREFIX_BYTES:header_end], header_len)
    tail_start = _align(header_end)
    entries = _parse_table(table, max(0, size - tail_start), limits)
    tail_end = 0
    for e in entries:
        tail_end = max(tail_end, e.offset + e.nbytes)
    expected = tail_start + tail_end if tail_end else header_end
    if size != expected:
        assert size > expected  # every tensor lies within the buffer
        raise BadTensorSpec(
            f"frame is {size} bytes but its header and tensor table end at byte {expected}"
        )
    return msg_type, fields, FrameTensors(view, entries, tail_start)


class TensorSpec(NamedTuple):
    """A frame tensor as it travelled: its dtype, shape and bytes (a view of the frame)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    data: memoryview


class FrameTensors(Mapping[str, torch.Tensor]):
    """The tensors of a decoded frame, by name, each a zero-copy view of the frame made when it
    is first looked up. ``spec`` gives a tensor's dtype, shape and bytes without torch: a
    receiver checks an activation on the event loop that way and makes the view on its compute
    thread: between requests a torch call costs the event loop several times what it costs in
    a tight loop (``bench/perf.py``, hop latency). Bool tensors are checked and made while the
    frame is decoded."""

    __slots__ = ("_entries", "_made", "_tail_start", "_view")

    def __init__(self, view: memoryview, entries: list[_Entry], tail_start: int) -> None:
        self._view = view
        self._tail_start = tail_start
        self._entries = {e.name: e for e in entries}
        self._made: dict[str, torch.Tensor] = {}
        for e in entries:
            if e.dtype == torch.bool and e.numel:
                raw = _frombuffer(view, torch.uint8, e.nbytes, tail_start + e.offset)
                if int(raw.max()) > 1:
                    raise BadTensorSpec(
                        f"bool tensor {_short(e.name)} holds bytes other than 0 and 1"
                    )
                self._made[e.name] = raw.view(torch.bool).view(e.shape)

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._made.get(name)
        if tensor is None:
            e = self._entries[name]
            if e.numel == 0:
                tensor = torch.empty(e.shape, dtype=e.dtype)
            else:
                flat = _frombuffer(self._view, e.dtype, e.numel, self._tail_start + e.offset)
                tensor = flat.view(e.shape)
            self._made[name] = tensor  # two threads making it at once make equal views
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"FrameTensors({', '.join(map(repr, self._entries))})"

    def spec(self, name: str) -> TensorSpec | None:
        """Tensor ``name``'s dtype, shape and bytes, or None if the frame has no such tensor."""
        e = self._entries.get(name)
        if e is None:
            return None
        start = self._tail_start + e.offset
        return TensorSpec(e.dtype, e.shape, self._view[start : start + e.nbytes])


_quiet_lock = threading.Lock()


def _frombuffer(view: memoryview, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    """``torch.frombuffer``, silencing torch's warning that a read-only buffer gives a writable
    tensor: the views are read-only by contract. torch issues it once per process (a flag in
    its C++ code), so only the first view of a read-only frame pays for catching it."""
    global _quiet_views
    if view.readonly and not _quiet_views:
        with _quiet_lock, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NOT_WRITABLE, category=UserWarning)
            tensor = torch.frombuffer(view, dtype=dtype, count=count, offset=offset)
            _quiet_views = True
            return tensor
    return torch.frombuffer(view, dtype=dtype, count=count, offset=offset)
