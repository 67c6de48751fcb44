"""The recovery benchmark's pieces that need no swarm: the failure schedule and the summary."""

import json
from pathlib import Path

import pytest

from bench.recovery import P_PER_PERCENT_HOUR, failure_schedule, merge_runs, summarize


def test_the_schedule_fails_each_stage_at_the_given_rate_and_replays_by_seed() -> None:
    p = 10 * P_PER_PERCENT_HOUR
    assert p == pytest.approx(0.002)  # CheckFree's simulator: 0.002 per iteration is 10 %/hour
    events = failure_schedule(p, 100_000, 4, seed=3)
    assert events == failure_schedule(p, 100_000, 4, seed=3)
    assert all(1 <= stage <= 4 for _, stage in events)
    assert len(events) == pytest.approx(p * 4 * 100_000, rel=0.1)
    # a higher rate keeps the lower rate's failures (same draws, wider threshold)
    assert set(failure_schedule(p / 2, 5000, 4, 1)) <= set(failure_schedule(p, 5000, 4, 1))


def run(per_hour: float, times: dict[str, float | None]) -> dict:
    return {
        "target_loss": 2.5,
        "p_per_stage_step": per_hour * P_PER_PERCENT_HOUR,
        "per_hour": per_hour,
        "minutes": 3.0,
        "seed": 1,
        "methods": {
            m: {
                "wall_s": [0.0, t or 180.0],
                "steps": [0, 100],
                "eval_loss": [5.0, 2.4 if t else 2.6],
                "failures": [{"step": 10, "stage": 2, "wall_s": 5.0}],
                "time_to_target_s": t,
                "final_eval_loss": 2.4 if t else 2.6,
            }
            for m, t in times.items()
        },
    }


def test_summary_compares_methods_to_checkpoint_restart(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps(run(5, {"checkpoint": 120.0, "checkfree": 80.0})))
    (tmp_path / "b.json").write_text(json.dumps(run(16, {"checkpoint": None, "checkfree": 90.0})))
    summarize(["a", "b"], tmp_path, [2.5, 2.4, 2.0])
    table = json.loads((tmp_path / "recovery-summary.json").read_text())["runs"]
    a, b = table["a"]["methods"], table["b"]["methods"]
    assert a["checkfree"]["time_to_target_s"] == {"2.5": 80.0, "2.4": 80.0, "2.0": None}
    assert a["checkfree"]["speedup_vs_checkpoint"] == {"2.5": 1.5, "2.4": 1.5, "2.0": None}
    assert table["a"]["failures"] == 1 and table["b"]["per_hour"] == 16
    assert b["checkpoint"]["time_to_target_s"]["2.5"] is None  # never reached
    assert b["checkfree"]["speedup_vs_checkpoint"]["2.5"] is None
    assert (tmp_path / "recovery-summary.png").stat().st_size > 10_000


def test_summary_groups_seeds_of_one_rate_against_random(tmp_path: Path) -> None:
    seeds = [
        {"checkfree": 80.0, "random": 100.0},
        {"checkfree": 120.0, "random": None},  # random never reached the target
        {"checkfree": None, "random": 90.0},
    ]
    names = []
    for seed, times in enumerate(seeds, start=1):
        r = run(10, times)
        r["seed"] = seed
        names.append(f"s{seed}")
        (tmp_path / f"s{seed}.json").write_text(json.dumps(r))
    summarize(names, tmp_path, [2.5])
    rate = json.loads((tmp_path / "recovery-summary.json").read_text())["by_rate"]["10"]
    assert rate["seeds"] == [1, 2, 3]
    checkfree = rate["methods"]["checkfree"]
    assert checkfree["time_to_target_s"]["2.5"] == [80.0, 120.0, None]
    assert checkfree["time_to_target_s_mean"]["2.5"] is None  # one seed never got there
    assert checkfree["before_random"]["2.5"] == 2  # seeds 1 and 2, not 3
    assert checkfree["final_eval_loss_mean"] == pytest.approx((2.4 + 2.4 + 2.6) / 3, abs=1e-4)
    assert "before_random" not in rate["methods"]["random"]
    assert rate["methods"]["random"]["time_to_target_s_mean"]["2.5"] is None


def test_summary_keeps_runs_of_different_depths_apart(tmp_path: Path) -> None:
    shallow = run(10, {"checkfree": 80.0, "random": 100.0})  # written before --stages: 4
    deep = run(10, {"checkfree": 150.0, "random": 120.0})
    deep["stages"] = 6
    (tmp_path / "shallow.json").write_text(json.dumps(shallow))
    (tmp_path / "deep.json").write_text(json.dumps(deep))
    summarize(["shallow", "deep"], tmp_path, [2.5])
    summary = json.loads((tmp_path / "recovery-summary.json").read_text())
    assert summary["runs"]["shallow"]["stages"] == 4 and summary["runs"]["deep"]["stages"] == 6
    groups = summary["by_rate"]
    assert sorted(groups) == ["10", "10 (6 stages)"]
    assert groups["10"]["methods"]["checkfree"]["before_random"]["2.5"] == 1
    assert groups["10 (6 stages)"]["methods"]["checkfree"]["before_random"]["2.5"] == 0


def test_summary_takes_runs_that_left_a_method_out(tmp_path: Path) -> None:
    (tmp_path / "all.json").write_text(
        json.dumps(run(10, {"checkpoint": 120.0, "checkfree": 80.0, "random": 100.0}))
    )
    (tmp_path / "some.json").write_text(json.dumps(run(10, {"checkfree": 90.0, "random": 70.0})))
    summarize(["all", "some"], tmp_path, [2.5])
    summary = json.loads((tmp_path / "recovery-summary.json").read_text())
    some = summary["runs"]["some"]["methods"]
    assert "checkpoint" not in some
    assert some["checkfree"]["speedup_vs_checkpoint"]["2.5"] is None  # nothing to compare to
    assert summary["runs"]["all"]["methods"]["checkfree"]["speedup_vs_checkpoint"]["2.5"] == 1.5
    methods = summary["by_rate"]["10"]["methods"]
    assert "checkpoint" not in methods  # one of the two seeds did not run it
    assert methods["checkfree"]["before_random"]["2.5"] == 1
    assert (tmp_path / "recovery-summary.png").stat().st_size > 10_000


def test_append_adds_methods_only_to_a_run_made_alike() -> None:
    earlier = run(10, {"checkfree": 80.0, "random": 100.0})
    earlier["settings"] = {"model.num_blocks": "4"}  # a file from before --stages
    later = run(10, {"checkpoint": 120.0})
    later.update(stages=4, settings={"model.num_blocks": "4"})
    merged = merge_runs(earlier, later)
    assert list(merged["methods"]) == ["checkfree", "random", "checkpoint"]
    assert merged["methods"]["checkpoint"] == later["methods"]["checkpoint"]
    other_seed = {**later, "seed": 2}
    with pytest.raises(ValueError, match=r"seed \(1 vs 2\)"):
        merge_runs(earlier, other_seed)
    deeper = {**later, "stages": 6}
    with pytest.raises(ValueError, match="stages"):
        merge_runs(earlier, deeper)
