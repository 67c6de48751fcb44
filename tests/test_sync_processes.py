"""NoLoCo, DiLoCo and data parallel between real ``node join`` processes on 127.0.0.1."""

from __future__ import annotations

import secrets
import signal
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from node.client import fetch_status
from node.demo import LocalSwarm, wait_ready
from node.stage.export import fetch_stage_state
from swarm.outer import rms_distance
from tests.helpers import FAST_SWARM, LIBFAKETIME, faketime_env, wait_for, wrong_clock

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

BASE = {
    **FAST_SWARM,
    "swarm.num_block_stages": "2",
    "train.step_samples": "16",
    "sync.outer_steps": "4",
    "sync.round_deadline_s": "5",
    "sync.request_timeout_s": "3",
    "sync.hold_s": "2",
}


def slow_weights(address: str) -> torch.Tensor:
    state = fetch_stage_state(address, fetch_status(address)["stage"])
    return state.tensors["outer.phi"].clone()


def sync_of(address: str) -> dict[str, Any]:
    out: dict[str, Any] = fetch_status(address)["sync"]
    return out


def same_round_slow_weights(a: str, b: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Both replicas' slow weights, read between rounds, after the same number of outer
    steps on each: a round that ends a few milliseconds later on one replica than on the
    other (once in a CI run on a busy machine: one outer step apart, RMS 5.7e-3) is not a
    difference between them."""
    for _ in range(50):
        before = [sync_of(x) for x in (a, b)]
        steps = {st["outer_steps"] for st in before}
        if len(steps) == 1 and not any(st["in_progress"] for st in before):
            weights = slow_weights(a), slow_weights(b)
            after = [sync_of(x) for x in (a, b)]
            if {st["outer_steps"] for st in after} == steps:
                return weights
        time.sleep(0.1)
    raise AssertionError(f"the replicas were never between rounds at once: {before}")


def two_replica_swarm(s: LocalSwarm) -> tuple[str, str, str, str]:
    """Head, two replicas of stage 1, stage 2, all serving: their addresses."""
    head, a, b, last = (s.start_node(stage) for stage in (0, 1, 1, 2))
    for x in (head, a, b, last):
        wait_ready(x, 90, s)
    return head, a, b, last


def kill(s: LocalSwarm, address: str) -> None:
    """SIGKILL the node at ``address`` and wait until it is gone."""
    victim = next(p for n, p, _ in s.procs if n.endswith(address.rsplit(":", 1)[1]))
    victim.send_signal(signal.SIGKILL)
    victim.wait()


def run_three_replicas(tmp_path: Path, gamma: str, rounds: int) -> float:
    """Head, 3 replicas of stage 1, stage 2: the median RMS distance between partners' slow
    weights at exchange time (same round) over the second half of ``rounds`` outer rounds.
    The median, not the mean: a replica paired after a few solo rounds reads a spike (3x
    the rounds around it) that a mean over eight rounds carries."""
    settings = {
        **BASE,
        "sync.gamma": gamma,
        "train.warmup_steps": "5",  # full steps at once
        "sync.round_s": "4",  # as the derived period is alone, held under a second swarm's load
    }
    s = LocalSwarm(tmp_path / f"g{gamma}", settings)
    s.log_dir.mkdir()
    try:
        addresses = [s.start_node(stage) for stage in (0, 1, 1, 1, 2)]
        for a in addresses:
            wait_ready(a, 90, s)
        replicas = addresses[1:4]
        wait_for(
            lambda: all(sync_of(a)["outer_steps"] >= rounds for a in replicas),
            240,
            f"{rounds} outer rounds",
        )
        # one round period: hysteresis alone left one replica on 8 s rounds beside two on
        # 4 s for a whole run, taking half their rounds (``swarm.schedule.round_period``)
        wait_for(
            lambda: len({sync_of(a)["round_s"] for a in replicas}) == 1,
            10,
            "the replicas on one round period",
            describe=lambda: [sync_of(a)["round_s"] for a in replicas],
        )
        stats = [sync_of(a) for a in replicas]
        paired = sum(st["rounds"].get("paired", 0) for st in stats)
        assert paired >= rounds, paired  # most rounds found a partner
        late = [d for st in stats for r, d in st["spread_history"] if rounds // 2 <= r < rounds]
        assert late, stats
        return statistics.median(late)
    finally:
        s.stop(grace_s=5)


def test_noloco_pull_term_keeps_replicas_closer(tmp_path: Path) -> None:
    """Without the pull the partners' distance grows as a random walk, with it it levels
    off; 20 rounds let the two part clearly. CI twice read no difference (ratios 1.04 and
    1.00; the last time 5.8e-3 with pull and without) where this machine read 0.15 to 0.37.
    The likely reason: with the default 60 warm-up steps (about 10 rounds of 6 steps here)
    the walk reaches full step size only inside the window read (rounds 10 to 19), later
    still where a round holds fewer steps, and the pull has little to undo. So the inner
    learning rate warms up in 5 steps here. Two probe runs so read 0.22 and 0.22 (with
    pull 4.3e-3 and 4.1e-3, without 1.9e-2 and 1.8e-2, the walk growing from the first
    round); one with 60 read 0.29. The two swarms run side by side (ten processes, as the
    unequal-speed test runs nine): a round is a wall-clock event, so both take their 20
    rounds in the time one took alone, under the same load."""
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(run_three_replicas, tmp_path, g, 20) for g in ("0.7", "0.0")]
        with_pull, without = (run.result() for run in runs)
    print(f"late-round partner spread: with pull {with_pull:.3e}, without {without:.3e}")
    assert with_pull < 0.8 * without, (with_pull, without)


@pytest.mark.parametrize("method", ["diloco", "allreduce"])
def test_ring_methods_keep_two_replicas_identical(tmp_path: Path, method: str) -> None:
    s = LocalSwarm(tmp_path, {**BASE, "sync.method": method})
    try:
        head, a, b, last = two_replica_swarm(s)
        wait_for(
            lambda: sync_of(a)["rounds"].get("allreduced", 0) >= 3,
            150,
            "all-reduced rounds",
            describe=lambda: {x: sync_of(x) for x in (a, b)},
        )
        st = sync_of(a)
        assert st["bytes_sent"] > 0 and st["rounds"].get("failed", 0) <= 2
        failed = sum(sync_of(x)["rounds"].get("failed", 0) for x in (a, b))
        if method == "diloco" and not failed:
            # after an outer step both replicas hold the same slow weights. A failed round
            # (allowed above: the first may start before both replicas know each other, and
            # a replica left one clock round behind then gives up the round it is in to
            # join its partner's) makes each apply its own pseudo-gradient, and DiLoCo's slow
            # weights then stay apart for good, so identity is only checked when neither failed one.
            assert rms_distance(*same_round_slow_weights(a, b)) < 1e-6
    finally:
        s.stop(grace_s=5)


def test_replicas_that_get_no_work_keep_the_round_clock(tmp_path: Path) -> None:
    """A round on the clock schedule is a wall-clock event: a replica that routing sends
    nothing for a while (banned after a failed hop, say) must still meet its partners at the
    boundary, or their rounds fail. With the head gone, no work reaches either replica, and
    their DiLoCo rounds go on all-reducing."""
    s = LocalSwarm(tmp_path, {**BASE, "sync.method": "diloco"})
    try:
        head, a, b, last = two_replica_swarm(s)
        wait_for(lambda: sync_of(a)["rounds"].get("allreduced", 0) >= 1, 120, "a first round")
        kill(s, head)
        time.sleep(2)  # jobs already queued finish
        then = {x: sync_of(x)["rounds"].get("allreduced", 0) for x in (a, b)}
        wait_for(
            lambda: all(sync_of(x)["rounds"].get("allreduced", 0) >= then[x] + 2 for x in (a, b)),
            60,
            "rounds without work",
            describe=lambda: {x: sync_of(x) for x in (a, b)},
        )
    finally:
        s.stop(grace_s=5)


def test_a_replica_whose_clock_is_wrong_still_pairs_and_a_survivor_trains_on(
    tmp_path: Path,
) -> None:
    """Two replicas of one block stage on 4 s rounds in a keyed swarm, one machine's clock
    10 s ahead (more than a round and twice the hold; within the 60 s a signed request's
    stamp may be off): on raw clocks each reaches every boundary 10 s apart from the other,
    its request held in vain or refused ``stale``, and every round ends solo. Each measures
    the other's clock on its membership pings and both read the median, 5 s from either:
    most rounds pair, and each says how far off it was. Then the partner is killed: the
    survivor's rounds go on, solo, and so does training."""
    key_file = tmp_path / "swarm.key"
    key_file.write_text(secrets.token_hex(32) + "\n")
    settings = {
        **BASE,
        "swarm.num_block_stages": "1",
        "sync.round_s": "4",
        "net.swarm_key_file": str(key_file),
    }
    s = LocalSwarm(tmp_path, settings)
    try:
        head = s.start_node(0)
        right = s.start_node(1)
        extra, env = wrong_clock(10)
        print("wrong clock:", "libfaketime" if env else "node.debug_clock_skew_s")
        wrong = s.start_node(1, extra=extra, env=env)
        for a in (head, right, wrong):
            wait_ready(a, 90, s)
        wait_for(
            lambda: all(sync_of(a)["outer_steps"] >= 8 for a in (right, wrong)),
            150,
            "8 outer rounds on each replica",
        )
        stats = {name: sync_of(a) for name, a in (("right", right), ("wrong", wrong))}
        print({n: (st["rounds"], st["clock_offset_s"]) for n, st in stats.items()})
        for name, st in stats.items():
            paired = st["rounds"].get("paired", 0)
            assert paired >= 0.7 * st["outer_steps"], (name, st["rounds"])
        assert stats["right"]["clock_offset_s"] == pytest.approx(5.0, abs=0.5)
        assert stats["wrong"]["clock_offset_s"] == pytest.approx(-5.0, abs=0.5)
        logs = "".join(p.read_text() for p in s.log_dir.glob("stage1-*.log"))
        assert "s ahead of stage 1's" in logs and "s behind stage 1's" in logs

        kill(s, wrong)
        rounds_then = sync_of(right)["outer_steps"]
        done_then = fetch_status(head)["counters"]["microbatches_completed"]
        wait_for(
            lambda: sync_of(right)["outer_steps"] >= rounds_then + 3,
            120,
            "outer rounds after the kill",
        )
        assert fetch_status(head)["counters"]["microbatches_completed"] >= done_then + 10
        assert sync_of(right)["rounds"].get("solo", 0) >= 1
    finally:
        s.stop(grace_s=5)


@pytest.mark.skipif(not LIBFAKETIME.exists(), reason="needs libfaketime (.ci/setup-extras.sh)")
def test_two_replicas_pair_again_soon_after_one_machines_clock_is_set_back(
    tmp_path: Path,
) -> None:
    """Two replicas of one block stage on 4 s rounds pair. Then one machine's wall clock is
    set back ten minutes (libfaketime reads the setting from a file; its monotonic clock
    goes on, as when a clock is set). Each replica moves halfway to the median of the two
    clocks, so the stage's clock reads five minutes back on both. Rounds only moved
    forward, so both waited those five minutes for their next outer step. Now they restart
    from the new reading after about 30 s (``CLOCK_BACK_WAIT_S``) and pair again."""
    setting = tmp_path / "faketime"
    setting.write_text("+0s\n")
    env = faketime_env(
        FAKETIME_TIMESTAMP_FILE=str(setting),
        FAKETIME_CACHE_DURATION="1",  # seconds between readings of the file
    )
    s = LocalSwarm(tmp_path, {**BASE, "swarm.num_block_stages": "1", "sync.round_s": "4"})
    try:
        head = s.start_node(0)
        right = s.start_node(1)
        wrong = s.start_node(1, env=env)
        replicas = (right, wrong)
        for a in (head, *replicas):
            wait_ready(a, 90, s)
        wait_for(
            lambda: all(sync_of(a)["rounds"].get("paired", 0) >= 3 for a in replicas),
            120,
            "3 paired rounds on each replica",
        )
        setting.write_text("-600s\n")
        set_at = time.monotonic()
        wait_for(
            lambda: all(sync_of(a)["clock_restarts"] >= 1 for a in replicas),
            120,
            "both replicas' rounds restarted",
        )
        paired = {a: sync_of(a)["rounds"].get("paired", 0) for a in replicas}
        wait_for(
            lambda: all(sync_of(a)["rounds"].get("paired", 0) >= paired[a] + 3 for a in replicas),
            60,
            "3 more paired rounds on each replica",
        )
        took_s = time.monotonic() - set_at
        stats = {a: sync_of(a) for a in replicas}
        print(f"paired again {took_s:.0f} s after the clock was set back:", stats)
        assert stats[right]["clock_offset_s"] == pytest.approx(-300.0, abs=2.0)
        assert stats[wrong]["clock_offset_s"] == pytest.approx(300.0, abs=2.0)
        assert took_s < 150  # the old wait was 300 s
        logs = "".join(p.read_text() for p in s.log_dir.glob("stage1-*.log"))
        assert "outer rounds restart from it" in logs
    finally:
        s.stop(grace_s=5)
