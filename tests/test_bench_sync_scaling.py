"""The synchronisation benchmark's smoke run with real uplinks: ``bench.sync_scaling --quick
--netns`` puts every replica in a namespace of its own behind a 10 Mbit/s kernel token
bucket, with a stage whose NoLoCo contribution (4 MB) takes 3.2 s to cross each way, longer
than the fixed timeout (2 s) and the round's deadline (3 s). Pairs must still form and finish
and every ring round too: the transfers are given their size at the slowest rate waited for
(``swarm.gossip``, ``swarm.allreduce``). With the fixed timeouts alone none would.

Of two replicas every round pairs. Of four, one pair may miss its round: a replica that asks
one already sending its weights to its partner waits for the answer behind 3.2 s of weights
in that uplink's queue, its 2 s request times out, and little of the 3 s deadline is left
(CI once: two of four ended solo at the deadline, the other two paired in 3.3 and 6.6 s).
So with four each repetition must pair at least one pair."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import sync_scaling
from tests.netns import netns_available

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

NUMEL = 500_000
"""A 2 MB stage: phi and the pseudo-gradient in fp32 are 4 MB each way."""
RATE_BYTES_S = 10 * 125_000


def test_noloco_and_the_ring_finish_through_thin_real_uplinks_past_the_fixed_timeouts(
    tmp_path: Path,
) -> None:
    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    result = sync_scaling.main(
        ["--quick", "--netns", "--numel", str(NUMEL), "--latency-ms", "0"]
        + ["--bandwidth-mbps", "10", "--timeout-s", "2", "--period", "16"]
        + ["--out", str(tmp_path)]
    )
    assert json.loads((tmp_path / "sync_scaling.json").read_text()) == result
    assert result["params"]["uplink"] == "kernel token bucket per namespace"
    one_way_s = 8 * NUMEL / RATE_BYTES_S  # one contribution through one bucket: 3.2 s
    for m in result["measured"]:
        noloco = [r for r in m["rows"] if r["method"] == "noloco"]
        if m["n"] == 2:
            assert m["noloco_paired_fraction"] == 1.0, m
        for rep in {r["rep"] for r in noloco}:
            assert sum(r["paired"] for r in noloco if r["rep"] == rep) >= 2, (rep, m)
        assert m["ring_failed"] == 0, m
        # the buckets shaped it: an acceptor has its partner's contribution after one upload,
        # a proposer after two, one after the other (burst and rounding aside)
        assert m["noloco_s"] >= 0.8 * one_way_s, m
        assert m["noloco_slowest_s"] >= 0.8 * 2 * one_way_s, m
