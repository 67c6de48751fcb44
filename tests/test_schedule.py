"""The clock schedule of outer rounds (``swarm.schedule``) against hand-computed values."""

import random

import pytest

from swarm.schedule import (
    CLOCK_SAMPLE_TTL_S,
    ClockOffsets,
    Pace,
    agreed_offset_s,
    next_boundary,
    power_of_two_at_least,
    round_multiple,
    round_period,
    round_share,
)


@pytest.mark.parametrize(
    "exchange_s, current, want",
    [
        (16.0, 1, 1),  # fits a 30 s round: every round
        (31.0, 1, 2),  # late: 46.5 s of room needs two rounds
        (40.0, 1, 2),  # the 2 Mbit/s sitting's thin replica: 60 s holds 40 s
        (41.0, 1, 2),  # 61.5 s of room wants four; at most twice as many at a time
        (41.0, 2, 2),  # two carry it: stays
        (70.0, 2, 4),  # late at two: four
        (40.0, 2, 2),  # fits the two it spans: stays
        (26.0, 2, 2),  # fits one (26 s of 30) but not with room to go down (31.2 s): stays
        (25.0, 2, 1),  # 30 s holds 1.2 x 25 s: back to every round
        (20.0, 2, 1),
        (51.0, 4, 4),  # two would hold 60 s, short of 61.2 s of room: stays at four
        (50.0, 4, 2),  # two hold 1.2 x 50 s: down to two
        (39.0, 4, 2),  # and not further: one is short of 46.8 s
        (1000.0, 1, 2),
        (1000.0, 4, 8),  # at most eight
        (1000.0, 8, 8),
        (None, 2, 2),  # unknown: as it is
    ],
)
def test_a_replica_spans_as_many_rounds_as_its_exchange_needs(
    exchange_s: float | None, current: int, want: int
) -> None:
    """The stage's rounds are 30 s. A replica takes every ``m``-th, ``m`` the least power
    of two whose rounds hold 1.5 times its exchange, once its exchange outlasts the rounds
    it spans, but at most twice as many at a time; it takes fewer again only where they
    hold 1.2 times it."""
    assert round_multiple(exchange_s, 30.0, current) == want


def test_power_of_two_at_least() -> None:
    assert power_of_two_at_least(5.0) == 8.0
    assert power_of_two_at_least(8.0) == 8.0
    assert power_of_two_at_least(8.01) == 16.0
    assert power_of_two_at_least(0.3) == 4.0  # never below MIN_PERIOD_S
    assert power_of_two_at_least(60.0) == 64.0


def test_period_is_h_times_the_median_step_rounded_up() -> None:
    # H = 10; steps of 0.5, 1.0 and 2.0 s (1x, 2x, 4x slower): median 1.0 -> 10 s -> 16 s
    assert round_period([0.5, 1.0, 2.0], 10) == 16.0
    # replicas not measured yet (0) do not count; none measured: no period yet
    assert round_period([0.0, 0.5, 0.0], 10) == 8.0
    assert round_period([0.0, 0.0], 10) is None
    assert round_period([], 10, current_s=4.0) == 4.0


def test_period_keeps_its_value_inside_the_hysteresis_band() -> None:
    # current 16 s: kept while H * median stays in [0.375 * 16, 1.25 * 16] = [6, 20]
    assert round_period([0.61], 10, current_s=16.0) == 16.0
    assert round_period([1.99], 10, current_s=16.0) == 16.0
    assert round_period([2.01], 10, current_s=16.0) == 32.0  # 20.1 s -> 32
    assert round_period([0.59], 10, current_s=16.0) == 8.0  # 5.9 s -> 8
    # without hysteresis 1.7 s steps would flip between 16 and 32 as the median wobbles
    assert round_period([1.7], 10) == 32.0 and round_period([1.5], 10) == 16.0


