"""The false-death benchmark's detection part, as a smoke run on this checkout: real
``node join`` processes on loopback, stage 2's replica killed, stage 1's node counts stage 2
empty within a few seconds (a killed process refuses the next hop). Counting a failed peer
back in once it speaks must not make a dead one look alive."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.false_death import detection

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_a_killed_replica_is_counted_out_within_seconds(tmp_path: Path) -> None:
    run = detection("kill", tmp_path, timeout_s=30.0)
    assert run["seen_empty_s"] is not None, "stage 2 was never seen empty"
    assert run["seen_empty_s"] < 10.0, run  # the hop deadline, 10 s, would be the next signal
