"""When a stage's replicas take their outer steps: rounds on a shared wall-clock grid.

NoLoCo (arXiv 2506.10911) and DiLoCo (arXiv 2311.08105) take an outer step every ``H``
inner steps, and their reference code pairs replicas that reach that count together. On
volunteers' machines replicas never run at the same speed: keyed by step counts, a replica
that reaches its boundary well before its partner gives up, steps alone, and the next round
repeats the pattern, so a stage of unequal replicas ends every round solo and its replicas
drift apart for good. Here a round is a point in wall-clock time instead, the same for every
replica of the stage: round boundaries are the multiples of a period ``P`` since the Unix
epoch, and a round is named by its boundary in milliseconds. Every replica reaches boundary
``k * P`` at the same moment, whatever its speed, so replicas pair; a faster replica simply
takes more inner steps between two boundaries.

"The same moment" needs clocks that agree, and volunteers' clocks need not: a machine whose
clock is a few seconds off (more than the gossip protocol's hold time) would reach every
boundary alone, its requests held in vain or answered ``stale``, and step solo for good,
as unequal replicas did on the step schedule. So the grid is laid on the *stage's clock*
(``ClockOffsets``): each replica measures the others' clocks on the membership pings it
sends anyway (NTP's on-wire estimate) and reads the median of its stage's clocks, its own
included. Replicas that have measured one another read the same median, so they agree
without electing a timekeeper, and one wrong clock among three or more moves only itself.

Why it is still NoLoCo's rule: the outer step is applied exactly as published, to what each
member has at the boundary: its slow weights ``phi`` and its pseudo-gradient ``theta - phi``
(``swarm.outer``). The rule never assumed the members' ``theta - phi`` covered the same
number of inner steps; it averages two displacements and pulls the slow weights together.
What changes is only *when* a round happens: after the same time for everyone rather than
the same count for everyone. A faster replica's pseudo-gradient then covers more data,
which is how hivemind's collaborative optimizer ends an epoch too (a global sample target,
not per-peer steps). With equal replicas the two schedules coincide: ``P`` is ``H`` steps.

``P`` is either set (``sync.round_s``) or derived: ``H`` times the median of the stage's
published seconds per inner step, rounded up to a power of two seconds (at least
``MIN_PERIOD_S``). Powers of two make the grids of two replicas that briefly disagree about
``P`` nest (every boundary of the coarser grid is one of the finer), so they still meet;
hysteresis keeps ``P`` from flip-flopping when the median sits near a power of two, and
each replica publishes the ``P`` it uses so that hysteresis cannot leave the replicas on
two periods for good: of the periods in use, the shortest that fits is taken. A
replica's seconds per inner step is its ``Pace``: wall-clock time over steps in the last
two rounds, the time its rounds spent matchmaking and exchanging included, so the period
over the stage's median pace is the steps a replica of the stage usually takes in a round.

Pure policy: numbers in, numbers out; the caller passes ``now``.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
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
    step_times_s: Iterable[float],
    outer_steps: int,
    current_s: float | None = None,
    partners_s: Iterable[float] = (),
) -> float | None:
    """The derived round period for a stage whose replicas publish ``step_times_s`` (seconds
    per inner step; non-positive ones are not measured yet), or None while none is.

    ``current_s``: the period in use; ``partners_s``: the periods the stage's other replicas
    publish (0: none yet). Of these, the shortest whose hysteresis band ``[SHRINK, GROW]``
    holds ``H`` median steps is kept; when none does, the power of two just above them is
    taken. Hysteresis alone is a replica's own memory: with ``H`` median steps between
    ``SHRINK`` times one power of two and ``GROW`` times the half of it (3 s to 5 s for 4 s
    and 8 s), both periods are stable, and a replica that saw one slow step moved to 8 s
    while its partners stayed on 4 s, for a whole run (the NoLoCo pull-term process test:
    one replica took half the rounds of the others, and the test 307 s instead of 200 s).
    Choosing among the periods in use makes the choice a function of what every replica
    reads alike, so they agree after one publication. Any fixed preference would do; the
    shortest keeps the most rounds, and the grids nest, so replicas still on the coarser
    grid meet the others at each of its boundaries meanwhile. Published periods that no
    derived schedule could take (not a power of two of at least ``MIN_PERIOD_S``) are
    ignored: a peer cannot pull a stage onto a grid that is not one of these."""
    measured = [s for s in step_times_s if s > 0 and math.isfinite(s)]
    if not measured:
        return current_s
    want_s = outer_steps * statistics.median(measured)
    in_use = {p for p in partners_s if _derivable(p)}
    if current_s is not None:
        in_use.add(current_s)
    for period_s in sorted(in_use):
        if SHRINK * period_s <= want_s <= GROW * period_s:
            return period_s
    return power_of_two_at_least(want_s)


ROUND_ROOM = 1.5
"""A replica whose exchange outlasts the rounds it spans takes enough rounds to hold this many
times its exchange: room for a partner's proposal to find it, the exchange, and the outer
step before the next boundary."""
ROUND_ROOM_DOWN = 1.2
"""It takes fewer rounds again where they hold this many times its exchange. With 1.5 here
too, a thin replica whose measured exchange (21 to 24 s) fit a 30 s round stayed on every
2nd: live, in two sittings with two fat partners, it ended 1.94 and 1.97 times as far
from the replicas' mean as they did, against 1.64 and 1.44 where it took every round, and
the replicas' mean distance rose 13 and 23 % (``bench/README.md``). With 1.2, in a third
sitting, it went back to every round once a partner's time came in, and ended 1.48 times
as far as they did, against 1.88 on the commit before."""
MAX_ROUND_MULTIPLE = 8
"""The most of the stage's rounds one round of a replica with a thin uplink spans: beyond
it the replica's contribution is too stale to be worth the wait, and it says so instead."""


