"""One replica of a stage leaves it at a time: ``swarm.balance.MoveLock``, by hand, against
every order its messages can arrive in, and between real nodes over HTTP."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest

from node.daemon import Node
from swarm.balance import Move, MoveLock
from tests.helpers import stage_mates

A, B, C = "aaaa", "bbbb", "cccc"


def test_of_two_that_ask_at_once_the_lower_id_goes() -> None:
    a, b = MoveLock(A, hold_s=10), MoveLock(B, hold_s=10)
    assert a.want(0) and b.want(0)
    assert b.answer(A, 0) == (True, "")  # B is higher: it lets A go and gives up its wish
    granted, why = a.answer(B, 0)
    assert not granted and "lower peer id" in why
    assert a.conclude(True) and not b.conclude(False)
    assert a.leaving and not b.wanting


def test_a_mate_that_let_one_go_waits_hold_s_and_refuses_others_meanwhile() -> None:
    b = MoveLock(B, hold_s=10)
    assert b.answer(A, 0)[0]
    assert not b.want(5)  # A is on its way: its new place has not reached our plans yet
    granted, why = b.answer(C, 5)
    assert not granted and A[:8] in why
    assert b.answer(A, 6)[0]  # the same asker asking again is let go again
    assert b.want(16.5) and b.answer(C, 16.5) == (
        False,
        "this replica wants to leave too and has the lower peer id",
    )


def test_a_replica_that_goes_refuses_everyone_until_it_has_left() -> None:
    a = MoveLock(A, hold_s=10)
    assert a.want(0) and a.conclude(True)
    assert a.answer(B, 1) == (False, "this replica is leaving the stage itself")
    a.reset()
    assert a.answer(B, 2) == (True, "")


def test_a_wish_ends_with_its_verdict_and_one_request_is_out_at_a_time() -> None:
    a = MoveLock(A, hold_s=10)
    assert a.want(0) and not a.want(0)
    assert not a.conclude(False)  # a mate refused: stay, and ask again on the next plan
    assert a.want(1)


def run_schedule(n: int, wanting: list[int], rng: random.Random) -> list[int]:
    """Replicas ``0..n-1`` of one stage; those in ``wanting`` ask every other one to leave.
    Messages are delivered in a random order; returns the replicas that go."""
    ids = [f"{i:04x}" for i in range(n)]
    locks = [MoveLock(p, hold_s=1e9) for p in ids]
    pending: list[tuple[str, int, int, bool]] = [("want", i, -1, False) for i in wanting]
    waiting: dict[int, list[bool]] = {}
    goes = []
    while pending:
        kind, i, j, ok = pending.pop(rng.randrange(len(pending)))
        if kind == "want":
            if locks[i].want(0):
                waiting[i] = []
                pending += [("ask", i, k, False) for k in range(n) if k != i]
        elif kind == "ask":  # i's request reaches j
            pending.append(("answer", i, j, locks[j].answer(ids[i], 0)[0]))
        else:  # j's answer reaches i
            waiting[i].append(ok)
            if len(waiting[i]) == n - 1 and locks[i].conclude(all(waiting[i])):
                goes.append(i)
    return goes


def test_in_every_order_of_messages_at_most_one_replica_goes() -> None:
    """The rule stated independently: whatever the order requests and answers arrive in,
    never two replicas of a stage leave together; of two replicas that both want to,
    exactly one leaves."""
    rng = random.Random(7)
    for _ in range(3000):
        n = rng.randint(2, 6)
        wanting = rng.sample(range(n), rng.randint(1, n))
        goes = run_schedule(n, wanting, rng)
        assert len(goes) <= 1, (n, wanting, goes)
        if n == 2 or len(wanting) == 1:
            assert len(goes) == 1, (n, wanting, goes)


@pytest.fixture
async def mates() -> AsyncIterator[list[Node]]:
    nodes: list[Node] = []
    try:
        nodes += await stage_mates([{"balance.cooldown_s": 60}] * 3)
        yield sorted(nodes, key=lambda n: n.peer_id)
    finally:
        for node in nodes:
            await node.close()


@pytest.mark.timeout(60)
async def test_two_real_replicas_named_at_once_ask_and_only_the_lower_id_leaves(
    mates: list[Node],
) -> None:
    low, high, third = mates[0], mates[2], mates[1]

    def plan(node: Node) -> Move:
        return Move(node.peer_id, source=1, target=2, current_min=10.0, new_min=20.0)

    went = await asyncio.gather(
        low.balancer.ask_to_leave(plan(low)), high.balancer.ask_to_leave(plan(high))
    )
    assert went == [True, False]
    assert (low.balancer.yielded, high.balancer.yielded) == (0, 1)
    assert third.balancer.answers["granted"] >= 1
    # while the lower one is on its way, nobody else of the stage may leave
    assert not await third.balancer.ask_to_leave(plan(third))
    assert third.balancer.yielded == 1
    for node in mates:
        assert node.state.serving
