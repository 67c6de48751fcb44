"""When a stage's replicas take their outer steps: rounds on a shared wall-clock grid.

NoLoCo (arXiv 2506.10911) and DiLoCo (arXiv 2311.08105) take an outer step every ``H``
inner steps, and their reference code pairs replicas that reach that count together. On
volunteers' machines replicas never run at the same speed: keyed by step counts, a replica
that reaches its boundary well before its partner gives up, steps alone, and the next round
repeats the pattern, so a stage of unequal replicas ends every round solo and its replicas
drift apart for good. Here a round is a point in wall-clock time instead, the same for every
replica of the stage: round boundaries are the multiples of a period ``P`` since the Unix
epoch, and a round is named by its boundary in milliseconds. Every replica reaches boundary
``k * P`` at the same moment (up to clock skew, which the gossip protocol's hold time
absorbs), whatever its speed, so replicas pair; a faster replica simply takes more inner
steps between two boundaries.

Why it is still NoLoCo's rule: the outer step is applied exactly as published, to what each
member has at the boundary: its slow weights ``phi`` and its pseudo-gradient ``theta - phi``
(``swarm.outer``). The rule never assumed the members' ``theta - phi`` covered the same
number of inner steps; it averages two displacements and pulls the slow weights together.
What changes is only *when* a round happens: after the same time for everyone rather than
the same count for everyone. A faster replica's pseudo-gradient then covers more data,
which is how hivemind's collaborative optimizer ends an epoch too (a global sample target,
not per-peer steps). With equal replicas the two schedules coincide: ``P`` is ``H`` steps.

``P`` is either set (``sync.round_s``) or derived: ``H`` times the median of the stage's
published seconds per inner step, rounded up to a power of two seconds (at least ``MIN_PERIOD_S``). Powers of two make
the grids of two replicas that briefly disagree about ``P`` nest (every boundary of the
coarser grid is one of the finer), so they still meet; hysteresis keeps ``P`` from
flip-flopping when the median sits near a power of two.

Pure policy: numbers in, numbers out; the caller passes ``now``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

MIN_PERIOD_S = 4.0
"""Shortest derived period. A round holds a replica's optimizer for its matchmaking and
exchange (a second or so on a LAN), and a replica still in one round when the next boundary
passes misses that boundary, leaving a partner alone: rounds must be several times longer."""
GROW = 1.25
"""Take a longer period only when ``H`` steps take this much more than the current one."""
SHRINK = 0.375
"""Take a shorter period only when ``H`` steps take less than this fraction of it."""


def power_of_two_at_least(seconds: float) -> float:
    """The smallest ``2 ** k`` (integer k, at least ``MIN_PERIOD_S``) not below ``seconds``."""
    return max(MIN_PERIOD_S, 2.0 ** math.ceil(math.log2(max(seconds, 1e-9))))


def round_period(
    step_times_s: Iterable[float], outer_steps: int, current_s: float | None = None
) -> float | None:
    """The derived round period for a stage whose replicas publish ``step_times_s`` (seconds
    per inner step; non-positive ones are not measured yet), or None while none is.

    ``current_s``: the period in use, kept while ``H`` median steps stay within
    ``[SHRINK, GROW]`` of it."""
    measured = [s for s in step_times_s if s > 0 and math.isfinite(s)]
    if not measured:
        return current_s
    want_s = outer_steps * statistics.median(measured)
    if current_s is not None and SHRINK * current_s <= want_s <= GROW * current_s:
        return current_s
    return power_of_two_at_least(want_s)


def next_boundary(now_s: float, period_s: float, after_ms: int = -1) -> int:
    """The next round boundary (milliseconds since the epoch) at or after ``now_s`` on the
    grid of ``period_s``, and later than ``after_ms`` (the last round taken: rounds only move
    forward, also when the period changes)."""
    period_ms = round(period_s * 1000)
    k = math.ceil(now_s * 1000 / period_ms)
    boundary = k * period_ms
    if boundary <= after_ms:
        boundary = (after_ms // period_ms + 1) * period_ms
    return boundary
