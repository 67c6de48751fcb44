"""Blockwise int8 quantization and the named wire codecs."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from protocol.errors import BadTensorSpec, MalformedMessage, ProtocolError
from protocol.frames import FrameTensors, decode_frame, encode_frame, join_frame
from protocol.quant import (
    CODECS,
    DEFAULT_BLOCK,
    Quantized,
    all_finite,
    bytes_per_value,
    decode_tensor,
    dequantize_blockwise,
    encode_tensor,
    finite_bits,
    from_tensors,
    open_tensor,
    quantize_blockwise,
    tensor_bytes,
    to_tensors,
)


def per_element_scale(q: Quantized) -> torch.Tensor:
    return q.scales.repeat_interleave(q.block)[: q.numel].reshape(q.shape)


def test_hand_computed_example() -> None:
    x = torch.tensor([12.7, -2.0, 0.3, 1.0, 0.0, 0.0, 0.0, 0.0, -254.0, 5.2])
    q = quantize_blockwise(x, block=4)
    # block 0: absmax 12.7 -> scale 0.1; block 1: all zero -> scale 0;
    # block 2: [-254, 5.2, pad 0, pad 0], absmax 254 -> scale 2
    assert torch.allclose(q.scales, torch.tensor([0.1, 0.0, 2.0]))
    assert q.codes.tolist() == [127, -20, 3, 10, 0, 0, 0, 0, -127, 3, 0, 0]
    assert q.codes.dtype == torch.int8 and q.scales.dtype == torch.float32
    assert (q.shape, q.numel, q.dtype, q.block) == ((10,), 10, torch.float32, 4)
    expected = torch.tensor([12.7, -2.0, 0.3, 1.0, 0.0, 0.0, 0.0, 0.0, -254.0, 6.0])
    assert torch.allclose(dequantize_blockwise(q), expected)


@pytest.mark.parametrize("block", [1, 7, 64, DEFAULT_BLOCK])
@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 1e4])
def test_error_is_at_most_half_a_scale(block: int, magnitude: float) -> None:
    g = torch.Generator().manual_seed(block)
    x = torch.randn(5000, generator=g) * magnitude
    x[::97] *= 50  # outliers stay local to their block
    q = quantize_blockwise(x, block)
    err = (dequantize_blockwise(q) - x).abs()
    assert bool((err <= per_element_scale(q) * (0.5 + 1e-4)).all())
    assert int(q.codes.abs().max()) <= 127


def test_blockwise_beats_one_scale_per_tensor() -> None:
    x = torch.randn(8192, generator=torch.Generator().manual_seed(0))
    x[0] = 1000.0  # one outlier ruins a single per-tensor scale
    small = (dequantize_blockwise(quantize_blockwise(x, 256)) - x)[256:].abs().max()
    whole = (dequantize_blockwise(quantize_blockwise(x, 8192)) - x)[256:].abs().max()
    assert small * 20 < whole


def test_all_zero_block_has_zero_scale_and_no_nan() -> None:
    x = torch.zeros(3, 100)
    q = quantize_blockwise(x, block=64)
    assert q.scales.tolist() == [0.0] * 5
    assert int(q.codes.abs().sum()) == 0
    out = dequantize_blockwise(q)
    assert torch.equal(out, x) and not bool(out.isnan().any())


def test_padding_for_numel_not_multiple_of_block() -> None:
    x = torch.ones(5000)
    q = quantize_blockwise(x)
    assert q.codes.shape == (3 * DEFAULT_BLOCK,) and q.scales.shape == (3,)
    assert int(q.codes[5000:].abs().sum()) == 0  # padding is zeros
    assert q.numel == 5000
    assert torch.equal(dequantize_blockwise(q), x)


@pytest.mark.parametrize(
    "x",
    [
        torch.tensor(-3.0),
        torch.empty(0),
        torch.empty(4, 0, 2),
        torch.randn(3, 5, 7),
        torch.randn(6, 4).t(),  # non-contiguous
        torch.randn(100).to(torch.bfloat16),
        torch.randn(10, 10).to(torch.float16),
        torch.arange(-50, 50, dtype=torch.int32).reshape(10, 10),
    ],
    ids=lambda x: f"{x.dtype}-{tuple(x.shape)}",
)
def test_shape_and_dtype_are_preserved(x: torch.Tensor) -> None:
    q = quantize_blockwise(x, block=16)
    assert q.shape == tuple(x.shape) and q.numel == x.numel() and q.dtype == x.dtype
    out = dequantize_blockwise(q)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert bool(((out - x.float()).abs() <= per_element_scale(q) * 0.5001).all())


def test_int8_is_four_times_smaller_than_fp32() -> None:
    x = torch.randn(64 * DEFAULT_BLOCK)
    q = quantize_blockwise(x)
    assert q.codes.nbytes * 4 == x.nbytes
    assert q.scales.nbytes == 64 * 4
    assert q.codes.nbytes + q.scales.nbytes < x.nbytes / 3.99


def test_non_finite_and_bad_block_rejected() -> None:
    with pytest.raises(ValueError, match="NaN or infinity"):
        quantize_blockwise(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="NaN or infinity"):
        quantize_blockwise(torch.tensor([float("-inf")]))
    with pytest.raises(ValueError, match="block size"):
        quantize_blockwise(torch.ones(3), block=0)


def test_quantized_travels_as_two_frame_tensors() -> None:
    x = torch.randn(3, 1000)
    q = quantize_blockwise(x, block=256)
    tensors = to_tensors(q, "grad.w")
    assert set(tensors) == {"grad.w.codes", "grad.w.scales"}
    fields = {"shape": list(q.shape), "numel": q.numel}
    _, got_fields, got = decode_frame(join_frame(encode_frame("push", fields, tensors)))
    back = from_tensors(got, "grad.w", got_fields["shape"], got_fields["numel"], torch.float32)
    assert torch.equal(dequantize_blockwise(back), dequantize_blockwise(q))


def test_from_tensors_rejects_inconsistent_parts() -> None:
    q = quantize_blockwise(torch.randn(100), block=32)
    good = to_tensors(q, "p")
    with pytest.raises(MalformedMessage, match="p.scales"):
        from_tensors({"p.codes": q.codes}, "p", (100,), 100, torch.float32)
    bad_cases: list[tuple[dict[str, torch.Tensor], tuple[int, ...], int]] = [
        (good, (100,), 99),  # numel does not match shape
        (good, (200,), 200),  # more values than codes
        (good, (10,), 10),  # far too many blocks for the values
        ({**good, "p.codes": q.codes[:-1]}, (100,), 100),  # blocks not equal
        ({**good, "p.codes": q.codes.to(torch.int16)}, (100,), 100),
        ({**good, "p.scales": q.scales.double()}, (100,), 100),
        ({**good, "p.scales": -q.scales}, (100,), 100),
        ({**good, "p.scales": q.scales * float("nan")}, (100,), 100),
        ({"p.codes": q.codes, "p.scales": q.scales[:0]}, (100,), 100),
    ]
    for tensors, shape, numel in bad_cases:
        with pytest.raises(BadTensorSpec):
            from_tensors(tensors, "p", shape, numel, torch.float32)
    assert from_tensors(good, "p", (100,), 100, torch.float32).block == 32


def frame_trip(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> torch.Tensor:
    _, fields, got = decode_frame(join_frame(encode_frame("t", {"meta": meta}, tensors)))
    return decode_tensor(got, fields["meta"])


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_codec_round_trip(codec: str, dtype: torch.dtype) -> None:
    x = (torch.randn(7, 300, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    tensors, meta = encode_tensor(x, codec, name="act")
    assert meta["codec"] == codec
    out = frame_trip(tensors, meta)
    assert out.dtype == torch.float32 and out.shape == x.shape
    ref = x.float()
    if codec == "fp32":
        assert torch.equal(out, ref)
    elif codec == "bf16":
        assert torch.equal(out, ref.to(torch.bfloat16).float())
        assert torch.allclose(out, ref, rtol=1 / 128, atol=0)
    else:
        assert set(tensors) == {"act.codes", "act.scales"}
        assert float((out - ref).abs().max()) <= float(ref.abs().max()) / 127 * 0.5001


def test_codecs_share_one_frame_and_wire_sizes() -> None:
    x = torch.randn(4 * DEFAULT_BLOCK)
    tensors: dict[str, torch.Tensor] = {}
    metas = {}
    for codec in CODECS:
        t, meta = encode_tensor(x, codec, name=codec)
        tensors |= t
        metas[codec] = meta
    assert sum(t.nbytes for t in encode_tensor(x, "bf16")[0].values()) * 2 == x.nbytes
    int8_bytes = sum(t.nbytes for t in encode_tensor(x, "int8")[0].values())
    assert int8_bytes == x.nbytes // 4 + 4 * 4
    _, fields, got = decode_frame(join_frame(encode_frame("t", {"metas": metas}, tensors)))
    for codec in CODECS:
        assert decode_tensor(got, fields["metas"][codec]).shape == x.shape


def test_codec_errors() -> None:
    with pytest.raises(ValueError, match="unknown wire codec 'fp8'"):
        encode_tensor(torch.ones(2), "fp8")
    tensors, meta = encode_tensor(torch.ones(2, 3), "fp32", name="x")
    bad_metas: list[Any] = [
        [],
        {**meta, "codec": "fp8"},
        {**meta, "codec": 1},
        {k: v for k, v in meta.items() if k != "name"},
        {**meta, "shape": [2, -3]},
        {**meta, "shape": "2x3"},
        {**meta, "dtype": "complex64"},
        {**meta, "name": "missing"},
        {**encode_tensor(torch.ones(2), "int8")[1], "numel": "2"},
    ]
    for bad in bad_metas:
        with pytest.raises(MalformedMessage):
            decode_tensor(tensors, bad)
    with pytest.raises(BadTensorSpec):
        decode_tensor(tensors, {**meta, "shape": [3, 2]})
    with pytest.raises(BadTensorSpec):
        decode_tensor(tensors, {**meta, "codec": "bf16"})
    assert issubclass(MalformedMessage, ProtocolError)


def test_all_finite_finds_any_nan_or_infinity() -> None:
    x = torch.randn(2, 16, 8)
    assert all_finite(x) and all_finite(torch.empty(0))
    assert all_finite(torch.full((4,), 3e38))  # huge but finite: a sum would overflow
    for bad in (math.nan, math.inf, -math.inf):
        y = x.clone()
        y[1, 7, 3] = bad
        assert not all_finite(y)
        assert not all_finite(y.to(torch.bfloat16))


@pytest.mark.parametrize("codec", CODECS)
def test_an_opened_tensor_is_checked_without_being_decoded(codec: str) -> None:
    x = torch.randn(2, 16, 8)
    tensors, meta = encode_tensor(x, codec, name="h")
    opened = open_tensor(tensors, meta)
    assert opened.shape == (2, 16, 8) and opened.finite()
    assert torch.equal(opened.decode(), decode_tensor(tensors, meta))
    if codec != "int8":  # the values as they travelled, not a float32 copy
        assert opened.encoded is tensors["h"] and opened.spec is None
        bad = tensors["h"].clone()
        bad[1, 2, 3] = math.nan
        assert not open_tensor({"h": bad}, meta).finite()


def test_an_int8_scale_that_decodes_to_infinity_is_not_finite() -> None:
    # scales must be finite and >= 0 to be opened at all; a finite scale can still overflow
    # float32 once a code multiplies it (codes reach -128 in a peer's frame)
    tensors, meta = encode_tensor(torch.ones(4), "int8", name="q")
    limit = torch.finfo(torch.float32).max
    assert open_tensor({**tensors, "q.scales": torch.tensor([limit / 128])}, meta).finite()
    huge = {**tensors, "q.scales": torch.tensor([limit / 100])}
    assert not open_tensor(huge, meta).finite()
    assert not torch.isfinite(open_tensor(huge, meta).decode()).all()
    with pytest.raises(BadTensorSpec):
        open_tensor({**tensors, "q.scales": torch.tensor([math.inf])}, meta)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_finite_bits_agrees_with_torch_on_every_16_bit_pattern(dtype: torch.dtype) -> None:
    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16)
    values = patterns.view(dtype)
    finite = torch.isfinite(values.float())
    assert int(finite.sum()) < (1 << 16)  # the patterns include NaNs and infinities
    for value, ok in zip(values.split(1), finite.tolist(), strict=True):
        assert finite_bits(value.view(torch.uint8).numpy().data, dtype) is ok


def test_finite_bits_on_float32_hand_picked_and_random_patterns() -> None:
    hand = {  # bits -> finite
        0x7F80_0000: False,  # +inf
        0xFF80_0000: False,  # -inf
        0x7FC0_0000: False,  # quiet NaN
        0x7F80_0001: False,  # signalling NaN: exponent all ones, mantissa not zero
        0x7F7F_FFFF: True,  # the largest finite float32
        0x0000_0001: True,  # the smallest subnormal
        0x8000_0000: True,  # -0.0
    }
    for bits, ok in hand.items():
        raw = torch.tensor([bits], dtype=torch.int64).to(torch.uint32).view(torch.uint8)
        assert finite_bits(raw.numpy().data, torch.float32) is ok
    g = torch.Generator().manual_seed(0)
    words = torch.randint(0, 1 << 32, (100_000,), generator=g, dtype=torch.int64)
    values = words.to(torch.uint32).view(torch.float32)
    data = values.view(torch.uint8).numpy().data
    assert finite_bits(data, torch.float32) is bool(torch.isfinite(values).all())
    finite_values = values[torch.isfinite(values)]
    assert finite_bits(finite_values.view(torch.uint8).numpy().data, torch.float32)
    assert finite_bits(b"", torch.float32) and finite_bits(b"", torch.bfloat16)


@pytest.mark.parametrize("codec", ["fp32", "bf16"])
def test_a_tensor_opened_from_a_frame_is_checked_on_its_bytes(codec: str) -> None:
    x = torch.randn(2, 16, 8)
    tensors, meta = encode_tensor(x, codec, name="h")
    frame_tensors = decode_frame(join_frame(encode_frame("t", {}, tensors)))[2]
    assert isinstance(frame_tensors, FrameTensors)
    opened = open_tensor(frame_tensors, meta)
    assert opened.spec is not None and opened.shape == (2, 16, 8) and opened.finite()
    assert "h" not in frame_tensors._made  # checked without a torch view of the frame
    assert torch.equal(opened.decode(), decode_tensor(tensors, meta))
    for bad in (math.nan, math.inf, -math.inf):
        y = x.clone()
        y[1, 2, 3] = bad
        bad_tensors, _ = encode_tensor(y, codec, name="h")
        frame = join_frame(encode_frame("t", {}, bad_tensors))
        assert not open_tensor(decode_frame(frame)[2], meta).finite()
    wrong = decode_frame(join_frame(encode_frame("t", {}, {"h": x[:1]})))[2]
    with pytest.raises(BadTensorSpec):
        open_tensor(wrong, meta)
    with pytest.raises(MalformedMessage):
        open_tensor(decode_frame(join_frame(encode_frame("t", {}, {})))[2], meta)


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("block", [256, 2048])
def test_bytes_per_value_is_what_encode_tensor_makes(codec: str, block: int) -> None:
    """The sizes the wire codec chooses by are the encoder's own (a whole number of blocks,
    so the int8 padding does not enter)."""
    numel = 8 * block
    tensors, _ = encode_tensor(torch.randn(numel), codec, block=block)
    assert tensor_bytes(tensors) == bytes_per_value(codec, block) * numel
    with pytest.raises(ValueError):
        bytes_per_value("fp8")
