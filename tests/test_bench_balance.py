"""The balance benchmark works end to end in its short mode (its figures are not checked)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.balance import best_bottleneck, main


def test_best_bottleneck_tries_every_placement() -> None:
    # 2 fast (4/s) + 4 slow (1/s) on 3 stages: [fast], [fast], [4 slow] -> every stage 4/s
    assert best_bottleneck([4.0, 4.0, 1.0, 1.0, 1.0, 1.0], 3) == 4.0
    # three equal nodes: one per stage
    assert best_bottleneck([2.0, 2.0, 2.0], 3) == 2.0
    # fewer nodes than stages: some stage stays empty
    assert best_bottleneck([5.0, 5.0], 3) == 0.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_balance_benchmark_quick_run_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "balance.json"
    assert main(["--quick", "--policies", "throughput", "--out", str(out)]) == 0
    assert out.with_suffix(".png").stat().st_size > 0
    result = json.loads(out.read_text())
    run = result["policies"]["throughput"]
    assert run["tokens_per_s"] > 0 and run["ideal_tokens_per_s"] > 0
    assert run["ratio_to_ideal"] == pytest.approx(
        run["tokens_per_s"] / run["ideal_tokens_per_s"], rel=0.01
    )
    assert sorted(n["stage"] for n in run["nodes"])[0] >= 1
    assert len(run["nodes"]) == 6
