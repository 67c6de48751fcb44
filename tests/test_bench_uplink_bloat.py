"""The uplink benchmark's smoke run: ``bench.uplink_bloat --quick`` builds a host behind a
router namespace whose uplink is a 10 Mbit/s token bucket with a 1 s queue, uploads 4 MB
through it with CUBIC, CUBIC paced by the node and BBR, and times small requests beside each
upload. It checks that the run goes end to end and reports what the full run reports (the
full run's figures are in ``bench/README.md``), not which is faster, and that the node's
pacer engaged and measured the uplink it was behind."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import uplink_bloat, uplink_live
from node.net.tcp import CongestionControl
from tests.netns import netns_available

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_the_uplink_benchmark_uploads_with_each_congestion_control(tmp_path: Path) -> None:
    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    for name in ("cubic", "bbr"):
        cc = CongestionControl(name)
        if not cc.check():
            pytest.skip(f"congestion control {name} unavailable here: {cc.why}")
    result = uplink_bloat.main(["--quick", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "uplink_bloat-quick.json").read_text()) == result
    assert [r["congestion"] for r in result["runs"]] == list(uplink_bloat.VARIANTS)
    for run in result["runs"]:
        # 4 MB through 10 Mbit/s takes at least 3.4 s, and the small requests went on beside it
        assert run["upload_s"] >= 4 * 2**20 * 8 / 10e6
        assert len(run["during_ms"]) >= 3 and run["idle_ms"] > 0
    summary = result["summary"]
    assert set(summary) >= {"cubic", "paced", "bbr", "cubic_over_bbr_p50", "cubic_over_paced_p50"}
    assert 0.5 < summary["upload_s_bbr_over_cubic"] < 2.0  # the same upload either way
    assert 0.5 < summary["upload_s_paced_over_cubic"] < 2.0
    # the pacer engaged (CUBIC filled the 1 s queue first) and measured the 10 Mbit/s uplink
    # from the bytes acknowledged, which a kernel's burst-inflated rate reading would not
    assert summary["paced"]["paced_share"] > 0.5
    assert 0.5 < summary["paced"]["capacity_bytes_per_s_median"] * 8 / 10e6 < 1.5


def test_the_daemon_behind_a_thin_uplink_paces_its_uploads(tmp_path: Path) -> None:
    """``bench.uplink_live``'s paced run, short: a public head and a NATed block node
    (real ``node join`` processes) behind a 20 Mbit/s router with a 1 s queue, the block
    node's sockets on CUBIC. Its outputs and gradients (a megabyte each) fill the router's
    queue; it notices the queueing delay, paces its uploads and says so; its status and
    metrics show the uplink it measured, and the swarm trains on while small requests
    cross the uplink. (At 2 Mbit/s six microbatches always in flight queue 25 s of uploads,
    paced or not, and hops time out: the pipeline's window, not the pacer, fits such a link,
    ``tests/test_bench_thin_uplink.py``.)"""
    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    run = uplink_live.live("auto", 20, 10, tmp_path)
    print({k: v for k, v in run.items() if k != "probes"})
    log = (tmp_path / "natted.log").read_text(errors="replace")
    assert run["in_use"] == "cubic" and run["pacer"] is not None
    # when the queue passed its target the uplink was full: what the node measured then, from
    # the bytes acknowledged, is the 20 Mbit/s uplink, headers included (later readings may
    # be of a pipeline that leaves it idle at times)
    measured = re.search(r"pacing uploads at about ([0-9.]+) Mbit/s", log)
    assert measured is not None, log[-3000:]
    assert 0.5 < float(measured.group(1)) / 20 < 1.5, measured.group(0)
    assert set(run["uplink_metrics"]) == {
        "murmur_uplink_capacity_bytes_per_second",
        "murmur_uplink_pace_bytes_per_second",
        "murmur_uplink_queueing_seconds",
    }
    assert run["microbatches_per_s"] > 0 and run["probe_failed"] == 0
