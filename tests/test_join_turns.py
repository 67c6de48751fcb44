"""A joining ``--stage auto`` node's turn-taking (``Node._settle``) in a real node: the
quiet spell it waits, its bound, and its answer when a peer announced its stage first."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from node.config import resolve_config
from node.daemon import Node
from protocol.messages import PeerRecord
from swarm.balance import SETTLE_ROUNDS
from tests.helpers import IN_PROCESS_REPLICA

SETTLE_S = 0.3
ME, LOW, HIGH = "m" * 16, "0" * 16, "z" * 16  # the joiner's id, and one below and above it


@pytest.fixture
async def joiner() -> AsyncIterator[Node]:
    node = Node(
        resolve_config(
            overrides={
                **IN_PROCESS_REPLICA,
                "node.stage": "auto",
                "node.settle_s": SETTLE_S,
                "swarm.num_block_stages": 3,
                "membership.tables": "swarm",  # every record, at any size
            }
        ),
        peer_id=ME,
    )
    await node.start_server()
    try:
        yield node
    finally:
        await node.close()


def announce(
    node: Node,
    stage: int,
    version: int,
    *,
    peer_id: str = LOW,
    settling: bool = True,
    rate: float = 0.0,
) -> None:
    """A peer's record as gossip would bring it: on ``stage``, announced (or taken)."""
    record = PeerRecord(
        peer_id=peer_id,
        address="127.0.0.1:9",
        stage=stage,
        settling=settling,
        version=version,
        throughput=rate,
    )
    node.table.observe(record, node.clock.now())


async def test_a_lone_joiner_takes_its_choice_after_one_quiet_spell(joiner: Node) -> None:
    t0 = time.monotonic()
    stage = await joiner._settle()
    assert stage in range(4) and not joiner.state.settling
    assert SETTLE_S <= time.monotonic() - t0 < 3 * SETTLE_S + 0.5


async def test_on_one_announced_stage_the_lower_id_goes_first(joiner: Node) -> None:
    # a head; stage 2 at 0.5 samples/s, stage 3 at 4; stage 1 empty; we announced stage 1
    announce(joiner, 0, 1, peer_id="h" * 16, settling=False)
    announce(joiner, 2, 1, peer_id="b" * 16, settling=False, rate=0.5)
    announce(joiner, 3, 1, peer_id="c" * 16, settling=False, rate=4.0)
    announce(joiner, 1, 1, peer_id=HIGH)  # a higher id announced stage 1 too: it comes after us
    assert joiner.balancer.choose(announced=1) == 1
    # a lower id announced it too: its turn takes stage 1 (counted as a typical replica,
    # the median 2.25), and ours the weakest of the rest, stage 2 at 0.5
    announce(joiner, 1, 1)
    assert joiner.balancer.choose(announced=1) == 2
    announce(joiner, 1, 2, settling=False)  # it took stage 1: it counts there, as before
    assert joiner.balancer.choose(announced=1) == 2
    announce(joiner, 2, 3, settling=False)  # it took stage 2 instead: stage 1 is ours again
    assert joiner.balancer.choose(announced=1) == 1


async def test_a_peer_that_keeps_changing_its_announcement_delays_a_join_boundedly(
    joiner: Node,
) -> None:
    """A hostile (or broken) peer announcing a new stage under a new id every 0.1 s
    restarts every quiet spell (flipping between two stages under one id restarts it only
    until both are seen); each spell is capped at three times ``settle_s`` and the rounds
    at ``SETTLE_ROUNDS``, so the join still goes ahead."""

    async def flip() -> None:
        version = 1
        while True:
            announce(joiner, 1 + version % 2, version, peer_id=f"{version:016x}")
            version += 1
            await asyncio.sleep(0.1)

    flipping = asyncio.create_task(flip())
    try:
        t0 = time.monotonic()
        stage = await joiner._settle()
        took = time.monotonic() - t0
    finally:
        flipping.cancel()
    assert stage in range(4)
    # the flips kept restarting the quiet spell until its cap, and the rounds are bounded
    assert 3 * SETTLE_S - 0.05 <= took <= SETTLE_ROUNDS * 3 * SETTLE_S + 1.0, took
