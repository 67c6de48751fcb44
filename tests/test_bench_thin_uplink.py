"""``bench/thin_uplink.py``'s short version: the default in-flight window on a 2 Mbit/s uplink."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import thin_uplink
from tests.netns import netns_available


def test_the_default_window_trains_through_a_2_mbit_uplink(tmp_path: Path) -> None:
    """A public head and a NATed block node (real ``node join`` processes) behind a router
    whose uplink is 2 Mbit/s with a 1 s queue, every setting at its default but CUBIC: the
    block node's output and gradient take about 4 s of uplink per microbatch. The head's
    window shrinks to what the link carries in time, and microbatches complete steadily
    with none dropped. (With ``train.window = fixed`` six in flight queue 25 s of uploads,
    hops and microbatches miss their deadlines, and the benchmark's runs completed none in
    120 s.)"""
    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    run = thin_uplink.live(None, 2, 40, tmp_path)
    print({k: v for k, v in run.items()})
    assert run["window"] == "adaptive"  # the default
    assert run["completed"] >= 5, run
    assert run["dropped"] == 0, run
    # the block node's pacer read the uplink when it first engaged, not the goodput of an
    # upload averaged with the idle time before it (0.5 to 0.9 Mbit/s before that was fixed)
    assert run["pacer_first_mbit"] is not None, run
    assert 0.6 < run["pacer_first_mbit"] / 2 < 1.5, run
    # the latter half of the run trained too: not a burst at the start and then a stall
    timeline = run["timeline"]
    assert timeline[-1][1] > timeline[len(timeline) // 2 - 1][1], timeline
