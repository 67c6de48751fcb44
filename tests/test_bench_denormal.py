"""The subnormal-float benchmark: its rate arithmetic by hand, and its short version run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.denormal import PROGRESS, main, rate


def test_progress_lines_and_rates_by_hand() -> None:
    out = "[     5s] step    10  loss 3.1\nnoise\n[   125s] step   250  loss 2.0\n"
    progress = [(int(t), int(s)) for t, s in PROGRESS.findall(out)]
    assert progress == [(5, 10), (125, 250)]
    assert rate(progress, 0, 200) == 2.0  # 240 steps in 120 s
    assert rate(progress, 100, 200) is None  # one line in the span: no rate


@pytest.mark.slow
def test_the_short_version_runs_both_settings_and_writes_its_figures(tmp_path: Path) -> None:
    result = main(["--quick", "--out", str(tmp_path), "--no-plot"])
    assert json.loads((tmp_path / "denormal-quick.json").read_text()) == result
    runs = result["runs"]
    assert [r["flush_denormal"] for r in runs] == [False, True]
    for r in runs:
        assert r["progress"] and r["steps_per_s_last"] and r["steps_per_s_last"] > 0
        assert r["final_eval_loss"] < r["initial_eval_loss"]  # both settings train
    assert result["summary"]["last_rate_on_over_off"] > 0
