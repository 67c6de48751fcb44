"""The relay benchmark's smoke run: ``bench.relay --quick`` (one short round of each way to
reach the block stage) runs end to end and reports what the full run reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import relay

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_the_relay_benchmark_runs_each_variant_and_counts_the_relay(tmp_path: Path) -> None:
    result = relay.main(["--quick", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "relay-quick.json").read_text()) == result
    runs = {r["variant"]: r for r in result["runs"]}
    assert set(runs) == set(relay.VARIANTS)
    assert runs["direct"]["block_reachability"] != "relayed"
    for variant in ("via_head", "via_relay"):
        run = runs[variant]
        assert run["block_reachability"] == "relayed"
        assert run["microbatches"] > 0 and run["tokens_per_s"] > 0
        # every microbatch's forward went down the relay and its acks came back
        assert run["relay_kb_per_microbatch"]["to_node"] > 0
        assert run["relay_kb_per_microbatch"]["from_node"] > 0
    assert set(runs["via_relay"]["cpu_ms_per_microbatch"]) == {"head", "relay", "block"}
    assert result["summary"]["direct"]["ratio_to_direct_median"] == 1.0
