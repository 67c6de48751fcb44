"""``bench.routing_window``: the daemon's hop draw under a bounded window, against figures
that follow from queueing by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import routing_window


@pytest.mark.parametrize("rule", routing_window.RULES)
def test_one_in_flight_goes_at_one_fast_service_time_whoever_takes_it(rule: str) -> None:
    # one job at a time: throughput is one over the mean service time of where it went
    got = routing_window.simulate([1.0, 1.0], 1, rule, 20_000, seed=1)
    assert got["throughput"] == pytest.approx(1.0, rel=0.03)
    assert got["mean_time_in_stage"] == pytest.approx(1.0, rel=0.03)


def test_a_full_window_uses_every_replica_as_its_speed_allows() -> None:
    # 32 in flight keep all three busy: 1 + 1 + 1/2 jobs per unit time, shared 2 : 2 : 1
    got = routing_window.simulate([1.0, 1.0, 2.0], 32, "swarm", 40_000, seed=2)
    assert got["throughput"] == pytest.approx(2.5, rel=0.03)
    assert got["shares"] == pytest.approx([0.4, 0.4, 0.2], abs=0.02)


@pytest.mark.parametrize("rule", routing_window.RULES)
def test_one_in_flight_goes_at_the_mean_service_time_of_where_it_was_sent(rule: str) -> None:
    # renewal: one job at a time, so a job takes sum(share x service time) on average
    services = [1.0, 1.0, 17.0]
    got = routing_window.simulate(services, 1, rule, 40_000, seed=3)
    mean_s = sum(share * s for share, s in zip(got["shares"], services, strict=True))
    assert got["throughput"] == pytest.approx(1 / mean_s, rel=0.03)
    assert got["mean_time_in_stage"] == pytest.approx(mean_s, rel=0.03)


def test_a_much_slower_replica_costs_the_draw_most_where_few_are_in_flight() -> None:
    def cost(window: int) -> float:
        alone = routing_window.simulate([1.0, 1.0], window, "swarm", 20_000, seed=4)
        beside = routing_window.simulate([1.0, 1.0, 17.0], window, "swarm", 20_000, seed=4)
        return float(beside["throughput"] / alone["throughput"])

    # a job drawn to it holds one of few slots 17 times as long (bench/README.md)
    assert cost(2) < cost(6) < cost(16)


def test_heads_share_the_stage_as_one_head_with_their_windows_together() -> None:
    # a full stage is a full stage, whoever fills it: 4 heads x 8 = 32 in flight
    got = routing_window.simulate([1.0, 1.0, 2.0], 8, "swarm", 40_000, seed=5, senders=4)
    assert got["throughput"] == pytest.approx(2.5, rel=0.03)
    assert got["shares"] == pytest.approx([0.4, 0.4, 0.2], abs=0.02)


def test_the_cut_recovers_what_the_draw_loses_to_a_far_slower_replica() -> None:
    # two in flight beside a replica 17 times slower (bench/README.md): the draw loses a
    # quarter of the fast pair's rate; leaving it out loses almost nothing
    alone = routing_window.simulate([1.0, 1.0], 2, "swarm", 20_000, seed=6)["throughput"]
    for rule, low, high in (("swarm", 0.6, 0.85), ("cut2", 0.93, 1.1)):
        got = routing_window.simulate([1.0, 1.0, 17.0], 2, rule, 20_000, seed=6)
        assert low < got["throughput"] / alone < high, rule


def test_several_heads_taking_the_largest_weight_herd_and_the_draw_does_not() -> None:
    # eight heads of one in flight each on their own stale figures (SWARM's reason to draw)
    got = {
        rule: routing_window.simulate([1.0, 1.0, 2.0], 1, rule, 20_000, seed=7, senders=8)
        for rule in routing_window.RULES
    }
    assert got["least"]["throughput"] < 0.92 * got["swarm"]["throughput"]
    assert got["cut2"]["throughput"] > 0.97 * got["swarm"]["throughput"]


def test_the_benchmark_writes_its_rows(tmp_path: Path) -> None:
    argv = ["--jobs", "2000", "--windows", "1", "6", "--slow", "1", "17", "--out", str(tmp_path)]
    result = routing_window.main([*argv, "--senders", "1", "2"])
    assert json.loads((tmp_path / "routing_window.json").read_text()) == result
    assert (tmp_path / "routing_window.png").is_file()
    assert [(r["senders"], r["window"], r["slow"]) for r in result["rows"]] == [
        (s, w, slow) for s in (1, 2) for w in (1, 6) for slow in (1, 17)
    ]
    for row in result["rows"]:
        assert row["capacity"] == pytest.approx(2 + 1 / row["slow"])
        for rule in routing_window.RULES:
            got = row[rule]
            assert got["over_fast_alone"] == pytest.approx(got["throughput"] / got["fast_alone"])
