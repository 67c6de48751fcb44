"""One replica at a time leaves or joins a stage: ``swarm.balance.MoveLock``, by hand,
against every order its messages can arrive in, and between real nodes over HTTP."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from node.daemon import Node
from swarm.balance import Move, MoveLock
from tests.helpers import known_replicas

A, B, C = "aaaa", "bbbb", "cccc"


def test_of_two_that_ask_at_once_the_lower_id_goes() -> None:
    a, b = MoveLock(A, hold_s=10), MoveLock(B, hold_s=10)
    assert a.want(0) and b.want(0)
    assert b.answer(A, 0) == (True, "")  # B is higher: it lets A go and gives up its wish
    granted, why = a.answer(B, 0)
    assert not granted and "lower peer id" in why
    assert a.conclude(True) and not b.conclude(False)
    assert a.moving and not b.wanting


def test_a_replica_that_let_one_move_waits_hold_s_and_refuses_others_meanwhile() -> None:
    b = MoveLock(B, hold_s=10)
    assert b.answer(A, 0)[0]
    assert not b.want(5)  # A is on its way: its new place has not reached our plans yet
    granted, why = b.answer(C, 5)
    assert not granted and A[:8] in why
    assert b.answer(A, 6)[0]  # the same asker asking again is let go again...
    assert b.want(10.5)  # ...but that does not extend the hold
    assert b.answer(C, 10.5) == (False, "this replica wants to move too and has the lower peer id")


def test_a_replica_that_goes_refuses_everyone_until_it_has_left() -> None:
    a = MoveLock(A, hold_s=10)
    assert a.want(0) and a.conclude(True)
    assert a.answer(B, 1) == (False, "this replica is moving itself")
    a.reset()
    assert a.answer(B, 2) == (True, "")


def test_a_wish_ends_with_its_verdict_and_one_request_is_out_at_a_time() -> None:
    a = MoveLock(A, hold_s=10)
    assert a.want(0) and not a.want(0)
    assert not a.conclude(False)  # a mate refused: stay, and ask again on the next plan
    assert a.want(1)


def run_schedule(stages: list[int], moves: dict[int, int], rng: random.Random) -> list[int]:
    """Replica ``i`` serves ``stages[i]``; each replica in ``moves`` wants to move to the stage
    it maps to and asks every replica of its stage and of that one. Messages are delivered
    in a random order; returns the replicas that go."""
    n = len(stages)
    ids = [f"{i:04x}" for i in range(n)]
    locks = [MoveLock(p, hold_s=1e9) for p in ids]
    pending: list[tuple[str, int, int, bool]] = [("want", i, -1, False) for i in moves]
    asked: dict[int, int] = {}
    answers: dict[int, list[bool]] = {}
    goes = []

    def conclude(i: int) -> None:
        if len(answers[i]) == asked[i] and locks[i].conclude(all(answers[i])):
            goes.append(i)

    while pending:
        kind, i, j, ok = pending.pop(rng.randrange(len(pending)))
        if kind == "want":
            if locks[i].want(0):
                touched = (stages[i], moves[i])
                them = [k for k in range(n) if k != i and stages[k] in touched]
                asked[i], answers[i] = len(them), []
                pending += [("ask", i, k, False) for k in them]
                conclude(i)
        elif kind == "ask":  # i's request reaches j
            pending.append(("answer", i, j, locks[j].answer(ids[i], 0)[0]))
        else:  # j's answer reaches i
            answers[i].append(ok)
            conclude(i)
    return goes


def test_in_every_order_of_messages_two_moves_never_touch_one_stage() -> None:
    """The rule stated independently: whatever the order requests and answers arrive in,
    no two moves made together leave or join a common stage; of the two replicas of a
    stage, when both want to leave it, exactly one does."""
    rng = random.Random(7)
    for _ in range(4000):
        num_stages = rng.randint(2, 4)
        stages = [rng.randrange(num_stages) for _ in range(rng.randint(2, 7))]
        movers = rng.sample(range(len(stages)), rng.randint(1, len(stages)))
        # a plan never names an empty stage as the target (recovery refills those)
        held = sorted(set(stages))
        movers = [i for i in movers if len(held) > 1]
        moves = {i: rng.choice([s for s in held if s != stages[i]]) for i in movers}
        goes = run_schedule(stages, moves, rng)
        for x in goes:
            for y in goes:
                if x != y:
                    assert not {stages[x], moves[x]} & {stages[y], moves[y]}, (stages, moves, goes)
    for _ in range(500):  # both replicas of a stage want to leave it: one does
        goes = run_schedule([1, 1, 2], {0: 2, 1: 3}, rng)
        assert len(goes) == 1, goes


@pytest.fixture
async def replicas() -> AsyncIterator[Callable[..., Awaitable[list[Node]]]]:
    """Starts in-process nodes that know each other (``known_replicas``); closes them."""
    nodes: list[Node] = []

    async def start(settings: list[dict[str, Any]], stages: list[int] | None = None) -> list[Node]:
        nodes.extend(await known_replicas(settings, stages))
        return nodes

    try:
        yield start
    finally:
        for node in nodes:
            await node.close()


def plan(node: Node, target: int = 2) -> Move:
    """A plan that names ``node`` to leave its stage for ``target``."""
    return Move(node.peer_id, node.state.stage, target, current_min=10.0, new_min=20.0)


@pytest.mark.timeout(60)
async def test_two_real_replicas_named_at_once_ask_and_only_the_lower_id_leaves(
    replicas: Any,
) -> None:
    mates = sorted(await replicas([{}] * 3), key=lambda n: n.peer_id)  # stage 1 of 2
    low, high, third = mates[0], mates[2], mates[1]
    went = await asyncio.gather(
        low.balancer.ask_to_move(plan(low)), high.balancer.ask_to_move(plan(high))
    )
    assert went == [True, False]
    assert (low.balancer.yielded, high.balancer.yielded) == (0, 1)
    assert third.balancer.answers["granted"] >= 1
    # while the lower one is on its way, nobody else of the stage may leave
    assert not await third.balancer.ask_to_move(plan(third))
    assert third.balancer.yielded == 1
    for node in mates:
        assert node.state.serving


@pytest.mark.timeout(60)
async def test_replicas_of_two_stages_named_at_once_for_one_target_do_not_both_go(
    replicas: Any,
) -> None:
    """Plans from summaries of different ages can name a replica of stage 1 and one of stage
    3 for stage 2 at once; the target's replica lets one of them come."""
    settings = {"swarm.num_block_stages": 3}
    one, three, target = await replicas([settings] * 3, stages=[1, 3, 2])
    went = await asyncio.gather(
        one.balancer.ask_to_move(plan(one)), three.balancer.ask_to_move(plan(three))
    )
    assert sorted(went) == [False, True]
    assert target.balancer.answers == {"granted": 1, "refused": 1}
