"""Poisoned weights: the screening rule, bans, and a gossip partner or recovery source
that sends NaN or scaled weights, on real nodes in this process.

The swarm-level check (a poisoner among real processes, eval loss against a clean run)
is in ``tests/test_poison_processes.py``.
"""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch

from node.daemon import Node
from protocol.messages import PeerRecord
from swarm.admission import RecentIds, TokenBuckets
from swarm.gossip import Contribution
from swarm.routing import Router
from swarm.screen import NON_FINITE, TOO_FAR, ScreenConfig, WeightScreen
from tests.test_hostile import OTHER, start_node

pytestmark = pytest.mark.timeout(60)


# ---- the pure rule ---------------------------------------------------------------------


def test_warm_up_compares_with_the_weights_own_scale() -> None:
    screen = WeightScreen(ScreenConfig(multiple=10.0, window=4, warmup=2))
    assert screen.typical() is None
    assert screen.judge(0.5, scale=0.1) is None  # 5x the weight scale: odd, but allowed
    assert screen.judge(1.5, scale=0.1) == TOO_FAR  # 15x
    assert list(screen.recent) == [0.5]  # refusals never enter the history


def test_after_warm_up_the_median_of_accepted_distances_is_the_reference() -> None:
    screen = WeightScreen(ScreenConfig(multiple=10.0, window=3, warmup=3, floor=1e-3))
    for d in (0.01, 0.02, 0.03):
        assert screen.judge(d, scale=1.0) is None
    assert screen.typical() == pytest.approx(0.02)
    assert screen.judge(0.19, scale=1.0) is None
    assert screen.typical() == pytest.approx(0.03)  # window: 0.02, 0.03, 0.19
    assert screen.judge(0.31, scale=1.0) == TOO_FAR
    assert screen.judge(0.29, scale=1.0) is None


def test_the_reference_never_drops_below_our_own_movement() -> None:
    """A learning-rate warm-up moves every replica further per round: not a poison."""
    screen = WeightScreen(ScreenConfig(multiple=10.0, window=3, warmup=3, floor=1e-3))
    for d in (1e-4, 2e-4, 1e-4):  # early rounds, tiny learning rate
        assert screen.judge(d, scale=0.1, movement=d) is None
    assert screen.judge(5e-3, scale=0.1) == TOO_FAR  # 50x the typical distance...
    assert screen.judge(5e-3, scale=0.1, movement=4e-3) is None  # ...but we moved as far
    assert screen.judge(0.1, scale=0.1, movement=4e-3) == TOO_FAR  # scaled weights still are
    assert "own movement" in screen.describe(0.1, 0.1, movement=4e-3)


def test_honest_drift_after_a_partition_is_not_refused_but_scaled_weights_are() -> None:
    # measured in the netns partition test: twins 30 s apart came back 19x their typical
    # distance (5.4e-3 against 2.8e-4), with weights of RMS ~0.04; the default floor (5 % of
    # the weight scale, so nothing under half of it is refused) lets them average again
    screen = WeightScreen(ScreenConfig(multiple=10.0, window=8, warmup=3))
    for d in (2.5e-4, 2.8e-4, 3.0e-4):
        assert screen.judge(d, scale=0.04) is None
    assert screen.judge(5.4e-3, scale=0.04) is None
    assert screen.judge(0.04 * 999, scale=0.04) == TOO_FAR  # weights x1000
    assert screen.judge(0.04 * 1.0, scale=0.04) == TOO_FAR  # weights x2: one RMS away


def test_non_finite_is_refused_even_with_the_distance_rule_off() -> None:
    screen = WeightScreen(ScreenConfig(multiple=0.0))
    assert screen.judge(math.nan, 1.0) == NON_FINITE
    assert screen.judge(math.inf, 1.0) == NON_FINITE
    assert screen.judge(1e30, 1.0) is None


def test_identical_replicas_do_not_make_every_distance_too_far() -> None:
    screen = WeightScreen(ScreenConfig(multiple=10.0, warmup=1, floor=1e-3))
    assert screen.judge(0.0, scale=1.0) is None
    assert screen.reference(1.0) == pytest.approx(1e-3)
    assert screen.judge(5e-3, scale=1.0) is None
    assert "x the typical distance" in screen.describe(0.5, 1.0)


def test_token_buckets_refill_and_forget_old_keys() -> None:
    buckets = TokenBuckets(rate_per_s=2.0, burst=2.0, max_keys=2)
    assert [buckets.allow("a", 0.0) for _ in range(3)] == [True, True, False]
    assert buckets.allow("a", 0.5)  # one token back after 0.5 s
    assert not buckets.allow("a", 0.5)
    buckets.allow("b", 0.5)
    buckets.allow("c", 0.5)
    assert len(buckets) == 2 and buckets.allow("a", 0.5)  # "a" was forgotten: a full bucket
    assert all(TokenBuckets(0.0, 1.0).allow("x", 0.0) for _ in range(100))


