"""The stage MFU benchmark: its FLOP accounting by hand, and a smoke run on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.stage_mfu import flops_per_token, main, peak_tflops
from node.stage.model import preset


def test_flops_per_token_by_hand() -> None:
    # tiny: d_model 128, ffn 352; a stage of 6 / 3 = 2 blocks of
    # 4 * 128^2 + 3 * 128 * 352 + 2 * 128 = 200,960 parameters
    assert flops_per_token(preset("tiny"), 3, 128) == 6 * 2 * 200_960 + 12 * 2 * 128 * 128
    assert flops_per_token(preset("tiny"), 3, 128) == 2_804_736
    # 125m: 12 / 4 = 3 blocks of 7,079,424 parameters, d_model 768, 1024 tokens
    assert flops_per_token(preset("125m"), 4, 1024) == 127_429_632 + 28_311_552


def test_peak_is_given_or_known_only_for_cuda() -> None:
    assert peak_tflops(torch.device("cpu"), None) is None
    assert peak_tflops(torch.device("cpu"), 2.5) == 2.5


@pytest.mark.parametrize("peak", [None, 0.5])
def test_short_run_writes_its_figures(tmp_path: Path, peak: float | None) -> None:
    out = tmp_path / "stage_mfu.json"
    argv = ["--short", "--device", "cpu", "--out", str(out)]
    result = main(argv + (["--peak-tflops", str(peak)] if peak else []))
    assert json.loads(out.read_text()) == result
    assert result["tokens_per_s"] > 0 and result["optimizer_steps"] == 1  # 4 microbatches of 8
    assert result["stage_params"] == 2 * 200_960
    assert result["achieved_tflops"] == pytest.approx(
        result["model_flops_per_token"] * result["tokens_per_s"] / 1e12
    )
    if peak is None:
        assert result["mfu"] is None
    else:
        assert result["mfu"] == pytest.approx(result["achieved_tflops"] / peak)
