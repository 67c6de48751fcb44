"""``bench/gossip_thin.py``'s short version: NoLoCo with ``sync.codec = auto`` between a
public replica and one behind a 5 Mbit/s uplink, real ``node join`` processes."""

from __future__ import annotations

import json
import queue
from pathlib import Path

import pytest

from bench import gossip_thin
from swarm.wirecodec import SYNC_CANDIDATES
from tests.netns import netns_available

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_auto_keeps_fp32_on_the_fat_uplink_and_both_replicas_take_their_rounds(
    tmp_path: Path,
) -> None:
    """Two 20 s rounds after both replicas serve. The public replica's uploads are fast (or
    not measured yet): it gossips in fp32, the published rule; the NATed one in whatever
    its uplink carries in time. Both take every round, paired or solo, and the swarm trains;
    the replicas' distances from their mean slow weights are sampled.
    (The benchmark's 200 s runs: fixed fp32 paired the NATed replica in 3 of 6 rounds and
    the public one in 1 of 6, ``auto`` in 5 and 4; ``bench/README.md``.)"""
    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    row = gossip_thin.live("auto", 5.0, 45.0, 20.0, tmp_path)
    print(row)
    assert row["codec_setting"] == "auto"
    assert row["public"]["codec"] == "fp32", row
    assert row["natted"]["codec"] in SYNC_CANDIDATES, row
    for name in ("public", "natted"):
        assert row[name]["paired"] + row[name]["solo"] >= 1, row
    assert row["head_microbatches"] > 0, row
    # sampled in the middle of the rounds: with two replicas each is half their distance away
    assert row["spread_samples"] >= 1, row
    assert row["public"]["spread_from_mean"] == pytest.approx(
        row["natted"]["spread_from_mean"], rel=1e-3
    ), row


def test_a_sample_s_answer_skips_late_answers_to_earlier_requests() -> None:
    answers: queue.Queue[str] = queue.Queue()
    for line in (["1", [0.5, 0.5]], ["2", "ConnectionError()"], ["3", [0.1, 0.3]]):
        answers.put(json.dumps(line) + "\n")
    assert gossip_thin._answer(answers, "3", 5.0) == [0.1, 0.3]  # 1 and 2 came too late
    answers.put(json.dumps(["4", "ConnectionError()"]))
    assert gossip_thin._answer(answers, "4", 5.0) == "ConnectionError()"
    assert gossip_thin._answer(answers, "5", 0.05) == "no answer within 0.05 s"