def test_recent_ids_are_bounded() -> None:
    ids = RecentIds(capacity=3)
    for i in range(5):
        ids.add(i)
    assert 1 not in ids and 4 in ids and len(ids) == 3


def test_quarantine_outlives_leave_and_bans_routing() -> None:
    router = Router(random.Random(0), ban_s=1.0)
    peers = [PeerRecord(peer_id=p, address="a:1", stage=1, ready=True) for p in "ab"]
    router.quarantine("a", now=0.0, seconds=100.0)
    router.forget("a")  # it said goodbye: the quarantine stays
    assert router.is_quarantined("a", 50.0) and not router.is_quarantined("a", 100.5)
    assert {router.choose(peers, 50.0).peer_id for _ in range(50)} == {"b"}  # type: ignore[union-attr]
    router.started("a")
    router.finished("a", ok=False, now=60.0)  # a failure's short ban does not shorten it
    assert router.stats["a"].banned_until == 100.0


# ---- a gossip partner's offer on a real node ---------------------------------------------


@pytest.fixture
async def nodes() -> AsyncIterator[Callable[..., Any]]:
    started: list[Node] = []

    async def make(**settings: Any) -> Node:
        started.append(await start_node(**settings))
        return started[-1]

    yield make
    for node in started:
        await node.close()


async def offer(node: Node, poison: str = "") -> Contribution:
    """What a replica at the same point as ``node`` would offer, poisoned as asked."""
    runner = node.runner
    assert runner is not None
    tensors, meta = await runner.compute(runner.outer_contribution, "fp32")
    if poison == "nan":
        tensors = {k: torch.full_like(v, math.nan) for k, v in tensors.items()}
    elif poison.startswith("scale:"):
        tensors = {k: v * float(poison.removeprefix("scale:")) for k, v in tensors.items()}
    elif poison == "malformed":
        meta = {"phi": meta["phi"]}
    return Contribution(tensors, meta)


@pytest.mark.parametrize(
    ("poison", "reason"),
    [("nan", "non_finite"), ("scale:1000", "too_far"), ("malformed", "malformed")],
)
async def test_a_poisoned_partner_is_refused_banned_and_never_chosen(
    nodes: Any, poison: str, reason: str
) -> None:
    node = await nodes()
    sync = node.sync
    assert [p.peer_id for p in sync._partners()] == [OTHER]
    assert await sync._screened(OTHER, await offer(node)) is not None  # a clean one passes
    assert await sync._screened(OTHER, await offer(node, poison)) is None
    assert node.counters[f"weights_refused:gossip:{reason}"] == 1
    assert node.counters["peers_banned"] == 1
    assert node.router.is_quarantined(OTHER, node.clock.now())
    assert sync._partners() == []  # a banned replica is not asked again
    assert sync.status()["typical_distance"] is None  # still warming up: one accepted


async def test_debug_poison_knob_poisons_only_the_outgoing_offer(nodes: Any) -> None:
    node = await nodes(**{"sync.debug_poison": "scale:1000"})
    runner = node.runner
    tensors, meta = await runner.compute(runner.outer_contribution, "fp32")
    assert torch.allclose(tensors["phi"], runner.phi * 1000)
    assert torch.isfinite(runner.phi).all() and float(runner.phi.abs().max()) < 100


# ---- a recovery source on a real node ----------------------------------------------------


@pytest.mark.parametrize(("poison", "reason"), [("nan", "non_finite"), ("scale:1000", "too_far")])
async def test_a_poisoned_state_source_is_refused_and_the_next_one_copied(
    nodes: Any, poison: str, reason: str
) -> None:
    big = {"net.max_frame_bytes": 1 << 26}  # a stage's state is a few MB
    bad, good = await nodes(**big), await nodes(**big)
    with torch.no_grad():
        for p in bad.runner.module.parameters():
            p.copy_(torch.full_like(p, math.nan) if poison == "nan" else p * 1000)
        for p in good.runner.module.parameters():
            p.add_(0.01)
    bad.runner.step, good.runner.step = 9, 5  # the poisoner looks more advanced: asked first
    joiner = Node(bad.config)
    await joiner.http.start()
    try:
        for peer, step in ((bad, 9), (good, 5)):
            joiner.table.observe(
                PeerRecord(peer.peer_id, peer.state.address, stage=1, step=step, ready=True), 0.0
            )
        joiner.state.stage = 1
        await joiner.take_stage(1)
        assert joiner.counters[f"weights_refused:recovery:{reason}"] == 1
        assert joiner.router.is_quarantined(bad.peer_id, joiner.clock.now())
        assert joiner.runner.step == 5  # copied from the clean source
        mine = joiner.runner.module.state_dict()
        theirs = good.runner.module.state_dict()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    finally:
        await joiner.close()
