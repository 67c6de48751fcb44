"""The routing-freshness benchmark's smoke run: ``bench.routing_freshness --quick`` (two
record periods, 200 virtual seconds, one seed; a few seconds) runs end to end and what it
reports holds together."""

from __future__ import annotations

import json
from pathlib import Path

from bench import routing_freshness


def test_both_ways_run_on_the_same_arrivals_and_report_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "routing_freshness.json"
    result = routing_freshness.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == result and out.with_suffix(".png").exists()
    rows = result["rows"]
    assert {(r["period_s"], r["mode"]) for r in rows} == {
        (p, m) for p in (10.0, 1000.0) for m in routing_freshness.MODES
    }
    capacity = 32 / 4 / (sum(routing_freshness.RATES) - 32 + 32 / 4)
    for r in rows:
        assert r["microbatches"] > 1000 and r["wait_p95_s"] >= r["wait_mean_s"] > 0
        assert r["slowed_capacity_share_after"] == round(capacity, 4)
    # the same seed, the same Poisson arrivals: within a few of each other (the draws differ)
    counts = [r["microbatches"] for r in rows if r["period_s"] == 1000.0]
    assert max(counts) - min(counts) < 0.05 * max(counts)
    # the router given each replica's acks never lets a queue grow as long as one given
    # 1000-second-old records (a deterministic simulation: this is the policy, not speed)
    by = {(r["period_s"], r["mode"]): r for r in rows}
    assert by[1000.0, "acks"]["max_queue"] < by[1000.0, "records"]["max_queue"]
