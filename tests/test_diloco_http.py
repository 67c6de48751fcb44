"""A DiLoCo round between real nodes over HTTP: one slow-weight update for all and, with
``sync.diloco_share_schedule``, one place in the learning-rate schedule.

On the clock schedule a replica 4x slower than its partners takes a quarter of their inner
steps per round, so its place in the schedule (keyed on its own steps) falls behind
theirs. A NoLoCo pair averages the two places (``swarm.outer.pair_position``); a DiLoCo
ring that shares them sums them beside the pseudo-gradients (``swarm.allreduce``'s side
values, exact even when the chunks travel as int8), and every member takes the mean. By
default DiLoCo replicas keep their own places (measured to train better, ``bench/README.md``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import torch

from node.daemon import Node
from tests.helpers import IN_PROCESS_REPLICA, known_replicas, outer_round

pytestmark = pytest.mark.timeout(60)

SETTINGS = {
    **IN_PROCESS_REPLICA,
    "sync.method": "diloco",
    "sync.schedule": "steps",
    "sync.codec": "int8",
}
SHARE = {"sync.diloco_share_schedule": "true"}


async def ring_of(*members: dict[str, str]) -> list[Node]:
    """Replicas of stage 1 that know each other, one per entry of ``members``: the settings
    each adds to ``SETTINGS``."""
    return await known_replicas([{**SETTINGS, **extra} for extra in members])


@pytest.fixture
async def nodes() -> AsyncIterator[list[Node]]:
    made: list[Node] = []
    yield made
    for node in made:
        await node.close()


def slow_weights(node: Node) -> torch.Tensor:
    assert node.runner is not None
    return node.runner.phi.clone()


async def test_a_ring_round_gives_every_member_the_mean_place(nodes: list[Node]) -> None:
    nodes += await ring_of(SHARE, SHARE, SHARE)
    for node, place in zip(nodes, (10.0, 20.0, 60.0), strict=True):
        assert node.runner is not None
        node.runner.schedule_step = place
    await asyncio.gather(*(outer_round(n) for n in nodes))
    for node in nodes:
        assert node.sync is not None and node.sync.rounds == {"allreduced": 1}
        assert node.runner is not None and node.runner.schedule_step == 30.0
        assert node.runner.places_clamped == 0
    # the replicas held the same weights and took the same (zero) steps: one phi for all
    assert all(torch.equal(slow_weights(n), slow_weights(nodes[0])) for n in nodes)


async def test_a_member_that_lies_about_its_place_moves_the_others_a_bounded_step(
    nodes: list[Node],
) -> None:
    from node.stage.runner import PLACE_ROUNDS

    nodes += await ring_of(SHARE, SHARE)
    honest, liar = (n.runner for n in nodes)
    assert honest is not None and liar is not None
    honest.schedule_step, liar.schedule_step = 100.0, 1e12
    await asyncio.gather(*(outer_round(n) for n in nodes))
    half = PLACE_ROUNDS * honest.sync.outer_steps / 2  # 8 rounds of H = 50, halved
    assert honest.schedule_step == 100.0 + half
    assert honest.places_clamped == 1  # counted (murmur_sync_places_clamped)


@pytest.mark.parametrize("mixed", [False, True])
async def test_by_default_or_with_one_member_not_sharing_each_keeps_its_own_place(
    nodes: list[Node], mixed: bool
) -> None:
    nodes += await ring_of(SHARE if mixed else {}, {})
    for node, place in zip(nodes, (4.0, 12.0), strict=True):
        assert node.runner is not None
        node.runner.schedule_step = place
    await asyncio.gather(*(outer_round(n) for n in nodes))
    assert [n.runner.schedule_step for n in nodes if n.runner] == [4.0, 12.0]
    assert all(n.sync is not None and n.sync.rounds == {"allreduced": 1} for n in nodes)
