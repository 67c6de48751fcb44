"""The compute thread's operator profile (``node.stage.opprofile``): the summary's arithmetic on
hand-made rows, and real torch work on a worker thread, as the daemon's compute thread does."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from node.stage.adam import Adam
from node.stage.opprofile import OpProfile, ProfileError, check_seconds, summarise, thread_sched


def test_summary_splits_cpu_by_phase_and_scales_out_the_wait_for_a_core() -> None:
    rows = [  # (operator, calls, self seconds, inclusive seconds), by the wall clock
        ("aten::add_", 4, 0.04, 0.04),
        ("aten::mm", 20, 0.50, 0.50),
        ("autograd::engine::evaluate_function: MmBackward0", 10, 0.02, 0.32),
        ("MmBackward0", 10, 0.01, 0.30),
        ("Optimizer.step#Adam.step", 1, 0.01, 0.05),
    ]
    # 0.8 s on a core and 0.2 s waiting for one: every wall time counts 0.8 of itself
    s = summarise(rows, wall_s=2.0, cpu_s=0.8, wait_s=0.2)
    assert s["operators_cpu_s"] == pytest.approx(0.8 * 0.58)  # the self times' sum
    assert s["phases_cpu_s"] == pytest.approx(
        {
            "backward": 0.8 * 0.32,
            "optimizer": 0.8 * 0.05,
            "other operators": 0.8 * (0.58 - 0.32 - 0.05),
            "outside operators": 0.8 - 0.8 * 0.58,
        }
    )
    assert sum(s["phases_cpu_s"].values()) == pytest.approx(0.8)
    assert [op["op"] for op in s["ops"]][:2] == ["aten::mm", "aten::add_"]
    assert s["ops"][0] == {"op": "aten::mm", "calls": 20, "self_cpu_s": 0.4, "cpu_s": 0.4}
    assert (s["wall_s"], s["thread_cpu_s"], s["runqueue_wait_s"]) == (2.0, 0.8, 0.2)


def test_without_a_wait_the_times_are_taken_as_measured() -> None:
    s = summarise([("aten::mm", 1, 0.3, 0.3)], wall_s=1.0, cpu_s=0.5)
    assert s["phases_cpu_s"]["other operators"] == pytest.approx(0.3)
    assert s["phases_cpu_s"]["outside operators"] == pytest.approx(0.2)


def test_operators_never_take_more_than_the_threads_cpu() -> None:
    # a loaded machine: 0.6 s of operators by the wall clock, 0.4 s on a core and no wait
    # recorded; the phases still add up to the thread's CPU, operators all of it
    s = summarise([("aten::mm", 2, 0.45, 0.45), ("aten::add_", 2, 0.15, 0.15)], 1.0, 0.4)
    assert s["operators_cpu_s"] == pytest.approx(0.4)
    assert s["phases_cpu_s"] == pytest.approx(
        {"backward": 0.0, "optimizer": 0.0, "other operators": 0.4, "outside operators": 0.0}
    )
    assert s["ops"][0]["self_cpu_s"] == pytest.approx(0.3)


def _train_steps(model: torch.nn.Module, opt: Adam, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(8, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_a_profile_records_its_own_thread_only() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32, bias=False), torch.nn.ReLU())
    opt = Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    a = torch.randn(64, 64)
    prof = OpProfile()
    with ThreadPoolExecutor(1) as compute:  # start and stop are separate jobs on one thread
        compute.submit(prof.start).result()
        assert prof.running
        compute.submit(_train_steps, model, opt, 3).result()
        for _ in range(5):  # another thread's work is not this thread's profile
            torch.mm(a, a)
        s = compute.submit(prof.stop).result()
    assert not prof.running
    ops = {op["op"]: op for op in s["ops"]}
    assert ops["aten::mm"]["calls"] == 3 * 2  # a step: the forward and the weight gradient
    assert ops["Optimizer.step#Adam.step"]["calls"] == 3
    phases = s["phases_cpu_s"]
    assert phases["backward"] > 0 and phases["optimizer"] > 0 and phases["other operators"] > 0
    assert sum(phases.values()) == pytest.approx(s["thread_cpu_s"])
    assert s["thread_cpu_s"] > 0 and s["wall_s"] > 0


def test_one_profile_at_a_time_and_none_to_stop() -> None:
    prof = OpProfile()
    with pytest.raises(ProfileError, match="no profile"):
        prof.stop()
    prof.start()
    try:
        with pytest.raises(ProfileError, match="already running"):
            prof.start()
    finally:
        prof.stop()


@pytest.mark.parametrize("seconds", [0.0, -1.0, math.nan, math.inf, 300.5])
def test_profile_length_is_checked(seconds: float) -> None:
    with pytest.raises(ValueError, match="seconds must be in"):
        check_seconds(seconds)


def test_thread_sched_counts_this_threads_cpu() -> None:
    cpu0, wait0 = thread_sched()
    x = 0
    for i in range(300_000):
        x += i
    cpu1, wait1 = thread_sched()
    assert cpu1 > cpu0 and wait1 >= wait0 >= 0
