"""NoLoCo between replicas of unequal speed, real processes (the short ``bench.sync_unequal``).

One head; block stage 1 with two full-speed replicas, one 2x and one 4x slower
(``train.slowdown``); block stage 2 with four equal replicas. On the clock schedule every
replica pairs in at least 80 % of its rounds (90 % in the ten-minute benchmark), the fast
replicas are not held to the slowest one's pace, and stage 1's spread stays within 3x of the
equal stage's. The issue's target is
2x; over a run's first minutes the ratio is noisy (this test read 1.24 and 2.01 in two CI
runs, a 20-minute benchmark run 4.48 over its first ten minutes and 0.81 over its last five),
so the benchmark measures it and this test guards against the failures it separates from:
9.8x on the H-step rule, 7.4x without pooling per inner step. (On the old H-step
schedule the fast replicas were held to the slowest one's pace with short rounds and ended
every round solo with long ones: ``bench/README.md``.)
"""

import math
from pathlib import Path

import pytest

from bench.sync_unequal import SPEEDS, main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_unequal_replicas_keep_pairing_on_the_clock_schedule(tmp_path: Path) -> None:
    result = main(["--quick", "--schedules", "clock", "--no-plot", "--out", str(tmp_path)])
    run = result["runs"][0]
    shares = {name: r["paired_share"] for name, r in run["replicas"].items()}
    print(  # the figures, for whoever reads the test's output
        {
            "paired": shares,
            "fast_over_slow4": run["fast_over_slowest_steps"],
            "spread_ratio": run["spread_ratio_to_equal"],
            "speed": run["speed_ratios"],
        }
    )
    rounds = {name: sum(r["rounds"].values()) for name, r in run["replicas"].items()}
    # 3 minutes of 4 s rounds; a round's exchange among nine processes on two cores can
    # outlast a period, so fewer are taken (19 to 25 each on a slower CI machine)
    assert min(rounds.values()) >= 12, rounds
    # the 90 % is the ten-minute benchmark's (every round paired there); with 4 s
    # rounds on two slower cores one replica in eight read 0.85 and 0.88 (3 of 20, 3 of 25
    # rounds not paired), where the failures this guards against pair none
    assert min(shares.values()) >= 0.8, shares
    slower = {name: run["speed_ratios"][name] for name in SPEEDS}
    assert slower["slow4"] > 2.5 and slower["slow2"] > 1.5, slower  # the emulation works
    assert run["fast_over_slowest_steps"] >= 2.0, run["fast_over_slowest_steps"]
    assert run["spread_ratio_to_equal"] <= 3.0, run["stages"]
    assert run["head_route_left_out"] == 0  # the cut is off by default: SWARM's draw
    for name, replica in run["replicas"].items():  # each replica's share of its stage's spread
        samples = run["stages"][str(replica["stage"])]["spread_samples"]
        assert len(replica["distance_samples"]) == len(replica["steps_at_samples"]) == len(samples)
        assert replica["steps_at_samples"] == sorted(replica["steps_at_samples"]), name
    for stage in ("1", "2"):
        names = [n for n, r in run["replicas"].items() if str(r["stage"]) == stage]
        for i, spread in enumerate(run["stages"][stage]["spread_samples"]):
            mean = sum(run["replicas"][n]["distance_samples"][i] for n in names) / len(names)
            assert spread == pytest.approx(mean)
    low, high = run["spread_ratio_interval"]
    ratio = run["spread_ratio_to_equal"]
    # a percentile interval need not contain its point in a very skewed run; it must be
    # ordered, finite and about the ratio
    assert 0 <= low <= high < math.inf
    assert low <= 1.5 * ratio and high >= ratio / 1.5, (low, ratio, high)
    assert (tmp_path / "sync_unequal-quick.json").is_file()


def test_ratio_interval_by_hand() -> None:
    """Stage 1 always at twice stage 2: every redraw gives 2. Two rounds reading 1/1 and
    3/1: a redraw takes the first twice (ratio 1), the second twice (3) or one of each (2),
    each a quarter, a quarter and a half of the time, so the 5th and 95th percentiles of
    2,000 redraws are 1 and 3. No equal-stage spread at all: no interval."""
    import random

    from bench.sync_unequal import ratio_interval

    assert ratio_interval([2.0, 4.0, 6.0], [1.0, 2.0, 3.0], random.Random(1)) == (2.0, 2.0)
    assert ratio_interval([1.0, 3.0], [1.0, 1.0], random.Random(1)) == (1.0, 3.0)
    low, high = ratio_interval([1.0], [0.0], random.Random(1))
    assert math.isnan(low) and math.isnan(high)


def test_the_null_variant_slows_no_replica_and_the_others_keep_theirs() -> None:
    """``clock_equal`` is the null for the spread ratio (stage 1 as equal as stage 2): none
    of its replicas is slowed, and it runs the clock schedule's settings; every other
    variant slows stage 1 as ``SPEEDS`` says."""
    from bench.sync_unequal import EQUAL_STAGE1, VARIANTS, parse_args, settings, slowdowns

    assert slowdowns("clock_equal") == dict.fromkeys(SPEEDS, 0)
    for variant in set(VARIANTS) - EQUAL_STAGE1:
        assert slowdowns(variant) == SPEEDS
    args = parse_args([])
    assert settings(args, "clock_equal") == settings(args, "clock")


def test_a_setting_given_on_the_command_line_reaches_every_node_over_the_variants() -> None:
    from bench.sync_unequal import parse_args, settings

    args = parse_args(["--set", "node.device=cuda", "--set", "sync.hold_s=3"])
    got = settings(args, "clock_cut")
    assert got["node.device"] == "cuda" and got["sync.hold_s"] == "3"
    assert got["train.route_cutoff"] == "2" and got["sync.schedule"] == "clock"
    assert "train.route_cutoff" not in settings(args, "clock")  # the daemon's default