def test_replicas_take_the_shortest_period_in_use_that_fits() -> None:
    # H = 10, median step 0.45 s: 4.5 s. Alone, 4 s ([1.5, 5]) and 8 s ([3, 10]) both keep
    # it, so a replica on 8 s stays there while its partner stays on 4 s: the split.
    assert round_period([0.45], 10, current_s=8.0) == 8.0
    assert round_period([0.45], 10, current_s=4.0) == 4.0
    # with the partners' periods read, both take 4 s
    assert round_period([0.45], 10, current_s=8.0, partners_s=[4.0]) == 4.0
    assert round_period([0.45], 10, current_s=4.0, partners_s=[8.0, 0.0]) == 4.0
    # 5.5 s: only 8 s's band ([3, 10]) holds it, so both take 8 s
    assert round_period([0.55], 10, current_s=4.0, partners_s=[8.0]) == 8.0
    assert round_period([0.55], 10, current_s=8.0, partners_s=[4.0]) == 8.0
    # a newcomer (no period yet) joins the grid in use: 2.5 s fits 4 s and 8 s ([3, 10]
    # does not hold 2.5), so 4 s; 3.5 s fits both, so the shorter
    assert round_period([0.25], 10, None, partners_s=[8.0, 4.0]) == 4.0
    assert round_period([0.35], 10, None, partners_s=[8.0]) == 8.0
    # none fits 12 s ([1.5, 5], [3, 10]): the power of two above it
    assert round_period([1.2], 10, current_s=8.0, partners_s=[4.0]) == 16.0
    # periods no derived schedule takes are ignored: not powers of two, below 4 s, not
    # finite, negative
    for odd in (6.0, 2.0, 1.0, float("inf"), float("nan"), -8.0, 0.0):
        assert round_period([0.45], 10, current_s=8.0, partners_s=[odd]) == 8.0


def test_the_choice_of_period_against_a_brute_force_statement() -> None:
    """Every replica of a stage reading the same step times and the periods in use takes
    the same period, and it is the one an independent statement of the rule names: among
    the powers of two from 4 s on, the least that is in use and whose band holds H median
    steps, else the least at or above H median steps."""
    rng = random.Random(7)
    for _ in range(2000):
        h = rng.choice([5, 10, 50])
        steps = [rng.uniform(0.01, 3.0) for _ in range(rng.randint(1, 5))]
        periods = [rng.choice([0.0, 4.0, 8.0, 16.0, 32.0, 64.0]) for _ in range(len(steps))]
        ordered, mid = sorted(steps), len(steps) // 2
        median = ordered[mid] if len(steps) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
        want = h * median
        grid = [4.0 * 2**k for k in range(12)]
        fits = [p for p in grid if p in periods and 0.375 * p <= want <= 1.25 * p]
        expected = fits[0] if fits else next(p for p in grid if p >= want)
        for i, own in enumerate(periods):
            others = periods[:i] + periods[i + 1 :]
            got = round_period(steps, h, own or None, others)
            assert got == expected, (steps, h, periods, i)


def test_boundaries_are_multiples_of_the_period_and_only_move_forward() -> None:
    assert next_boundary(100.0, 8.0) == 104_000
    assert next_boundary(104.0, 8.0) == 104_000
    assert next_boundary(104.0, 8.0, after_ms=104_000) == 112_000
    # the period halves after round 112 s: the next boundary is still later than 112 s
    assert next_boundary(110.0, 4.0, after_ms=112_000) == 116_000


@pytest.mark.parametrize("fine,coarse", [(4.0, 8.0), (8.0, 32.0), (4.0, 64.0)])
def test_power_of_two_grids_nest(fine: float, coarse: float) -> None:
    """Two replicas that briefly disagree about the period still share the coarse grid."""
    t = 1_763_900_000.0  # an hour of boundaries in 2025
    coarse_ms = {next_boundary(t + i * coarse, coarse) for i in range(int(3600 / coarse))}
    fine_ms = {next_boundary(t + i * fine, fine) for i in range(int(3600 / fine) + 1)}
    assert coarse_ms <= fine_ms


def test_a_replica_catches_up_with_the_latest_clock_round_a_partner_is_in() -> None:
    """``node.services.sync._newer_clock_round``: a DiLoCo ring round of this stage at a
    later boundary that has passed (within the skew allowance) is joined; other stages,
    other kinds, earlier boundaries and future ones are not."""
    from node.services.sync import CLOCK_SKEW_MS, _newer_clock_round

    now = 1_000_000
    held = [
        "diloco:1:996000",  # this round
        "diloco:1:992000",  # an earlier one
        "diloco:2:1000000",  # another stage
        "dp:1:7",  # data parallel, keyed by step
        "diloco:1:1000000",  # the partner's, one boundary later: join it
        f"diloco:1:{now + CLOCK_SKEW_MS + 4000}",  # no partner can be there yet
        "diloco:1:x",
    ]
    assert _newer_clock_round(held, 1, 996_000, now) == 1_000_000
    assert _newer_clock_round(held, 1, 1_000_000, now) is None
    assert _newer_clock_round(["diloco:1:1001000"], 1, 996_000, now) == 1_001_000  # skew
    assert _newer_clock_round([], 1, 996_000, now) is None


