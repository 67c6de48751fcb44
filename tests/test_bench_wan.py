"""The WAN benchmark's smoke run: ``bench.wan --quick`` (0 and 50 ms one-way, 100 Mbit/s
token buckets, head and 3 block stages in network namespaces; and 50 ms behind 20 Mbit/s
buckets with ``train.wire_codec = auto``) runs end to end and reports what the full run
reports, and on the thin uplinks every node has chosen int8 by the rates its receivers
measured on real shaped links."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import wan
from tests.netns import netns_available

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_wan_benchmark_trains_through_shaped_links_and_reports_the_ratio(
    tmp_path: Path,
) -> None:
    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    result = wan.main(["--quick", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "wan-quick.json").read_text()) == result
    assert (tmp_path / "wan-quick.png").stat().st_size > 0
    runs = {r["name"]: r for r in result["runs"]}
    assert set(runs) == {"0ms", "50ms", "50ms-20mbit-auto"}
    for run in runs.values():
        assert run["tokens_at_eval"] >= 180_000 and run["tokens_per_s"] > 0
        assert math.isfinite(run["eval_loss"])
        assert set(run["compute_utilisation"]) == {"1:s0", "2:s1", "3:s2", "4:s3"}
        assert all(0 < u <= 1.05 for u in run["compute_utilisation"].values())
        assert run["window_mean"] and run["window_mean"] > 0
    assert result["ratio_50ms"] == runs["50ms"]["ratio_to_0ms"]
    assert runs["0ms"]["ratio_to_0ms"] == 1.0
    thin = runs["50ms-20mbit-auto"]["wire"]
    assert set(thin) == {"1:s0", "2:s1", "3:s2", "4:s3"}
    for node in thin.values():
        assert node["codec"] == "int8", thin
        assert 5 < node["link_mbps"] < 30, thin  # 20 Mbit/s buckets, as the receivers timed them
    for name in ("0ms", "50ms"):  # fixed bf16: the latency rows do not change codec
        assert {n["codec"] for n in runs[name]["wire"].values()} == {"bf16"}
