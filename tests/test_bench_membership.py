"""The membership benchmark's smoke run: ``bench.membership --quick`` (20 and 60 simulated
nodes, short phases) runs end to end, and what it reports holds together; the real-process
part with a few daemons (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import membership


@pytest.mark.inprocess
def test_the_simulated_swarm_costs_the_same_per_node_and_news_is_fast(tmp_path: Path) -> None:
    out = tmp_path / "membership.json"
    result = membership.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == result and out.with_suffix(".png").exists()
    small, large = result["simulated"]
    assert (small["n"], large["n"]) == (20, 60)
    # a quiet swarm: traffic per node does not grow with the swarm (the budget holds it; the
    # refreshes in 120 s are a few dozen, hence the margin; whole tables would be 3 times)
    assert large["bytes_per_node_per_s"] < 1.5 * small["bytes_per_node_per_s"]
    assert large["bytes_per_node_per_s"] * 8 < membership.TARGET_BITS_PER_S
    ttl = result["config"]["ttl_s"]
    for row in (small, large):
        # neighbourhood tables (3 of 8 stages) and a right summary of each of the others
        assert row["tables"] == "neighbourhood" and row["table_size_mean"] < 0.5 * row["n"]
        assert row["summaries_missing"] == 0 == row["summaries_miscounted"]
        assert row["summaries_checked"] > 0
        churn = row["churn"]
        assert churn["events"] >= 1
        assert churn["join_visible_s_max"] < membership.JOIN_TARGET_S
        assert ttl <= churn["death_gone_s_max"] < ttl + membership.DEATH_MARGIN_S


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_processes_report_what_the_simulation_does(tmp_path: Path) -> None:
    out = tmp_path / "membership.json"
    args = ["--sizes", "12", "--steady-s", "15", "--churn-s", "20", "--real", "12"]
    result = membership.main([*args, "--events", "1", "--out", str(out)])
    (real,) = result["real"]
    sim = real["simulated_idle"]
    assert real["n"] == 12 == sim["n"] and real["frame_bytes_per_node_per_s"] > 0
    # the same protocol: real frames within a factor of two of the simulated idle swarm's
    ratio = real["frame_bytes_per_node_per_s"] / sim["frame_bytes_per_node_per_s"]
    assert 0.5 < ratio < 2.0, (real, sim)
    ttl = result["config"]["ttl_s"]
    assert real["death_gone_s"][0] < ttl + membership.DEATH_MARGIN_S + 2.0  # polling
    assert real["join_visible_s"][0] < membership.JOIN_TARGET_S
    assert real["summaries_checked"] > 0  # each daemon's status shows far stages' summaries