def test_an_offset_is_the_peers_reading_minus_the_midpoint_of_the_round_trip() -> None:
    """Sent at 100.0 and answered at 100.4 by our clock, stamped 110.3 by the peer's: the
    peer is 110.3 - 100.2 = 10.1 s ahead. Of its samples the least delayed counts: a later
    one with a 2 s round trip (offset 11.0) does not replace it, one with 0.1 s (9.95) does;
    a reply 'received' before it was sent (our clock was set back) is no sample."""
    clocks = ClockOffsets()  # monotonic time here is the wall clock less 100 s
    clocks.observe("p", 100.0, 110.3, 100.4, now=0.4)
    assert clocks.offset_s("p", 1.0) == pytest.approx(10.1)
    clocks.observe("p", 200.0, 212.0, 202.0, now=102.0)
    assert clocks.offset_s("p", 103.0) == pytest.approx(10.1)
    clocks.observe("p", 300.0, 310.0, 300.1, now=200.1)
    assert clocks.offset_s("p", 201.0) == pytest.approx(9.95)
    clocks.observe("q", 300.0, 250.0, 299.0, now=200.1)
    assert clocks.offset_s("q", 201.0) is None
    assert clocks.offset_s("p", 201.0 + CLOCK_SAMPLE_TTL_S) is None  # samples expire
    assert clocks.steps == 0


def test_replicas_that_measured_one_another_agree_on_the_median_clock() -> None:
    """An independent statement: every replica's stage clock reads the median of all the
    stage's clocks. Three clocks at +0, +3 and +40 s (true time 1000): each reads 1003. Add
    a fourth at -2: each reads the mean of the middle two, 1001.5. Of two, each moves
    halfway: one at +0 and one at +10 both read 1005."""

    def stage_clocks(skews: list[float], rtt: float = 0.08) -> list[float]:
        offsets = [ClockOffsets() for _ in skews]
        true = 1000.0
        for i, mine in enumerate(skews):
            for j, theirs in enumerate(skews):
                if i != j:  # i pings j: sent and received by i's clock, stamped by j's
                    sent = true + mine
                    offsets[i].observe(str(j), sent, true + rtt / 2 + theirs, sent + rtt, 0.0)
        return [
            true + mine + offsets[i].stage_offset_s([str(j) for j in range(len(skews))], 0.0)
            for i, mine in enumerate(skews)
        ]

    assert stage_clocks([0.0, 3.0, 40.0]) == pytest.approx([1003.0] * 3)
    assert stage_clocks([0.0, 3.0, 40.0, -2.0]) == pytest.approx([1001.5] * 4)
    assert stage_clocks([0.0, 10.0]) == pytest.approx([1005.0] * 2)
    # a lone wrong clock among equal ones moves only itself
    assert stage_clocks([0.0, 0.0, 0.0, -600.0]) == pytest.approx([1000.0] * 4)


def test_peers_gone_from_the_table_are_forgotten_and_unmeasured_ones_do_not_count() -> None:
    clocks = ClockOffsets()
    clocks.observe("p", 0.0, 20.0, 0.0, now=0.0)
    clocks.observe("q", 0.0, 30.0, 0.0, now=0.0)
    assert clocks.stage_offset_s(["p", "q", "never-measured"], 1.0) == 20.0
    clocks.forget(["q"])
    assert clocks.offset_s("p", 1.0) is None
    assert clocks.stage_offset_s(["p", "q"], 1.0) == 15.0


def test_when_this_machines_clock_is_set_the_samples_of_the_old_setting_go() -> None:
    """A sample at monotonic 0 (wall 100): peer 10 s ahead. The wall clock is then set back
    an hour: at monotonic 5 the wall reads 100 + 5 - 3600, and the peer now reads 3610 s
    ahead. Kept, the old sample (its round trip the shorter) would still say 10."""
    clocks = ClockOffsets()
    clocks.observe("p", 99.99, 110.0, 100.01, now=0.0)
    assert clocks.offset_s("p", 1.0) == pytest.approx(10.0)
    wall = 100.0 + 5.0 - 3600.0
    clocks.observe("p", wall - 0.05, wall + 3610.0, wall + 0.05, now=5.0)
    assert clocks.offset_s("p", 6.0) == pytest.approx(3610.0)
    assert clocks.steps == 1
    clocks.observe("q", wall + 1.0, wall + 1.0, wall + 1.02, now=6.01)  # slewing is no step
    assert clocks.steps == 1 and clocks.offset_s("p", 7.0) == pytest.approx(3610.0)


