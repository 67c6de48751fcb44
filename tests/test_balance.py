"""Throughput balancing policy (swarm.balance) on hand-made throughput tables."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest

from protocol.messages import PeerRecord
from swarm.balance import (
    SETTLE_ROUNDS,
    Move,
    Replica,
    Transit,
    fill_unknown,
    join_stage,
    plan_move,
    settle_join,
    stage_totals,
)


def swarm(*stages: list[float], head: float = 100.0) -> list[Replica]:
    """Replicas of block stages 1..N with the given rates (ids s<stage>r<i>), plus one head."""
    out = [Replica("head", 0, head, movable=False)]
    for s, rates in enumerate(stages, start=1):
        out += [Replica(f"s{s}r{i}", s, rate) for i, rate in enumerate(rates)]
    return out


def apply(replicas: list[Replica], move: Move) -> list[Replica]:
    return [
        Replica(r.peer_id, move.target, r.rate, r.movable) if r.peer_id == move.peer_id else r
        for r in replicas
    ]


# ---- joining --------------------------------------------------------------------------------


def test_join_takes_an_empty_stage_first_even_if_others_are_slow() -> None:
    reps = swarm([1.0], [], [1.0])
    assert join_stage(reps, 4, random.Random(0)) == 2


def test_join_fills_an_empty_head_stage() -> None:
    reps = [r for r in swarm([5.0], [5.0]) if r.stage != 0]
    assert join_stage(reps, 3, random.Random(0)) == 0


def test_join_picks_the_lowest_total_not_the_fewest_replicas() -> None:
    # stage 1: two slow replicas (2 + 2 = 4/s); stage 2: one fast replica (10/s)
    reps = swarm([2.0, 2.0], [10.0])
    assert join_stage(reps, 3, random.Random(0)) == 1


def test_join_never_picks_the_head_stage_when_it_has_a_replica() -> None:
    reps = swarm([10.0], [10.0], head=0.5)
    for seed in range(20):
        assert join_stage(reps, 3, random.Random(seed)) in (1, 2)


def test_join_ties_are_broken_at_random() -> None:
    reps = swarm([3.0], [3.0], [3.0])
    picks = Counter(join_stage(reps, 4, random.Random(seed)) for seed in range(60))
    assert set(picks) == {1, 2, 3}


def test_a_tie_keeps_its_pick_when_another_tied_stage_drops_out() -> None:
    # nodes deciding a moment apart see one tied stage fewer or more: a joiner's pick among
    # ties must not change with the stages it did not pick (``settle_join`` relies on it)
    for seed in range(40):
        first = join_stage(swarm([], [], []), 4, random.Random(seed))
        for other in {1, 2, 3} - {first}:
            fewer = [[], [], []]
            fewer[other - 1] = [1.0]
            assert join_stage(swarm(*fewer), 4, random.Random(seed)) == first
        tied = join_stage(swarm([2.0], [2.0], [2.0]), 4, random.Random(seed))
        for other in {1, 2, 3} - {tied}:
            rates = [[2.0], [2.0], [2.0]]
            rates[other - 1] = [3.0]
            assert join_stage(swarm(*rates), 4, random.Random(seed)) == tied


def test_a_joining_peer_without_a_rate_counts_as_a_typical_one() -> None:
    # stage 2's second replica has not measured anything: it counts as the median (4/s),
    # so stage 2 (4 + 4) is stronger than stage 1 (4 + 3)
    reps = swarm([4.0, 3.0], [4.0, 0.0])
    assert join_stage(reps, 3, random.Random(0)) == 1
    assert [r.rate for r in fill_unknown(reps[1:], 1.0)] == [4.0, 3.0, 4.0, 4.0]
    assert [r.rate for r in fill_unknown([Replica("a", 1, 0.0)], 7.0)] == [7.0]


# ---- nodes that choose at the same moment ---------------------------------------------------


def pick4(placed: Sequence[Replica], rng: random.Random) -> int:
    return join_stage(placed, 4, rng)


def settle_round(
    fixed: list[Replica], stage: dict[str, int], settling: set[str], rates: dict[str, float]
) -> None:
    """One round, every settling joiner asking at once from the same snapshot: one whose
    answer is its announced stage takes it (leaves ``settling``), the others announce theirs."""
    snap, asking = dict(stage), set(settling)
    for j in sorted(asking):
        others = fixed + [Replica(o, snap[o], rates[o]) for o in snap if o != j]
        again = settle_join(j, snap[j], others, asking, pick4)
        if again == snap[j]:
            settling.discard(j)
        stage[j] = again


def block_counts(fixed: list[Replica], stage: dict[str, int]) -> list[int]:
    c = Counter([r.stage for r in fixed] + list(stage.values()))
    return [c[s] for s in (1, 2, 3)]


def test_three_nodes_that_saw_one_empty_stage_take_turns() -> None:
    # a logged start: stages 1 and 3 held one replica each, and three nodes all saw stage 2
    # empty and announced it. The lowest id keeps it; the next two take their turns after
    # it, each counting the turns before its own
    fixed = [Replica("head", 0, 1.0, movable=False), Replica("a", 1, 1.0), Replica("b", 3, 1.0)]
    ids = ["j0", "j1", "j2"]
    others = fixed + [Replica(j, 2, 1.0) for j in ids]
    answers = {j: settle_join(j, 2, others, set(ids), pick4) for j in ids}
    assert answers["j0"] == 2
    turn1 = join_stage([*fixed, Replica("j0", 2, 1.0)], 4, random.Random("join-j1"))
    assert answers["j1"] == turn1  # by hand: j0 counted on stage 2, j2 not yet
    placed = [*fixed, Replica("j0", 2, 1.0), Replica("j1", turn1, 1.0)]
    assert answers["j2"] == join_stage(placed, 4, random.Random("join-j2"))
    counts = block_counts(fixed, answers)
    assert max(counts) - min(counts) <= 1, counts  # 2, 2, 1 in some order: five on three


def test_a_lone_joiner_takes_the_plain_rule_and_later_ids_do_not_count() -> None:
    fixed = swarm([2.0], [1.0], [2.0])
    alone = settle_join("m", 2, fixed, set(), pick4)
    assert alone == join_stage(fixed, 4, random.Random("join-m")) == 2
    # higher ids announced on our stage come after us: they change nothing
    later = [*fixed, Replica("n", 2, 5.0), Replica("z", 2, 5.0)]
    assert settle_join("m", 2, later, {"n", "z"}, pick4) == 2
    # a lower id announced on our stage goes first: stage 2 then reads 1 + 5, and we go to
    # the weakest of the rest (stages 1 and 3 tie at 2: our own preference decides)
    earlier = [*fixed, Replica("a", 2, 5.0)]
    assert settle_join("m", 2, earlier, {"a"}, pick4) in (1, 3)
    # ...unless it has taken its stage already: then it is simply counted where it is
    assert settle_join("m", 2, earlier, set(), pick4) in (1, 3)


def test_joiners_pile_on_a_stage_when_the_rule_says_so() -> None:
    # stage 1 at 2/s, stage 2 at 10/s: two joiners at 5/s announced stage 1 both keep it
    # (2 + 5 = 7 is still below 10)
    others = [*swarm([2.0], [10.0]), Replica("j0", 1, 5.0), Replica("j1", 1, 5.0)]

    def pick3(placed: Sequence[Replica], rng: random.Random) -> int:
        return join_stage(placed, 3, rng)

    assert [settle_join(j, 1, others, {"j0", "j1"}, pick3) for j in ("j0", "j1")] == [1, 1]


def test_bursts_of_joiners_end_balanced_within_the_rounds() -> None:
    """An independent statement of the goal. Equal nodes, 2 to 9 of them, all choosing
    from one view at the same instant (the worst case: a swarm started at once), over block
    stages that start at most one replica apart: after ``SETTLE_ROUNDS`` rounds in which
    every one asks at once, the block stages' counts are at most one apart. Their first
    choices alone are not (most bursts pile up): this is what the rounds fix."""
    rng = random.Random(11)
    first_balanced = 0
    for _ in range(500):
        start = [rng.randint(1, 2) for _ in range(3)]
        fixed = swarm(*([1.0] * n for n in start))
        ids = [f"{rng.getrandbits(32):08x}" for _ in range(rng.randint(2, 9))]
        stage = {j: join_stage(fixed, 4, random.Random(f"join-{j}")) for j in ids}
        counts = block_counts(fixed, stage)
        first_balanced += max(counts) - min(counts) <= 1
        settling = set(ids)
        for _ in range(SETTLE_ROUNDS):
            settle_round(fixed, stage, settling, dict.fromkeys(ids, 1.0))
        counts = block_counts(fixed, stage)
        assert max(counts) - min(counts) <= 1, (start, counts)
    assert first_balanced < 250, first_balanced


def test_stage_totals_sum_rates_per_stage() -> None:
    assert stage_totals(swarm([1.0, 2.0], [4.0]), range(1, 3)) == {1: 3.0, 2: 4.0}


# ---- rebalancing ----------------------------------------------------------------------------


def test_a_clear_gain_moves_the_best_candidate_to_the_weakest_stage() -> None:
    # totals 20 / 2 / 20: moving a 10/s replica from 1 to 2 gives 10 / 12 / 20
    # current_min / new_min = 2 / 10 = 0.2 < 0.75; ties (s1r0, s1r1, s3r0, s3r1) -> lowest id
    move = plan_move(swarm([10.0, 10.0], [2.0], [10.0, 10.0]), 4)
    assert move == Move("s1r0", 1, 2, 2.0, 10.0)
    assert move.quality == pytest.approx(0.2)


def test_the_candidate_whose_move_raises_the_bottleneck_most_is_chosen() -> None:
    # totals 10 / 3 / 14, weakest stage 2. Moving s1r0 (4/s) -> 6 / 7 / 14: new min 6;
    # s1r1 (6/s) -> 4 / 9 / 14: 4; s3r0 (7/s) -> 10 / 10 / 7: 7, the best; s3r1 ties, higher id
    move = plan_move(swarm([4.0, 6.0], [3.0], [7.0, 7.0]), 4)
    assert move is not None
    assert (move.peer_id, move.source, move.target) == ("s3r0", 3, 2)
    assert move.new_min == 7.0


def test_no_move_below_petals_margin() -> None:
    # totals 8 / 7: moving a 4/s replica gives 4 / 11; 7 / 4 > 1: worse, no move
    assert plan_move(swarm([4.0, 4.0], [7.0]), 3) is None
    # totals 10 / 8 / 10 with 5/s replicas: best new min is 10 / 13 / 5 -> 5; no gain
    assert plan_move(swarm([5.0, 5.0], [8.0], [5.0, 5.0]), 4) is None


def test_the_margin_is_configurable_and_strict() -> None:
    # totals 12 / 6 / 12 (6/s replicas): moving one gives 6 / 12 / 12 -> min 6: quality 1.0
    reps = swarm([6.0, 6.0], [6.0], [6.0, 6.0])
    assert plan_move(reps, 4, quality=1.0) is None  # an equal bottleneck never moves anyone
    # totals 12 / 7, replicas 4/s: moving gives 8 / 11 -> min 8; quality 7 / 8 = 0.875
    reps = swarm([4.0, 4.0, 4.0], [7.0])
    assert plan_move(reps, 3) is None
    move = plan_move(reps, 3, quality=0.9)
    assert move is not None and move.quality == pytest.approx(0.875)


def test_no_flip_flop_after_a_move() -> None:
    reps = swarm([10.0, 10.0, 10.0], [2.0, 2.0])
    first = plan_move(reps, 3)
    assert first is not None and (first.source, first.target) == (1, 2)
    after = apply(reps, first)  # totals 20 / 14
    assert plan_move(after, 3) is None


def test_a_move_never_empties_a_stage() -> None:
    # stage 1's only replica is very fast and stage 2 is very slow: still no move
    assert plan_move(swarm([100.0], [1.0, 1.0]), 3) is None


def test_an_empty_block_stage_is_left_to_recovery() -> None:
    assert plan_move(swarm([5.0, 5.0, 5.0], []), 3) is None


def test_pinned_and_head_replicas_are_never_candidates() -> None:
    reps = [
        Replica("head", 0, 50.0, movable=False),
        Replica("a", 1, 10.0, movable=False),
        Replica("b", 1, 10.0, movable=False),
        Replica("c", 2, 1.0),
    ]
    assert plan_move(reps, 3) is None
    reps.append(Replica("d", 1, 10.0))
    move = plan_move(reps, 3)
    assert move is not None and move.peer_id == "d"


def test_herd_only_one_of_many_equal_candidates_is_named() -> None:
    # six identical fast replicas on stages 1 and 3 could all fill stage 2's gap; every node
    # computes the same plan, and it names exactly one of them
    reps = swarm([9.0, 9.0, 9.0], [1.0], [9.0, 9.0, 9.0])
    plans = {plan_move(list(reversed(reps)), 4), plan_move(reps, 4)}
    assert len(plans) == 1
    (move,) = plans
    assert move is not None and move.peer_id == "s1r0"
    # after it (totals 18 / 10 / 27) the next plan is again a single move, from the now
    # strongest stage 3 (18 / 19 / 18)
    second = plan_move(apply(reps, move), 4)
    assert second == Move("s3r0", 3, 2, 10.0, 18.0)


def test_sequential_moves_converge_on_a_slowed_stage() -> None:
    # the demo case of the issue: stage 2's nodes are 4x slower; nodes move until stable
    fast, slow = 4.0, 1.0
    reps = swarm([fast, fast], [slow, slow], [fast, fast])
    for _ in range(10):
        move = plan_move(reps, 4)
        if move is None:
            break
        # a node moving onto the slowed stage runs at that stage's speed
        reps = [
            Replica(r.peer_id, move.target, slow if move.target == 2 else fast, r.movable)
            if r.peer_id == move.peer_id
            else r
            for r in reps
        ]
    else:
        pytest.fail("rebalancing did not settle")
    counts = Counter(r.stage for r in reps if r.stage > 0)
    assert counts[2] > counts[1] and counts[2] > counts[3]
    assert min(counts.values()) >= 1


# ---- neighbourhood tables: far stages known by totals only ------------------------------


def test_with_far_stages_known_by_totals_one_node_moves_and_by_stage_is_the_rule() -> None:
    # head 0 and block stages 1..5 on a ring of 6; a node holds records of its own stage and
    # the two next to it, and stand-ins (swarm.peers.stand_ins) for the rest. Totals:
    # 12 / 3 / 10 / 12 / 18, weakest stage 2. A typical replica leaving stage 1 (6/s) gives
    # min 6, stage 3 (5/s) 5, stage 4 (6/s) 6, stage 5 (9/s) 9: stage 5 gives one up, and its
    # best replica (9/s: 18 -> 9, 3 -> 12) is s5r0 (ties to the lowest id). Quality 3 / 9.
    from protocol.messages import StageSummary
    from swarm.peers import Neighbourhood, stand_ins

    rates = {1: [10.0, 2.0], 2: [3.0], 3: [5.0, 5.0], 4: [6.0, 6.0], 5: [9.0, 9.0]}
    everyone = swarm(*rates.values())
    ring = Neighbourhood(6)

    def view_of(stage: int) -> list[Replica]:
        held = [r for r in everyone if ring.covers(stage, r.stage)]
        for s in (s for s in range(6) if not ring.covers(stage, s)):
            mine = [r for r in everyone if r.stage == s]
            summary = StageSummary(s, len(mine), len(mine), sum(r.rate for r in mine), 1, 0.0)
            held += [Replica(p.peer_id, s, p.throughput, p.movable) for p in stand_ins(summary)]
        return held

    def movers(by_stage: bool) -> list[str]:
        named = []
        for r in everyone:
            plan = plan_move(view_of(r.stage), 6, by_stage=by_stage)
            if r.movable and plan is not None and plan.peer_id == r.peer_id:
                named.append(r.peer_id)
        return named

    assert movers(by_stage=True) == ["s5r0"]
    assert plan_move(everyone, 6) == plan_move(view_of(5), 6, by_stage=True)  # same move
    # the rule for whole tables, on partial views, herds: stage 1's nodes cannot see stage
    # 5's better candidate and name their own (s1r1: 12 -> 10, 3 -> 5; quality 0.6)
    assert movers(by_stage=False) == ["s1r1", "s5r0"]


def test_by_stage_never_names_a_replica_of_another_stage_than_the_source() -> None:
    # totals 20 / 2 / 20 (see the first plan test): stages 1 and 3 tie as sources; the
    # lowest stage gives
    move = plan_move(swarm([10.0, 10.0], [2.0], [10.0, 10.0]), 4, by_stage=True)
    assert move == Move("s1r0", 1, 2, 2.0, 10.0)
    # a source stage whose replicas are all pinned: no move, though another stage has one
    reps = swarm([10.0, 10.0], [2.0], [6.0, 6.0])
    reps = [Replica(r.peer_id, r.stage, r.rate, r.stage != 1) for r in reps]
    assert plan_move(reps, 4, by_stage=True) is None


def rec(peer_id: str, stage: int, *, ready: bool = False, inc: int = 1) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, address="", stage=stage, ready=ready, incarnation=inc)


def test_a_replica_not_ready_is_waited_for_until_the_limit_from_when_first_seen() -> None:
    """Limit 100 s. "a" is seen not ready at t=0, "b" at t=50: at t=99 both are waited
    for; at t=100 "a" is overdue and only "b" is; at t=150 neither. Head-stage records,
    ready ones and leaving ones are never waited for."""
    transit = Transit(100.0)
    assert transit.waiting([rec("a", 1), rec("h", 0), rec("r", 2, ready=True)], 0.0) == [
        rec("a", 1)
    ]
    gone = PeerRecord(peer_id="l", address="", stage=1, leaving=True)
    assert [r.peer_id for r in transit.waiting([rec("a", 1), rec("b", 2), gone], 50.0)] == [
        "a",
        "b",
    ]
    assert [r.peer_id for r in transit.waiting([rec("a", 1), rec("b", 2)], 99.0)] == ["a", "b"]
    assert [r.peer_id for r in transit.waiting([rec("a", 1), rec("b", 2)], 100.0)] == ["b"]
    assert transit.overdue(100.0) == [("a", 1, 1)]
    assert transit.waiting([rec("a", 1), rec("b", 2)], 150.0) == []
    assert sorted(transit.overdue(150.0)) == [("a", 1, 1), ("b", 1, 2)]


def test_a_replica_that_was_ready_or_moved_since_is_waited_for_afresh() -> None:
    """ "a" overdue at t=100 on stage 1; at t=110 it is ready (forgotten), at t=120 it moves
    and is not ready on stage 2: waited for until t=220. "b" restarts (a new incarnation)
    at t=130 and is waited for again; a record that vanished is forgotten."""
    transit = Transit(100.0)
    transit.waiting([rec("a", 1), rec("b", 1)], 0.0)
    assert transit.waiting([rec("a", 1), rec("b", 1)], 100.0) == []
    transit.waiting([rec("a", 1, ready=True), rec("b", 1)], 110.0)
    assert transit.waiting([rec("a", 2), rec("b", 1)], 120.0) == [rec("a", 2)]
    assert transit.waiting([rec("a", 2), rec("b", 1, inc=2)], 130.0) == [
        rec("a", 2),
        rec("b", 1, inc=2),
    ]
    assert transit.waiting([rec("a", 2)], 219.0) == [rec("a", 2)]
    assert transit.since == {("a", 1, 2): 120.0}
    assert transit.waiting([rec("a", 2)], 220.0) == []