def round_multiple(exchange_s: float | None, period_s: float | None, current: int = 1) -> int:
    """How many of the stage's rounds (``period_s`` each) one NoLoCo round of a replica whose
    exchange takes ``exchange_s`` spans (``current``: as many as it spans now).

    An exchange is the replica's upload, then its partner's. Where it outlasts the round
    the replica takes, the replica reaches its next boundary late: its partners' proposals
    there meet ``not_ready`` or ``stale`` and its rounds end solo (behind a 2 Mbit/s
    uplink with 30 s rounds, 2 of 6 paired, live). Taking every ``m``-th of the stage's
    rounds instead, ``m`` the least power of two whose span holds ``ROUND_ROOM`` times the
    exchange (at most ``MAX_ROUND_MULTIPLE``), it meets its partners at each boundary it
    takes: the grids nest, as the periods of ``round_period`` do. It goes up at most
    twice as many at a time: a first estimate (no partner has announced its upload yet, so
    the partner's half is taken as long as its own) and an early rate read low parked a
    replica on every 8th round for four minutes, live, where 2 would have carried its
    exchange. Back to fewer only where they hold ``ROUND_ROOM_DOWN`` times it, so an
    exchange near the edge does not flip the span each round: from ``m`` it goes up past
    ``m`` rounds and down below ``m / 2 / ROUND_ROOM_DOWN`` of them. Unknown figures keep
    ``current``.

    Still NoLoCo's rule: in the rounds it takes the replica pairs and steps as published,
    its pseudo-gradient covering ``m`` rounds of inner steps (scaled to the stage's usual
    steps in that span, ``swarm.outer.scale_by_steps``); its partners pair among
    themselves in the rounds it skips. What it costs is that replica's pull toward the
    others, ``m`` times rarer, which a solo round does not give at all."""
    if not exchange_s or not period_s or exchange_s <= 0 or period_s <= 0:
        return current

    def holding(room: float) -> int:
        """The least power of two whose span holds ``room`` times the exchange."""
        need = room * exchange_s / period_s
        return min(MAX_ROUND_MULTIPLE, 1 << max(0, math.ceil(math.log2(need))))

    if exchange_s > current * period_s:
        return min(max(current, holding(ROUND_ROOM)), 2 * current)
    return min(current, holding(ROUND_ROOM_DOWN))