def test_when_a_peers_clock_is_set_its_samples_of_the_old_setting_go() -> None:
    """The peer reads 10 s ahead (round trip 0.02 s). Its clock is then set back an hour: a
    sample with a 0.5 s round trip reads 3590 s behind. Both cannot measure one setting
    (they differ by 3600 s, more than (0.02 + 0.5) / 2 + 1), so the old one goes; kept, its
    shorter round trip would have said +10 for up to seven more pings. A sample 0.8 s off
    with a 0.1 s round trip is noise within the bound, not a step."""
    clocks = ClockOffsets()
    clocks.observe("p", 99.99, 110.0, 100.01, now=0.0)
    clocks.observe("p", 104.95, 115.8, 105.05, now=5.0)
    assert clocks.offset_s("p", 6.0) == pytest.approx(10.0) and clocks.peer_steps == 0
    clocks.observe("p", 109.75, 120.0 - 3600.0, 110.25, now=10.0)
    assert clocks.offset_s("p", 11.0) == pytest.approx(-3590.0)
    assert clocks.peer_steps == 1 and clocks.steps == 0
    clocks.observe("p", 114.99, 125.0 - 3600.0, 115.01, now=15.0)  # the new setting holds
    assert clocks.offset_s("p", 16.0) == pytest.approx(-3590.0) and clocks.peer_steps == 1


def test_a_rounds_share_is_the_part_of_it_a_replica_trained_in() -> None:
    period = 64_000
    assert round_share(None, 128_000, period) == 1.0  # not known: a whole round
    assert round_share(64_000, 128_000, period) == 1.0  # from the last boundary
    assert round_share(103_000, 128_000, period) == pytest.approx(25 / 64)  # began serving
    assert round_share(0, 128_000, period) == 1.0  # a boundary missed: still at most one
    assert round_share(128_500, 128_000, period) == 0.0  # a stage clock read back a little
    assert round_share(64_000, 128_000, 0) == 1.0


def paced(times: list[float], window_s: float, units: int = 1) -> Pace:
    pace = Pace(window_s)
    for t in times:
        pace.step(t, units)
    return pace


def test_a_pace_is_wall_time_over_the_steps_after_the_last_step_before_its_window() -> None:
    assert paced([0, 1, 2, 3, 4], 10).seconds_per_step == 1.0  # from the first step: 4 s, 4
    # steps at 0, 3, 4, 9, 10 and a 5 s window at 10: the anchor is the step at 4 (the last
    # at or before 10 - 5), after it 2 steps in 6 s
    assert paced([0, 3, 4, 9, 10], 5).seconds_per_step == 3.0
    assert paced([0], 5).seconds_per_step == 0.0  # one step measures nothing
    # a 2bw step counts its units: 4 units 8 s after the first step, 2 s a unit
    assert paced([100, 108], 120, units=4).seconds_per_step == 2.0


def test_a_rounds_exchange_counts_so_the_usual_steps_are_those_a_round_holds() -> None:
    # 10 s rounds: 8 steps a second apart, then the exchange holds the optimizer 3 s; the
    # window is two rounds (the stage service sets it so)
    times, t = [], 0.0
    for _ in range(6):
        for _ in range(8):
            t += 1.0
            times.append(t)
        t += 2.0  # the 9th and 10th second: the step after the exchange comes 3 s after
    pace = paced(times, 20.0)
    assert pace.seconds_per_step == pytest.approx(20 / 16)  # 16 steps in the last 20 s
    assert 10 / pace.seconds_per_step == pytest.approx(8)  # the steps a round really holds
    # (the old average of the last step times read about 1.0 s: a usual 10, and every
    # equal replica's displacement enlarged 10 / 8 = 1.25x)


