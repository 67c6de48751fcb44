"""The head's in-flight window (``swarm.window``) on a simulated link, its rule by hand, and
a real head growing it on a long pipe.

The link: every microbatch travels ``delay_s`` to the pipeline's slowest stage, waits its
turn there (first come, first served), is served in ``service_s``, and travels ``delay_s``
back. Its best window is the bandwidth-delay product plus a little queue: about
``(2 delay + service) / service`` microbatches keep the slow stage busy.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from pathlib import Path

import pytest

from node.client import fetch_status
from node.demo import LocalSwarm, wait_ready
from node.display import format_status
from swarm.window import InFlightWindow, WindowConfig
from tests.helpers import FAST_SWARM, wait_for


def simulate(
    window: InFlightWindow,
    delay_s: float,
    service_s: Callable[[float], float],
    until_s: float,
    start_s: float = 0.0,
) -> tuple[float, int]:
    """Run the head's loop on the link from ``start_s`` to ``until_s``; returns the
    completions per second over the second half and the most ever in flight."""
    now, free_at, in_flight, most = start_s, start_s, 0, 0
    back: list[tuple[float, float]] = []  # (completion time, issue time)
    done_late = 0
    while now < until_s:
        while in_flight < window.limit(now):
            arrival = now + delay_s
            start = max(arrival, free_at)
            free_at = start + service_s(start)
            heapq.heappush(back, (free_at + delay_s, now))
            in_flight += 1
            most = max(most, in_flight)
        now, issued = heapq.heappop(back)
        in_flight -= 1
        window.completed(now - issued, issued, now)
        if now >= (start_s + until_s) / 2:
            done_late += 1
    return done_late / ((until_s - start_s) / 2), most


def fresh(**overrides: float) -> InFlightWindow:
    return InFlightWindow(WindowConfig(**overrides), now=0.0)  # type: ignore[arg-type]


def test_on_a_long_pipe_it_grows_until_the_slow_stage_is_busy() -> None:
    w = fresh()
    rate, _ = simulate(w, delay_s=0.1, service_s=lambda t: 0.01, until_s=60.0)
    bdp = (2 * 0.1 + 0.01) / 0.01  # 21 microbatches
    assert bdp <= w.size <= bdp + 5, w.status()
    assert rate >= 0.95 * 100  # the slow stage's 100 microbatches/s
    assert w.base_rtt_s == pytest.approx(0.21, rel=0.05)


def test_on_a_short_pipe_it_stays_small() -> None:
    w = fresh()
    rate, _ = simulate(w, delay_s=0.0005, service_s=lambda t: 0.01, until_s=60.0)
    assert w.size <= 5, w.status()  # 1 keeps the stage busy; the rest would only queue
    assert rate >= 0.95 * 100


def test_under_queueing_it_shrinks() -> None:
    w = fresh()
    slow_after = 30.0  # the slow stage gets 3x slower (a slower replica, a busy machine)
    simulate(w, 0.1, lambda t: 0.01, until_s=slow_after)
    before = w.size
    rate, _ = simulate(
        w, 0.1, lambda t: 0.03 if t >= slow_after else 0.01, until_s=90.0, start_s=slow_after
    )
    bdp = (2 * 0.1 + 0.03) / 0.03  # 7.7
    assert before >= 20 and w.size <= bdp + 5, (before, w.status())
    assert rate >= 0.95 / 0.03
    assert w.history[-1][1] == w.size and min(s for _, s in w.history) >= 2


def test_it_never_exceeds_its_memory_bound() -> None:
    w = fresh(max_size=12)
    rate, most = simulate(w, delay_s=1.0, service_s=lambda t: 0.001, until_s=120.0)
    assert w.size == 12 and most <= 12
    # window-bound: 12 per 2 s round trip, less the probes (every 30 s the window drains to
    # 2 for about a round trip to measure the base again: here 5 % of the time)
    assert 0.9 * 12 / 2.001 <= rate <= 12 / 2.001


def test_the_vegas_rule_by_hand() -> None:
    """Window 4, base round trip 100 ms: the decision comes after 4 completions."""
    w = fresh(initial=4, probe_every_s=1e9)
    for k in range(4):  # mean 125 ms: 4 x (1 - 100/125) = 0.8 queued < alpha = 1: grow
        w.completed([0.1, 0.15, 0.1, 0.15][k], issued_s=0.0, now=1.0)
    assert (w.size, w.rtt_s, round(w.queued, 6)) == (5, 0.125, 0.8)
    for _ in range(5):  # mean 250 ms: 5 x (1 - 100/250) = 3 queued, within [1, 3]: hold
        w.completed(0.25, issued_s=0.0, now=2.0)
    assert (w.size, round(w.queued, 6)) == (5, 3.0)
    for _ in range(5):  # 500 ms: 5 x 0.8 = 4 queued > beta = 3: shrink
        w.completed(0.5, issued_s=0.0, now=3.0)
    assert w.size == 4
    w.failed(now=4.0)  # x 0.75
    assert w.size == 3
    w.failed(now=5.0)
    assert w.size == 2  # floor(2.25), and never below min_size
    w.failed(now=6.0)
    assert w.size == 2
    assert [s for _, s in w.history] == [4, 5, 4, 3, 2]


def test_a_probe_drains_the_pipe_and_measures_the_base_again() -> None:
    w = fresh(initial=6, probe_every_s=10.0)
    w.completed(0.1, issued_s=0.0, now=0.1)
    assert w.limit(5.0) == 6 and not w.probing
    assert w.limit(10.0) == 2 and w.probing  # drained to min_size
    w.completed(0.4, issued_s=9.0, now=10.2)  # issued before the probe: does not count
    assert w.probing and w.base_rtt_s == 0.1
    w.completed(0.3, issued_s=10.5, now=10.8)  # issued into the drained pipe: the new base
    assert not w.probing and w.base_rtt_s == 0.3 and w.limit(11.0) == 6
    assert w.limit(20.0) == 6 and w.limit(20.8) == 2  # the next probe, 10 s later


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="window sizes"):
        fresh(min_size=4, initial=2)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_head_grows_its_window_on_a_long_pipe(tmp_path: Path) -> None:
    """Real processes, 50 ms added to every message: a round trip is four messages (200 ms)
    and the compute of small microbatches (4 x 64 tokens, a few ms a stage), so the pipe holds
    many and the adaptive window grows past its start (4). (With the default 16 x 128 the
    block stage's compute is the bottleneck on two shared cores and 4 is already enough:
    the window rightly stays there.)"""
    s = LocalSwarm(
        tmp_path,
        {
            **FAST_SWARM,
            "swarm.num_block_stages": "1",
            "balance.benchmark_s": "0",
            "net.inject_latency_s": "0.05",
            "train.window": "adaptive",
            "train.max_in_flight": "16",
            "train.hop_timeout_s": "10",
            "train.microbatch_deadline_s": "30",
            "data.batch_size": "4",
            "data.seq_len": "64",
            "train.step_samples": "16",
        },
    )
    try:
        head = s.start_node(0)
        wait_ready(head, 90, s)
        s.start_node(1)
        st = wait_for(
            lambda: (x := fetch_status(head))["window"]["size"] >= 6 and x, 150, "a wider window"
        )
        window = st["window"]
        assert window["policy"] == "adaptive" and window["base_rtt_ms"] >= 200
        assert st["in_flight"] <= 16
        assert [size for _, size in window["history"]][0] == 4
        assert "adaptive window of" in format_status(st)
    finally:
        s.stop(grace_s=5)
