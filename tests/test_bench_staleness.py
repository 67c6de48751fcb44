"""The staleness comparison (``bench.staleness --quick``: 20k tokens, one seed, every
variant; seconds): each variant runs end to end on the daemon's runners in the one-process
emulation, the emulated pipeline really makes gradients late, and 2bw really coarsens the
steps, at the live check's sizes and at the daemon's own."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench import staleness


def finals(result: dict[str, Any], variant: str) -> list[float]:
    (budget,) = result["budgets"].values()
    return [run["eval_loss"][-1] for run in budget["runs"][variant].values()]


@pytest.mark.inprocess
def test_every_variant_runs_and_each_changes_what_it_claims_to(tmp_path: Path) -> None:
    result = staleness.main(["--quick", "--out", str(tmp_path), "--name", "quick"])
    assert json.loads((tmp_path / "quick.json").read_text()) == result
    assert (tmp_path / "quick.png").exists()
    (budget,) = result["budgets"].values()
    assert set(budget["runs"]) == set(staleness.VARIANTS)
    assert all(math.isfinite(x) for v in staleness.VARIANTS for x in finals(result, v))
    # 3 in flight x 8 samples over 8 samples a step: a 2bw step is 3 units, and a stale
    # gradient lands 2 steps late, by which sync_ahead extrapolates
    assert budget["units_per_2bw_step"] == 3 and budget["stash_delay_steps"] == 2
    # the emulation is deterministic: a variant that changed nothing would end where sync does
    sync = finals(result, "sync")
    for variant in ("stash", "2bw", "sync_2bw_steps", "2bw_lr", "predict", "sync_ahead"):
        assert finals(result, variant) != sync, variant
    assert finals(result, "predict") != finals(result, "stash")  # the prediction did move
    assert finals(result, "2bw") != finals(result, "sync_2bw_steps")  # staleness, one step
    steps = {v: r["0"]["inner_steps"] for v, r in budget["runs"].items()}
    assert steps["sync"] == steps["stash"] == steps["predict"] == steps["sync_ahead"]
    assert steps["2bw"] == steps["sync_2bw_steps"] and steps["2bw"] % 3 == 0


@pytest.mark.inprocess
def test_the_daemon_sizes_put_two_microbatches_in_a_step_and_sets_reach_every_run(
    tmp_path: Path,
) -> None:
    result = staleness.main(
        ["--quick", "--daemon-sizes", "--variants", "stash,2bw", "--no-plot"]
        + ["--set", "train.betas=0.7,0.999", "--out", str(tmp_path)]
    )
    (budget,) = result["budgets"].values()
    assert result["sizes"] == "daemon"
    s = budget["settings"]
    assert (s["data.batch_size"], s["data.seq_len"], s["train.step_samples"]) == ("16", "128", "32")
    assert s["train.betas"] == "0.7,0.999" and result["sets"] == {"train.betas": "0.7,0.999"}
    # 3 in flight x 16 samples over 32 a unit: 2bw steps every 2 units
    assert budget["units_per_2bw_step"] == 2 and budget["stash_delay_steps"] == 1  # 2 over 2
    assert not (tmp_path / "staleness.png").exists()
    assert finals(result, "stash") != finals(result, "2bw")


@pytest.mark.inprocess
def test_with_three_replicas_a_step_takes_half_again_the_tokens(tmp_path: Path) -> None:
    """``--replicas 3``: the same tokens spread over three replicas of each stage (one of
    them steps alone each round), so each takes about two thirds of the steps."""
    args = ["--quick", "--variants", "sync", "--no-plot", "--out", str(tmp_path)]
    two = staleness.main(args)
    three = staleness.main([*args, "--replicas", "3"])
    assert (two["replicas_per_stage"], three["replicas_per_stage"]) == (2, 3)
    (steps_two,) = [
        r["0"]["inner_steps"] for b in two["budgets"].values() for r in b["runs"].values()
    ]
    (steps_three,) = [
        r["0"]["inner_steps"] for b in three["budgets"].values() for r in b["runs"].values()
    ]
    assert abs(steps_three - 2 * steps_two / 3) <= 1
    assert math.isfinite(finals(three, "sync")[0]) and finals(three, "sync") != finals(two, "sync")
