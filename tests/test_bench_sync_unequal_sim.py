"""The one-process study of unequal replicas (``bench.sync_unequal_sim --quick``: 3 rounds,
one seed, every variant; seconds): it runs end to end on the daemon's runners, the routing
shares work by speed, and what each variant reports holds together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import sync_unequal_sim


@pytest.mark.inprocess
def test_every_variant_runs_on_the_same_routes_and_the_rule_keeps_the_stage_closest(
    tmp_path: Path,
) -> None:
    result = sync_unequal_sim.main(["--quick", "--out", str(tmp_path)])
    out = tmp_path / "sync_unequal_sim-quick.json"
    assert json.loads(out.read_text())["summary"] == result["summary"]
    assert out.with_suffix(".png").exists()
    runs = {r["variant"]: r for r in result["runs"]}
    assert set(runs) == set(sync_unequal_sim.VARIANTS)
    # the null: stage 1's four replicas routed as the equal stage's, a permutation a step
    null = runs.pop("equal")
    assert null["inner_steps"]["1"] == null["inner_steps"]["2"]
    assert max(null["inner_steps"]["1"]) - min(null["inner_steps"]["1"]) <= 1
    assert not any(null["stage1_split"])  # no fast two to pair together
    # the same seed routes the same microbatches to the same replicas in every variant
    assert len({tuple(r["inner_steps"]["1"]) for r in runs.values()}) == 1
    fast_a, fast_b, slow2, slow4 = runs["shared"]["inner_steps"]["1"]
    assert min(fast_a, fast_b) > 2 * max(slow2, slow4)  # the slow ones are routed less work
    equal = runs["shared"]["inner_steps"]["2"]
    assert max(equal) - min(equal) <= 1  # the control stage: a random permutation each step
    # sharing the schedule pulls every place to the stage's; without it a place is the steps
    assert runs["own_lr"]["schedule_places"]["1"] == runs["own_lr"]["inner_steps"]["1"]
    shared = runs["shared"]["schedule_places"]["1"]
    assert max(shared) - min(shared) < (fast_a - slow4) / 2
    # the rule (pooled per step, one schedule) spreads the unequal stage least; the equal
    # stage's replicas' places and steps are the same in every variant
    ratios = {v: r["spread_ratio"] for v, r in runs.items()}
    assert ratios["shared"] < min(ratios["own_lr"], ratios["unpooled"], ratios["published"])
    # never enlarging (sync.max_step_scale 1) leaves the slow pairs short: a different stage
    assert ratios["cap1"] != ratios["shared"]
    # pairing across speeds never puts the fast two together
    assert not any(runs["across"]["stage1_split"])
    # the variants move the unequal stage; the equal one only through its inputs, far less
    unequal_spreads = [r["spread_mean"]["1"] for r in runs.values()]
    equal_spreads = [r["spread_mean"]["2"] for r in runs.values()]
    unequal_range = max(unequal_spreads) / min(unequal_spreads) - 1
    assert max(equal_spreads) / min(equal_spreads) - 1 < unequal_range / 4
    # every round's two pairs moved apart by some fraction of their move, and stage 1's
    # rounds are counted as split (fast with fast) or mixed
    for r in [*runs.values(), null]:
        assert len(r["pair_gap"]["1"]) == len(r["pair_gap"]["2"]) == len(r["stage1_split"]) == 3
        assert all(0 < g < 1 for s in ("1", "2") for g in r["pair_gap"][s]), r["pair_gap"]
    assert set(result["summary"]["shared"]["pair_gap_mean"]) == {"1", "2"}
    assert len(result["summary"]["shared"]["pair_gap_by_round"]["ratio"]) == 3
    # each round: what share of each stage's spread lies along its mean move, and stage 1's
    # leads along it (about the mean, so they sum to zero)
    for r in [*runs.values(), null]:
        assert all(0 <= x <= 1 for s in ("1", "2") for x in r["along_share"][s])
        assert [sum(lead) for lead in r["stage1_lead"]] == pytest.approx([0.0] * 3, abs=1e-4)
    assert len(result["summary"]["shared"]["stage1_lead_by_round"]) == 3


def test_pair_gap_is_half_the_pairs_difference_over_their_move() -> None:
    """Hand-computed: pairs whose mean moves are +1 and -1 everywhere lie 1 from their
    midpoint, each move 1 in size: gap 1. Mean moves of 2 and 1: half their difference, 0.5,
    over their mean size, 1.5. Pairs that moved alike: no gap."""
    moves = [torch.full((4,), v) for v in (2.0, 0.0, -1.0, -1.0)]
    assert sync_unequal_sim.pair_gap(moves, [(0, 1), (2, 3)]) == pytest.approx(1.0)
    moves = [torch.full((4,), v) for v in (3.0, 1.0, 1.0, 1.0)]
    assert sync_unequal_sim.pair_gap(moves, [(0, 1), (3, 2)]) == pytest.approx(0.5 / 1.5)
    alike = [torch.ones(4)] * 4
    assert sync_unequal_sim.pair_gap(alike, [(0, 3), (1, 2)]) == 0.0


@pytest.mark.inprocess
def test_diloco_rounds_give_the_unequal_stage_one_place_in_the_schedule(tmp_path: Path) -> None:
    """DiLoCo's all-reduce leaves every replica of a stage the same slow weights and, with
    the schedule shared (the daemon's ring carries the places beside the chunks), the same
    place: the stage's mean steps. Each on its own schedule, a place is the steps taken."""
    argv = ["--quick", "--method", "diloco", "--variants", "shared,own_lr", "--out", str(tmp_path)]
    result = sync_unequal_sim.main([*argv, "--no-plot"])
    runs = {r["variant"]: r for r in result["runs"]}
    steps = runs["shared"]["inner_steps"]["1"]
    assert min(steps) < max(steps) / 2  # unequal replicas: the 4x slower one took the fewest
    places = runs["shared"]["schedule_places"]["1"]
    assert max(places) - min(places) < 1.0  # one place (all that differs: steps since the round)
    assert runs["own_lr"]["schedule_places"]["1"] == runs["own_lr"]["inner_steps"]["1"]
    for run in runs.values():  # one slow-weight copy per stage: no spread to compare
        assert run["spread_mean"] == {"1": 0.0, "2": 0.0} and run["spread_ratio"] is None


def test_gap_by_round_is_each_rounds_mean_over_seeds_and_the_stages_ratio() -> None:
    """Hand-computed: two seeds, rounds cut to the shorter run's; round 0 reads stage 1
    (0.4 + 0.2) / 2 = 0.3 against stage 2 (0.1 + 0.2) / 2 = 0.15, ratio 2."""
    runs = [
        {"pair_gap": {"1": [0.4, 0.3, 0.9], "2": [0.1, 0.3, 0.9]}},
        {"pair_gap": {"1": [0.2, 0.1], "2": [0.2, 0.1]}},
    ]
    by_round = sync_unequal_sim.gap_by_round(runs)
    assert by_round["1"] == pytest.approx([0.3, 0.2])
    assert by_round["2"] == pytest.approx([0.15, 0.2])
    assert by_round["ratio"] == pytest.approx([2.0, 1.0])


def test_progress_split_by_hand() -> None:
    """Two replicas from the origin: one moved (2, 1), the other (0, -1). The mean move is
    (1, 0), of length 1; each lies (1, 1) or (-1, -1) from their mean, so half of the
    squared spread (2 of 4) lies along the move and their leads are +1 and -1 rounds' moves.
    Replicas that moved alike have no spread to split."""
    phis = [torch.tensor([2.0, 1.0]), torch.tensor([0.0, -1.0])]
    share, leads = sync_unequal_sim.progress_split(phis, phis)
    assert share == pytest.approx(0.5) and leads == pytest.approx([1.0, -1.0])
    alike = [torch.tensor([1.0, 0.0])] * 2
    assert sync_unequal_sim.progress_split(alike, alike) == (0.0, [0.0, 0.0])


@pytest.mark.inprocess
def test_in_flight_reaches_the_swarm_and_stales_its_gradients(tmp_path: Path) -> None:
    """``--in-flight`` is handed to the study's swarm: with four microbatches in flight per
    head a gradient lands after later forwards, so the same seed ends at other weights than
    the synchronous run, and the setting is recorded with the results."""
    argv = ["--quick", "--variants", "shared", "--out", str(tmp_path), "--no-plot"]
    sync = sync_unequal_sim.main([*argv, "--name", "sync"])
    stale = sync_unequal_sim.main([*argv, "--name", "stale", "--in-flight", "4"])
    assert sync["settings"]["in_flight"] == 1 and stale["settings"]["in_flight"] == 4
    (a,), (b,) = sync["runs"], stale["runs"]
    assert a["spread_mean"]["2"] > 0 and b["spread_mean"]["2"] > 0
    assert a["spread_mean"] != b["spread_mean"]


def test_pairing_across_speeds_joins_each_fast_replica_to_a_slow_one_at_random() -> None:
    import random
    from types import SimpleNamespace

    from bench.convergence_sim import SimulatedSwarm

    def pairs(across: bool, seed: int, speeds: list[float]) -> set[frozenset[int]]:
        rngs = {"pair_rng": random.Random(seed), "across_rng": random.Random(-seed)}
        swarm = SimpleNamespace(**rngs, speeds={1: speeds}, across=across)
        order = SimulatedSwarm._pairing(swarm, 1, len(speeds))  # type: ignore[arg-type]
        assert sorted(order) == list(range(len(speeds)))
        after = random.Random(seed)  # pair_rng drew one shuffle, with or without across
        after.shuffle(list(range(len(speeds))))
        assert rngs["pair_rng"].random() == after.random()
        return {frozenset(p) for p in zip(order[0::2], order[1::2], strict=False)}

    seen = set()
    for seed in range(40):
        got = pairs(True, seed, [1.0, 1.0, 0.5, 0.25])
        assert all(len(p & {0, 1}) == 1 for p in got)  # one fast, one slow in every pair
        seen.add(frozenset(got))
    assert len(seen) == 2  # both matchings of the fast two to the slow two occur
    # off, or with equal speeds, it is the published random pairing, the same draws as before
    for seed in range(5):
        plain = list(range(4))
        random.Random(seed).shuffle(plain)
        expected = {frozenset(p) for p in zip(plain[0::2], plain[1::2], strict=False)}
        assert pairs(False, seed, [1.0, 1.0, 0.5, 0.25]) == expected
        assert pairs(True, seed, [1.0] * 4) == expected