def _derivable(period_s: float) -> bool:
    """Whether ``period_s`` is one a derived schedule takes (``power_of_two_at_least``
    gives it back). A long one is harmless: it is taken only where its band holds the
    stage's own ``H`` median steps."""
    return math.isfinite(period_s) and period_s > 0 and power_of_two_at_least(period_s) == period_s


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


def round_share(began_ms: int | None, boundary_ms: int, period_ms: int) -> float:
    """The part of the round ending at ``boundary_ms`` that a replica trained in: from
    ``began_ms`` (the boundary of its last outer step, or its first inner step) to
    the boundary, over the period; at most 1, and 1 when either is unknown.

    A replica that begins training partway through a round takes that round's outer step
    after only part of a round's inner steps, though it runs at the stage's usual pace.
    ``swarm.outer.scale_by_steps`` compares its steps with the stage's usual steps per
    round; over the whole round it would read the replica as slow and enlarge its
    pseudo-gradient up to 4x, an extrapolation that early in training threw the loss above
    its starting value (CI: eval loss 5.13, then 6.47 after the first solo step). Over the
    part it trained in, the usual number is this share of a round's."""
    if began_ms is None or period_ms <= 0:
        return 1.0
    return min(1.0, max(0.0, (boundary_ms - began_ms) / period_ms))


PACE_ROUNDS = 2
"""A replica's pace is measured over this many rounds' time."""
PACE_WINDOW_S = 120.0
"""The pace's window while the round period is not known (or on the steps schedule)."""


class Pace:
    """A replica's pace: wall-clock seconds per inner step over its last ``window_s``.

    Owns the times of the replica's inner steps in the window, and one before it (the
    anchor the window is measured from). ``seconds_per_step`` is the time from the anchor to
    the latest step over the steps taken after the anchor, in units of ``step_samples``
    samples (a ``2bw`` step counts ``k``). Does not own the window's length: the caller
    sets ``window_s`` (``PACE_ROUNDS`` round periods, once the period is known).

    Why a window of wall-clock time, not a moving average of single steps: the stage's usual
    steps per round, which NoLoCo on the clock compares a replica's steps with
    (``swarm.outer.scale_by_steps``), is the period over the median pace. An average of the
    last few step times left out the time a round spends matchmaking and exchanging (the
    optimizer is held meanwhile), so equal replicas took fewer steps than their "usual" and
    had their displacements enlarged by ``P / (P - exchange)``; and one long step (an eval on
    the head, a loaded machine) just before a boundary moved it several-fold (73 steps taken
    against a usual 40). Steps counted over two rounds' time are what a replica of that
    pace takes in a round, exchanges, stalls and all, and a stall moves them by its share of
    the window only.

    A gap longer than the whole window (no step at all) is not a pace: the replica had no
    work (its pipeline broken, a stage move). The window restarts at the next step and the
    last estimate stands until a second step measures again.
    """

    def __init__(self, window_s: float = PACE_WINDOW_S) -> None:
        self.window_s = window_s
        self.seconds_per_step = 0.0
        """Wall-clock seconds per unit of inner steps over the window; 0 until measured."""
        self._steps: deque[tuple[float, int]] = deque()
        """(when, units) of each step in the window, oldest first; the first is the anchor."""
        self._units = 0
        """Units of the steps after the anchor."""

    def step(self, now: float, units: int = 1) -> float:
        """Record an inner step of ``units`` at ``now`` (monotonic seconds); the new pace."""
        if self._steps and now - self._steps[-1][0] > self.window_s:
            self._steps.clear()
            self._units = 0
        if self._steps:
            self._units += units
        self._steps.append((now, units))
        while len(self._steps) >= 2 and self._steps[1][0] <= now - self.window_s:
            self._steps.popleft()
            self._units -= self._steps[0][1]  # the new anchor's units are before the window
        if self._units > 0:
            self.seconds_per_step = (now - self._steps[0][0]) / self._units
        return self.seconds_per_step


