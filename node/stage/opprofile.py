"""Where a node's compute thread spends its CPU, by torch operator (``POST /profile``).

torch's profiler records the operators of the thread that started it and of no other, so
``OpProfile.start`` and ``OpProfile.stop`` each run as a job on the compute thread
(``StageRunner.run``): the window holds exactly the stage's own work, with the backward
passes the autograd engine runs on that thread. The event loop stays out of it.

The summary splits the thread's CPU four ways: time inside torch operators by phase (the
autograd engine's backward functions; the optimizer's step and zero_grad; the rest: forward
passes, codecs, clipping, weight stashing), then time outside any operator (Python: building
messages, the codec's bookkeeping, and the profiler's own recording). Each operator's self
time and call count come with it, most expensive first.

The profiler times operators by the wall clock, which also runs while the thread is runnable
but waiting for a core (several nodes on few cores). The kernel counts that wait
(``/proc/.../schedstat``), so every time in the summary is scaled by the thread's CPU over
its runnable time: CPU seconds, as if the waits were spread evenly over the work.

The profiler costs time per operator (the tiny model trains at about 0.7 of its speed while
it records), so compare profiles with each other, not with unprofiled throughput.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.profiler import ProfilerActivity, profile

if TYPE_CHECKING:
    from node.stage.runner import StageRunner

BACKWARD_PREFIX = "autograd::engine::evaluate_function:"
OPTIMIZER_PREFIX = "Optimizer."
DEFAULT_SECONDS = 10.0
MAX_SECONDS = 300.0


class ProfileError(RuntimeError):
    """A profile that cannot start or finish (one is already running, none is)."""


class OpProfile:
    """One profiling window at a time on the thread that calls ``start`` and ``stop``."""

    def __init__(self) -> None:
        self._prof: Any = None
        self._t0 = 0.0
        self._sched0 = (0.0, 0.0)

    @property
    def running(self) -> bool:
        return self._prof is not None

    def start(self) -> None:
        """Begin recording this thread's operators."""
        if self._prof is not None:
            raise ProfileError("a profile is already running on this thread")
        prof = profile(activities=[ProfilerActivity.CPU])
        prof.start()
        self._prof = prof
        self._t0, self._sched0 = time.monotonic(), thread_sched()

    def stop(self) -> dict[str, Any]:
        """End the window begun by ``start`` (on the same thread) and summarise it."""
        if self._prof is None:
            raise ProfileError("no profile is running")
        wall = time.monotonic() - self._t0
        cpu1, wait1 = thread_sched()
        cpu, wait = cpu1 - self._sched0[0], wait1 - self._sched0[1]
        prof, self._prof = self._prof, None
        prof.stop()
        ops = [
            (e.key, int(e.count), e.self_cpu_time_total / 1e6, e.cpu_time_total / 1e6)
            for e in prof.key_averages()
        ]
        return summarise(ops, wall, cpu, wait)


def thread_sched() -> tuple[float, float]:
    """This thread's CPU seconds and seconds spent runnable but waiting for a core.

    From ``/proc/self/task/TID/schedstat`` (Linux); elsewhere its CPU time and no wait."""
    try:
        path = Path(f"/proc/self/task/{threading.get_native_id()}/schedstat")
        on_cpu_ns, waiting_ns, _ = path.read_text().split()
    except (OSError, ValueError):
        return time.thread_time(), 0.0
    return int(on_cpu_ns) / 1e9, int(waiting_ns) / 1e9


def summarise(
    ops: list[tuple[str, int, float, float]], wall_s: float, cpu_s: float, wait_s: float = 0.0
) -> dict[str, Any]:
    """The window's summary from ``(operator, calls, self seconds, inclusive seconds)`` rows
    timed by the wall clock, the thread's CPU seconds and its seconds waiting for a core.

    Backward and optimizer time are their annotations' inclusive time (the autograd engine
    runs one backward function at a time, so they do not nest); the rest of the operators'
    self time is ``other operators``; the thread's remaining CPU is ``outside operators``.
    Operator times are scaled to CPU by ``cpu / (cpu + wait)``, and further where they would
    still add up to more than the thread's CPU (on a loaded machine the wall-clock operator
    times also hold preemptions that the scheduler's wait figure does not cover): operators
    cannot have taken more of the thread's CPU than it had, and the phases add up to it.
    """
    scale = cpu_s / (cpu_s + wait_s) if cpu_s > 0 else 1.0
    timed = sum(row[2] for row in ops)
    if cpu_s > 0 and scale * timed > cpu_s:
        scale = cpu_s / timed
    in_ops = scale * timed
    backward = scale * sum(row[3] for row in ops if row[0].startswith(BACKWARD_PREFIX))
    optimizer = scale * sum(row[3] for row in ops if row[0].startswith(OPTIMIZER_PREFIX))
    return {
        "wall_s": wall_s,
        "thread_cpu_s": cpu_s,
        "runqueue_wait_s": wait_s,
        "operators_cpu_s": in_ops,
        "phases_cpu_s": {
            "backward": backward,
            "optimizer": optimizer,
            "other operators": max(0.0, in_ops - backward - optimizer),
            "outside operators": max(0.0, cpu_s - in_ops),
        },
        "ops": [
            {"op": name, "calls": calls, "self_cpu_s": scale * self_s, "cpu_s": scale * total_s}
            for name, calls, self_s, total_s in sorted(ops, key=lambda r: -r[2])
        ],
    }


def check_seconds(seconds: float) -> float:
    """A profile's length, refused outside (0, MAX_SECONDS]."""
    if not 0.0 < seconds <= MAX_SECONDS:
        raise ValueError(f"seconds must be in (0, {MAX_SECONDS:.0f}], got {seconds}")
    return seconds


async def profile_compute(runner: StageRunner, seconds: float) -> dict[str, Any]:
    """Profile ``runner``'s compute thread for ``seconds`` of its work; the samples it
    finished in the window come with the summary. Raises RuntimeError if the runner closes
    meanwhile (its node moved to another stage)."""
    prof = OpProfile()
    samples0 = runner.samples
    await runner.compute(prof.start)
    try:
        await asyncio.sleep(seconds)
    finally:  # also when cancelled: the profiler must not outlive the request
        summary = await asyncio.shield(runner.compute(prof.stop))
    summary["samples"] = runner.samples - samples0
    return summary
