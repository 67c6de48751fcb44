"""Wire compression of tensors: blockwise int8 quantization and named codecs.

Owns: turning a tensor into what travels in a frame under a codec ("fp32", "bf16", "int8")
and back to float32. The int8 codec is blockwise absmax quantization (``docs/algorithms.md``
section 7): the flattened tensor is split into blocks of ``block`` values (zero padded at
the end), each block stores one float32 scale ``absmax / 127`` and int8 codes
``round(x / scale)`` in [-127, 127]; dequantizing multiplies back, so each value is off by
at most half its block's scale. Error stays local to a block, which is why this beats one
scale per tensor. This follows ZeRO++ (Wang et al., 2023, arXiv 2306.10209), which
quantizes weights blockwise to int8 for communication, and SWARM Parallelism (Ryabinin et
al., 2023, arXiv 2301.11913), which compresses activations and gradients sent between
peers with blockwise 8-bit quantization.

Does not own: when to compress or which codec a link uses (``swarm``/``node`` decide),
accumulation (callers accumulate in float32), or framing (``protocol.frames``).
Quantize on the sender just before sending; dequantize on arrival.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
import torch

from protocol.errors import BadTensorSpec, MalformedMessage
from protocol.frames import DTYPES, FrameTensors, TensorSpec, dtype_name

__all__ = [
    "CODECS",
    "DEFAULT_BLOCK",
    "Quantized",
    "WireTensor",
    "all_finite",
    "bytes_per_value",
    "decode_tensor",
    "dequantize_blockwise",
    "encode_tensor",
    "finite_bits",
    "from_tensors",
    "open_tensor",
    "quantize_blockwise",
    "tensor_bytes",
    "to_tensors",
]

DEFAULT_BLOCK: int = 2048
"""Values per quantization block (ZeRO++ and hivemind use a few thousand)."""
Codec = Literal["fp32", "bf16", "int8"]
"""Wire codec names understood by ``encode_tensor`` and ``decode_tensor``."""
CODECS: tuple[str, ...] = get_args(Codec)

_QMAX = 127


@dataclass(frozen=True)
class Quantized:
    """A blockwise int8 quantized tensor.

    ``BadTensorSpec`` on construction if the parts are inconsistent, so a ``Quantized``
    built from a peer's frame is always safe to dequantize.
    """

    codes: torch.Tensor
    """int8, flat, ``numel`` values zero padded to a multiple of the block size."""
    scales: torch.Tensor
    """float32, one per block: the block's absmax / 127 (0 for an all-zero block)."""
    shape: tuple[int, ...]
    """Shape of the original tensor."""
    numel: int
    """Number of values of the original tensor (without padding)."""
    dtype: torch.dtype
    """dtype of the original tensor (dequantizing gives float32 regardless)."""

    def __post_init__(self) -> None:
        codes, scales = self.codes, self.scales
        if codes.dtype != torch.int8 or codes.dim() != 1:
            raise BadTensorSpec(
                f"quantized codes must be flat int8, got {codes.dtype} of shape "
                f"{tuple(codes.shape)}"
            )
        if scales.dtype != torch.float32 or scales.dim() != 1:
            raise BadTensorSpec(
                f"quantized scales must be flat float32, got {scales.dtype} of shape "
                f"{tuple(scales.shape)}"
            )
        if not all(type(d) is int and d >= 0 for d in self.shape):
            raise BadTensorSpec(f"quantized shape {self.shape!r} is not a tuple of sizes")
        if type(self.numel) is not int or self.numel != math.prod(self.shape):
            raise BadTensorSpec(f"quantized numel {self.numel!r} does not match shape {self.shape}")
        n_codes, n_blocks = codes.numel(), scales.numel()
        if n_blocks == 0:
            if n_codes or self.numel:
                raise BadTensorSpec(
                    f"quantized tensor has no scales but {n_codes} codes for {self.numel} values"
                )
            return
        block = n_codes // n_blocks
        if n_codes != block * n_blocks or block == 0:
            raise BadTensorSpec(
                f"{n_codes} quantized codes do not split into {n_blocks} equal blocks"
            )
        if not n_codes - block < self.numel <= n_codes:
            raise BadTensorSpec(
                f"{self.numel} values need {math.ceil(self.numel / block)} blocks of {block}, "
                f"got {n_blocks}"
            )

    @property
    def block(self) -> int:
        """Values per block (0 for an empty tensor)."""
        n_blocks = self.scales.numel()
        return self.codes.numel() // n_blocks if n_blocks else 0


def _check_block(block: int) -> None:
    if type(block) is not int or block <= 0:
        raise ValueError(f"block size must be a positive int, got {block!r}")