CLOCK_SAMPLES = 8
"""Offset samples kept per peer; the one with the shortest round trip is used."""
CLOCK_SAMPLE_TTL_S = 600.0
"""A sample older than this is dropped (clocks drift, and a peer's clock may be reset)."""
CLOCK_STEP_S = 1.0
"""A change of this machine's wall clock against its monotonic clock by more than this
between two samples means the wall clock was set (by NTP, or by hand): every sample taken
before is dropped, as it measured the old setting."""


def _least_delayed(samples: Iterable[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Of a peer's samples (when taken, round trip, offset), the one with the shortest round
    trip: NTP's clock filter."""
    return min(samples, key=lambda s: s[1])


def _disagrees(best: tuple[float, float, float], rtt: float, offset: float) -> bool:
    """Whether a new sample (round trip ``rtt``, ``offset``) cannot measure the same clock
    setting as a peer's ``best`` sample: each puts the offset within half its round trip of
    its estimate, so two samples of one setting differ by at most half the sum of the round
    trips; more than that plus ``CLOCK_STEP_S`` means the peer's clock was set between them."""
    _, best_rtt, best_offset = best
    return abs(offset - best_offset) > (rtt + best_rtt) / 2 + CLOCK_STEP_S


class ClockOffsets:
    """How far other machines' wall clocks are from this one's, and the stage's clock.

    Owns each peer's last ``CLOCK_SAMPLES`` offset samples. A sample comes from one request
    and its reply: sent at ``t0`` and answered at ``t3`` by this clock, stamped ``t1`` by the
    peer's, the peer's clock is ahead of this one by ``t1 - (t0 + t3) / 2``, give or take
    half the round trip (NTP's on-wire estimate, RFC 5905); of a peer's samples the one with
    the shortest round trip counts (NTP's clock filter: the least delayed is the least
    wrong). A new sample that cannot measure the same setting of the peer's clock as that
    one (``_disagrees``) means the peer's clock was set: its older samples are dropped, so
    the estimate moves at once rather than between the old and the new setting for up to
    ``CLOCK_SAMPLES`` pings. Does not own the requests (``swarm.membership`` feeds it from
    its pings) nor which peers form the stage (the caller names them).

    ``stage_offset_s``: the median of the offsets of the named peers and of this machine
    (0). A replica that has measured the others reads the median of the same set of clocks
    as they do (the set, seen from another member, is shifted by that member's own offset),
    so all agree on one clock, up to the samples' error; a lone wrong clock among three or
    more replicas moves only itself, and of two replicas each moves halfway.
    """

    def __init__(self) -> None:
        self._samples: dict[str, deque[tuple[float, float, float]]] = {}
        """peer id -> (when taken, monotonic; round trip; offset), oldest first."""
        self._base: float | None = None
        """This machine's wall clock minus its monotonic clock at the last sample."""
        self.steps = 0
        """Times this machine's wall clock was seen set (every sample dropped)."""
        self.peer_steps = 0
        """Times a peer's clock was seen set (that peer's samples dropped)."""

    def observe(
        self, peer_id: str, sent_s: float, peer_s: float, received_s: float, now: float
    ) -> None:
        """A reply stamped ``peer_s`` by ``peer_id``'s wall clock to a request sent at
        ``sent_s`` and answered at ``received_s`` by this one's; ``now``: monotonic."""
        rtt = received_s - sent_s
        if not (math.isfinite(peer_s) and rtt >= 0):
            return  # this machine's clock was set meanwhile: the sample means nothing
        base = received_s - now
        if self._base is not None and abs(base - self._base) > CLOCK_STEP_S:
            self._samples.clear()  # our clock was set since: the old samples measured it
            self.steps += 1
        self._base = base
        offset = peer_s - (sent_s + received_s) / 2
        samples = self._samples.setdefault(peer_id, deque(maxlen=CLOCK_SAMPLES))
        if samples and _disagrees(_least_delayed(samples), rtt, offset):
            samples.clear()  # the peer's clock was set since: its old samples measured it
            self.peer_steps += 1
        samples.append((now, rtt, offset))

    def offset_s(self, peer_id: str, now: float) -> float | None:
        """How far ``peer_id``'s clock is ahead of this one (negative: behind), or None
        without a sample younger than ``CLOCK_SAMPLE_TTL_S``."""
        samples = self._samples.get(peer_id)
        if samples is None:
            return None
        while samples and now - samples[0][0] > CLOCK_SAMPLE_TTL_S:
            samples.popleft()
        if not samples:
            del self._samples[peer_id]
            return None
        return _least_delayed(samples)[2]

    def stage_offset_s(self, peer_ids: Iterable[str], now: float) -> float:
        """What to add to this machine's wall clock to read the stage's: the median of the
        offsets of ``peer_ids`` (those measured) and this machine's own, 0."""
        offsets = [0.0]
        for peer_id in set(peer_ids):
            offset = self.offset_s(peer_id, now)
            if offset is not None:
                offsets.append(offset)
        return statistics.median(offsets)

    def offsets(self, now: float) -> dict[str, float]:
        """Every measured peer's offset (``offset_s``), by peer id."""
        out = {}
        for peer_id in list(self._samples):
            offset = self.offset_s(peer_id, now)
            if offset is not None:
                out[peer_id] = offset
        return out

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the samples of peers not in ``keep`` (gone from the table)."""
        kept = set(keep)
        self._samples = {p: s for p, s in self._samples.items() if p in kept}


AGREE_S = 10.0
"""Clocks within this of one another count as agreeing (``agreed_offset_s``); a keyed
swarm's proofs allow 60 s either way (``protocol.auth.SKEW_WINDOW_S``)."""


def agreed_offset_s(offsets: Iterable[float], agree_s: float = AGREE_S) -> float:
    """What to add to this machine's clock to read the time most of ``offsets`` (peers'
    clocks, each how far ahead of this one) agree on; 0 when this clock is among them.

    Each clock (this machine's, or a peer's) gathers the peers' clocks within ``agree_s`` of
    it, and the largest gathering wins. This machine's own clock counts half a peer, so it
    settles a tie between equal numbers of peers but never outvotes one peer alone (a joiner
    whose clock is hours off, knowing only its bootstrap, takes the bootstrap's). Equal
    gatherings go to the one around the clock nearest this one. The answer is the median of
    the winning gathering, or 0 when this machine's clock is within ``agree_s`` of its
    centre: a clock that agrees with most peers is left alone, not nudged by milliseconds.
    O(n log n) for n peers."""
    peers = sorted(offsets)
    best_weight, best, best_at = -1.0, (0, 0), 0.0
    for at in [0.0, *peers]:  # this machine's clock first: it wins ties with a farther one
        lo = bisect.bisect_left(peers, at - agree_s)
        hi = bisect.bisect_right(peers, at + agree_s)
        weight = hi - lo + (0.5 if abs(at) <= agree_s else 0.0)
        if weight > best_weight or (weight == best_weight and abs(at) < abs(best_at)):
            best_weight, best, best_at = weight, (lo, hi), at
    lo, hi = best
    if hi == lo:
        return 0.0
    centre = statistics.median(peers[lo:hi])
    return 0.0 if abs(centre) <= agree_s else centre
