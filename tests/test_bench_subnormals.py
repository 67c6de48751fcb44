"""``bench.subnormals``: its count by hand, its written-out attention against the fused
kernel it stands in for, and the short run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bench import subnormals


def test_a_subnormal_is_nonzero_and_below_the_smallest_normal() -> None:
    torch.set_flush_denormal(False)  # with the flag, the CPU reads subnormal inputs as 0
    t = torch.tensor([0.0, 1e-39, -1e-40, 1.2e-38, 1e-30, 1.0, float("inf")])
    assert subnormals.subnormal_count(t) == (2, 7)  # 1.2e-38 is just above 1.1755e-38
    assert subnormals.subnormal_count(torch.tensor([1, 2])) == (0, 0)
    assert subnormals.subnormal_count(None) == (0, 0)


@pytest.mark.parametrize("causal", [True, False])
def test_the_written_out_attention_is_the_fused_kernels_maths(causal: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=gen, requires_grad=True) for _ in range(3))
    census = subnormals.Census()
    mine = subnormals.written_out_attention(census, "x")(q, k, v, is_causal=causal)
    fused = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert torch.allclose(mine, fused, atol=1e-5)
    mine.sum().backward()
    assert census.counts["x attention probabilities"][1] == 2 * 4 * 8 * 8
    assert census.counts["x attention probabilities grad"][1] == 2 * 4 * 8 * 8


def test_the_short_run_counts_everywhere_it_looks(tmp_path: Path) -> None:
    result = subnormals.main(["--quick", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "subnormals-quick.json").read_text()) == result
    places = set(result["census"])
    for place in (
        "blocks attention probabilities",
        "blocks attention probabilities grad",
        "s0 Linear output grad",  # the LM head's logits' gradient
        "s1 grad wq",
        "s0 grad tok_embedding",
    ):
        assert place in places, place
    assert result["state"]["s1 parameters"]["values"] > 0
    assert len(result["flush_off_s"]) == len(result["flush_on_s"]) == 1