def quantize_blockwise(x: torch.Tensor, block: int = DEFAULT_BLOCK) -> Quantized:
    """Quantize ``x`` (any real dtype, any device) to int8 codes with one scale per block.

    ``ValueError`` if ``x`` holds NaN or infinity (no finite scale represents them).
    """
    _check_block(block)
    if x.is_complex():
        raise ValueError(f"cannot quantize complex tensor of dtype {x.dtype}")
    flat = x.detach().reshape(-1).to(torch.float32)
    numel = flat.numel()
    pad = -numel % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    blocks = flat.view(-1, block)
    scales = blocks.abs().amax(dim=1) / _QMAX
    if not bool(torch.isfinite(scales).all()):
        raise ValueError("cannot quantize a tensor holding NaN or infinity")
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(blocks / divisor[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return Quantized(
        codes=codes.reshape(-1),
        scales=scales,
        shape=tuple(x.shape),
        numel=numel,
        dtype=x.dtype,
    )


def dequantize_blockwise(q: Quantized) -> torch.Tensor:
    """float32 tensor of the original shape, on the device of ``q.codes``."""
    if q.numel == 0:
        return torch.zeros(q.shape, dtype=torch.float32, device=q.codes.device)
    values = q.codes.view(q.scales.numel(), -1).to(torch.float32) * q.scales[:, None]
    return values.reshape(-1)[: q.numel].reshape(q.shape)


def to_tensors(q: Quantized, prefix: str) -> dict[str, torch.Tensor]:
    """The two frame tensors a quantized tensor travels as: ``{prefix}.codes``, ``.scales``."""
    return {f"{prefix}.codes": q.codes, f"{prefix}.scales": q.scales}


def from_tensors(
    tensors: Mapping[str, torch.Tensor],
    prefix: str,
    shape: Sequence[int],
    numel: int,
    dtype: torch.dtype,
) -> Quantized:
    """Rebuild a ``Quantized`` from frame tensors written by ``to_tensors``.

    ``MalformedMessage`` if a part is missing; ``BadTensorSpec`` if the parts are
    inconsistent or a scale is negative or not finite.
    """
    parts = []
    for suffix in ("codes", "scales"):
        name = f"{prefix}.{suffix}"
        part = tensors.get(name)
        if not isinstance(part, torch.Tensor):
            raise MalformedMessage(f"quantized tensor {prefix!r} lacks its {name!r} tensor")
        parts.append(part)
    codes, scales = parts
    q = Quantized(codes=codes, scales=scales, shape=tuple(shape), numel=numel, dtype=dtype)
    if scales.numel() and not bool((torch.isfinite(scales) & (scales >= 0)).all()):
        raise BadTensorSpec(f"quantized tensor {prefix!r} has a negative or non-finite scale")
    return q


def bytes_per_value(codec: str, block: int = DEFAULT_BLOCK) -> float:
    """Bytes one value takes once ``encode_tensor`` has encoded it (int8: its code plus its
    share of its block's fp32 scale)."""
    sizes = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / block}
    if codec not in sizes:
        raise ValueError(f"unknown wire codec {codec!r}; known: {', '.join(CODECS)}")
    return sizes[codec]


def tensor_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes of a message's tensors: what its body carries, headers aside."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def encode_tensor(
    x: torch.Tensor, codec: str, *, name: str = "x", block: int = DEFAULT_BLOCK
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Encode ``x`` under ``codec`` as frame tensors plus msgpack-able metadata.

    The tensors are named after ``name`` (``name`` itself, or ``name.codes`` and
    ``name.scales`` for int8), so several encoded tensors can share one frame. Put the
    metadata in the message fields and hand both to ``decode_tensor`` on arrival.
    ``ValueError`` for an unknown codec.
    """
    if codec not in CODECS:
        raise ValueError(f"unknown wire codec {codec!r}; known: {', '.join(CODECS)}")
    meta: dict[str, Any] = {
        "codec": codec,
        "name": name,
        "shape": list(x.shape),
        "dtype": dtype_name(x.dtype),
    }
    x = x.detach()
    if codec == "fp32":
        return {name: x.to(torch.float32)}, meta
    if codec == "bf16":
        return {name: x.to(torch.bfloat16)}, meta
    q = quantize_blockwise(x, block)
    meta["numel"] = q.numel
    return to_tensors(q, name), meta


def _meta_field(meta: Mapping[str, Any], key: str, kind: type) -> Any:
    value = meta.get(key)
    if type(value) is not kind:
        raise MalformedMessage(f"tensor metadata {key!r} must be a {kind.__name__}, got {value!r}")
    return value


def decode_tensor(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> torch.Tensor:
    """float32 tensor from frame tensors and the metadata ``encode_tensor`` produced.

    For "fp32" this is the received tensor itself: a view into the frame, read-only by
    contract (clone before modifying it in place). ``MalformedMessage`` for bad metadata or
    a missing tensor, ``BadTensorSpec`` when a tensor does not match its metadata.
    """
    return open_tensor(tensors, meta).decode()


_F32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class WireTensor:
    """An encoded tensor from a frame whose parts match its metadata (``open_tensor``): its
    shape is known and its finiteness can be checked without decoding it.

    A receiver checks it where the request arrives and decodes it where the work is done:
    on a small activation, converting to float32 on the event loop took a fifth of a hop's
    time on the receiving side, and any torch call there costs far more than it does in a
    tight loop (``bench/perf.py``, hop latency). An fp32 or bf16 tensor that came in a frame
    is checked on its bytes (``finite_bits``), without torch.
    """

    shape: tuple[int, ...]
    encoded: torch.Tensor | Quantized | Callable[[], torch.Tensor]
    """The values as they travelled (fp32 or bf16; or what makes that view of the frame, on
    first use), or the int8 codes and scales."""
    spec: TensorSpec | None = None
    """The fp32 or bf16 values' dtype, shape and bytes as they travelled, when in a frame."""

    def finite(self) -> bool:
        """True when the decoded tensor holds no NaN or infinity. int8 codes are integers
        and their scales were checked finite on arrival; only a scale so large that a code
        times it leaves float32 can still decode to infinity (a peer's codes may hold -128)."""
        if isinstance(self.encoded, Quantized):
            scales = self.encoded.scales
            return not scales.numel() or float(scales.max()) * (_QMAX + 1) <= _F32_MAX
        if self.spec is not None:
            return finite_bits(self.spec.data, self.spec.dtype)
        return all_finite(self._values())

    def decode(self) -> torch.Tensor:
        """The float32 tensor (for "fp32" a view of the frame: read-only by contract)."""
        if isinstance(self.encoded, Quantized):
            return dequantize_blockwise(self.encoded)
        return self._values().to(torch.float32)

    def _values(self) -> torch.Tensor:
        encoded = self.encoded
        assert not isinstance(encoded, Quantized)
        return encoded if isinstance(encoded, torch.Tensor) else encoded()


def open_tensor(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> WireTensor:
    """The encoded tensor ``meta`` describes, its parts checked against it but not decoded
    (nor, for fp32 and bf16 in a frame, made into a torch view yet: ``FrameTensors``).

    ``MalformedMessage`` for bad metadata or a missing tensor, ``BadTensorSpec`` when a
    tensor does not match its metadata (as ``decode_tensor``).
    """
    if type(meta) is not dict and not isinstance(meta, Mapping):  # no ABC check for a dict
        raise MalformedMessage(f"tensor metadata must be a map, got {type(meta).__name__}")
    codec = _meta_field(meta, "codec", str)
    if codec not in CODECS:
        raise MalformedMessage(f"unknown wire codec {codec!r}; known: {', '.join(CODECS)}")
    name = _meta_field(meta, "name", str)
    shape = _meta_field(meta, "shape", list)
    for d in shape:
        if type(d) is not int or d < 0:
            raise MalformedMessage(f"tensor metadata 'shape' must list sizes, got {shape!r}")
    dtype_str = _meta_field(meta, "dtype", str)
    if dtype_str not in DTYPES:
        raise MalformedMessage(f"tensor metadata 'dtype' {dtype_str!r} is not a known dtype")
    if codec == "int8":
        numel = _meta_field(meta, "numel", int)
        dtype = DTYPES[dtype_str]
        return WireTensor(tuple(shape), from_tensors(tensors, name, shape, numel, dtype))
    wire_dtype = torch.float32 if codec == "fp32" else torch.bfloat16
    if type(tensors) is FrameTensors:  # identity: an ABC isinstance check costs a hop more
        spec = tensors.spec(name)
        if spec is None:
            raise MalformedMessage(f"frame lacks tensor {name!r} named by its metadata")
        _check_spec(name, spec.dtype, spec.shape, codec, wire_dtype, shape)
        return WireTensor(tuple(shape), functools.partial(tensors.__getitem__, name), spec)
    t = tensors.get(name)
    if not isinstance(t, torch.Tensor):
        raise MalformedMessage(f"frame lacks tensor {name!r} named by its metadata")
    _check_spec(name, t.dtype, tuple(t.shape), codec, wire_dtype, shape)
    return WireTensor(tuple(shape), t)


def _check_spec(
    name: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    codec: str,
    wire_dtype: torch.dtype,
    meta_shape: list[int],
) -> None:
    if dtype != wire_dtype or list(shape) != meta_shape:
        raise BadTensorSpec(
            f"tensor {name!r} is {dtype} of shape {list(shape)}, metadata says "
            f"{codec} of shape {meta_shape}"
        )


_EXPONENT_BITS: dict[torch.dtype, tuple[str, int]] = {
    torch.float32: ("<u4", 0x7F80_0000),
    torch.bfloat16: ("<u2", 0x7F80),
    torch.float16: ("<u2", 0x7C00),
}
"""Per float dtype: its bits as an unsigned little-endian integer, and its exponent mask."""


def finite_bits(data: memoryview | bytes, dtype: torch.dtype) -> bool:
    """True when the little-endian ``dtype`` values in ``data`` are all finite, read from their
    bits with numpy: an IEEE value is NaN or infinite exactly when its exponent bits are all
    ones. One masked copy and one reduction, no torch (see ``WireTensor``)."""
    kind, mask = _EXPONENT_BITS[dtype]
    bits = np.frombuffer(data, dtype=kind)
    return not bits.size or int(np.maximum.reduce(bits & mask)) != mask


def all_finite(x: torch.Tensor) -> bool:
    """True when ``x`` (floating point) holds no NaN or infinity: its minimum and maximum are
    finite exactly then (NaN propagates through both). One reduction, no mask: about six
    times cheaper than ``isfinite(x).all()`` on a small activation (``bench/perf.py``)."""
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))