def test_a_stall_moves_the_pace_by_its_share_of_the_window_only() -> None:
    # two minutes of 1 s steps, then one step that took 21 s (an eval on the head): over a
    # 128 s window the anchor is the step at 13 (the last at or before 141 - 128), after it
    # 108 steps (14 to 120, and 141) in 128 s
    times = [float(t) for t in range(121)] + [141.0]
    pace = paced(times, 128.0)
    assert pace.seconds_per_step == pytest.approx(128 / 108)
    # (the old average, 0.8 of the last reading and 0.2 of the step, read 0.8 + 4.2 = 5.0)


def test_a_gap_longer_than_the_window_is_not_a_pace() -> None:
    pace = paced([0, 1, 2, 3], 10)
    assert pace.step(100) == 1.0  # no work for 97 s: the estimate stands, the window restarts
    assert pace.step(102) == 2.0  # measured again from the step at 100


def brute_pace(steps: list[tuple[float, int]], window_s: float) -> float:
    """The pace after the last of ``steps`` by its definition: over the run of steps since
    the last gap longer than the window, from the last step at or before ``now - window``
    (or the run's first) to ``now``, per unit taken after it; the last such value measured."""
    last = 0.0
    for end in range(len(steps)):
        run_start = 0
        for i in range(1, end + 1):
            if steps[i][0] - steps[i - 1][0] > window_s:
                run_start = i
        now = steps[end][0]
        run = steps[run_start : end + 1]
        anchor = max((i for i, (t, _) in enumerate(run) if t <= now - window_s), default=0)
        units = sum(u for _, u in run[anchor + 1 :])
        if units:
            last = (now - run[anchor][0]) / units
    return last


@pytest.mark.parametrize("seed", range(20))
def test_the_pace_agrees_with_its_definition_on_random_steps(seed: int) -> None:
    rng = random.Random(seed)
    window_s = rng.choice([5.0, 20.0, 64.0])
    steps, t, pace = [], 0.0, Pace(window_s)
    for _ in range(rng.randrange(1, 200)):
        t += rng.choice([rng.expovariate(1.0), rng.uniform(0, 3 * window_s)])
        units = rng.choice([1, 1, 4])
        steps.append((t, units))
        got = pace.step(t, units)
        assert got == pytest.approx(brute_pace(steps, window_s), rel=1e-9)


def test_the_agreed_offset_by_hand() -> None:
    """Peers' clocks ahead of this one (s); within 10 s of one another they agree."""
    assert agreed_offset_s([]) == 0.0  # nobody measured: this clock
    assert agreed_offset_s([7200.0]) == 7200.0  # a joiner that knows only its bootstrap
    assert agreed_offset_s([0.003, 7200.0]) == 0.0  # this clock and one peer outvote one
    assert agreed_offset_s([7200.0, 7201.0, 0.01]) == 7200.5  # two peers outvote 1.5
    assert agreed_offset_s([7200.0, 7204.0, 7203.0, -3600.0]) == 7203.0  # the median of three
    assert agreed_offset_s([7200.0, -3600.0]) == -3600.0  # a tie: the smaller move
    assert agreed_offset_s([12.0, 12.5, 11.5]) == 12.0  # this clock is 12 s off: corrected
    assert agreed_offset_s([0.0, 9.0, 18.0]) == 0.0  # centre 9, this clock within 10 s
    assert agreed_offset_s([-0.02, 0.01, 0.03]) == 0.0  # agreeing: no millisecond nudges


def _agreed_by_definition(offsets: list[float], agree_s: float = 10.0) -> float:
    """The rule as its docstring states it, O(n^2): every clock's gathering of peers."""
    import statistics

    weighed = []
    for at in [0.0, *offsets]:
        group = [o for o in offsets if abs(o - at) <= agree_s]
        weighed.append((len(group) + (0.5 if abs(at) <= agree_s else 0.0), -abs(at), group))
    weight, _, group = max(weighed, key=lambda w: (w[0], w[1]))
    centre = statistics.median(group) if group else 0.0
    return 0.0 if abs(centre) <= agree_s else centre


def test_the_agreed_offset_against_its_definition() -> None:
    rng = random.Random(3)
    for _ in range(2000):
        clocks = [rng.choice([0.0, 7200.0, -3600.0, 45.0]) + rng.gauss(0, 4) for _ in range(9)]
        offsets = rng.sample(clocks, rng.randint(0, 9))
        assert agreed_offset_s(offsets) == pytest.approx(_agreed_by_definition(offsets))
