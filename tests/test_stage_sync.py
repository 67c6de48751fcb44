"""``node.services.sync.StageSync`` on a real stage runner: a clock round's usual steps.

On the clock schedule a NoLoCo replica's pseudo-gradient is read per inner step and scaled
to the stage's usual steps per round (``swarm.outer.scale_by_steps``). A replica that
begins training partway through a round reaches that round's boundary after only part of a
round's steps, at the usual pace. Counted against a whole round's steps it was read as slow
and its first solo step moved its slow weights up to 4x too far (in CI the eval loss went
from 5.13 to 6.47 over the first outer step). A replica's round begins at its first inner
step, so a round it spent with no work does not count either. The test steps a real runner
by hand, puts the wall clock where the round should be, and checks the slow weights
against NoLoCo's rule written out here.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any

import pytest
import torch

from node.config import resolve_config
from node.context import NodeContext, NodeState
from node.services.guard import RequestGuard
from node.services.sync import CLOCK_BACK_WAIT_S, StageSync
from node.stage.runner import StageRunner
from protocol.messages import GossipFollow, GossipRequest, Message, PeerRecord, RingChunk
from protocol.quant import bytes_per_value, encode_tensor
from swarm.peers import PeerTable
from swarm.routing import Router
from swarm.seams import Refused, TransportError

pytestmark = pytest.mark.timeout(60)

ROUND_S = 10.0
STEP_S = 0.5
"""Seconds per inner step the runner reports: 20 usual steps in a 10 s round."""
ALPHA, BETA = 0.5, 0.7  # NoLoCo's defaults (sync.alpha, sync.beta)


class WallClock:
    """Real monotonic time, and a wall clock the test sets."""

    def __init__(self, wall_s: float) -> None:
        self.wall_s = wall_s

    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return self.wall_s

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class NoPeers:
    """The transport of a replica alone in its stage: it never has anyone to ask."""

    async def request(
        self, address: str, msg: Message, timeout_s: float, peer_id: str = ""
    ) -> Message:
        raise AssertionError(f"a lone replica sent {type(msg).__name__} to {address}")


def lone_replica(
    clock: WallClock,
    round_s: float = ROUND_S,
    uplink_bytes_s: float | None = None,
    settings: dict[str, str] | None = None,
    peer_id: str = "a" * 16,
    transport: Any = None,
) -> tuple[StageSync, StageRunner, list[asyncio.Task[None]]]:
    """A replica of stage 1 on the clock schedule, alone in its table; ``round_s`` 0: the
    period is derived (``sync.outer_steps`` 10); its uploads get ``uplink_bytes_s`` (None:
    not known); ``settings`` on top; ``transport``: what reaches its partners (None:
    nobody)."""
    config = resolve_config(
        None,
        {},
        {
            "train.step_samples": "4",
            "sync.method": "noloco",
            "sync.schedule": "clock",
            "sync.round_s": str(round_s),
            "sync.outer_steps": "10",
            "sync.share_schedule": "false",
            **(settings or {}),
        },
    )
    runner = StageRunner(config, 1)
    runner._build()
    tasks: list[asyncio.Task[None]] = []

    def spawn(coro: Coroutine[Any, Any, None]) -> None:
        tasks.append(asyncio.ensure_future(coro))

    ctx = NodeContext(
        config=config,
        peer_id=peer_id,
        num_stages=2,
        state=NodeState(stage=1, ready=True, address="127.0.0.1:1", runner=runner),
        clock=clock,
        rng=random.Random(0),
        table=PeerTable(peer_id, 30.0, 100),
        stages=dict,
        router=Router(random.Random(0)),
        transport=NoPeers() if transport is None else transport,
        counters=Counter(),
        spawn=spawn,
    )
    # its record always as fresh as its runner's figure, unless a test says otherwise
    sync = StageSync(
        ctx,
        runner,
        RequestGuard(ctx),
        clock_offset=lambda: 0.0,
        published_step_s=lambda: runner.step_s,
        uplink_bytes_s=lambda: uplink_bytes_s,
    )
    return sync, runner, tasks


def inner_steps(runner: StageRunner, n: int) -> None:
    for k in range(2 * n):  # two microbatches of two samples a step
        runner.block_forward(str(k), torch.randn(2, 8, 128), train=True)
        runner.block_backward(str(k), torch.randn(2, 8, 128))


async def round_at(
    sync: StageSync, runner: StageRunner, tasks: list, clock: WallClock, wall_s: float
) -> None:
    """Pass the boundary before ``wall_s`` and wait for the outer step (or a solo step of
    nothing, for a replica that had no work)."""
    runner.step_s = STEP_S
    clock.wall_s = wall_s
    before = runner.outer_rounds
    sync.poll()
    assert tasks, "no round started at the boundary"
    await asyncio.gather(*tasks)
    tasks.clear()
    assert runner.outer_rounds == before + 1


async def test_a_replica_that_began_training_late_in_a_round_takes_the_published_solo_step() -> (
    None
):
    clock = WallClock(999_995.0)
    sync, runner, tasks = lone_replica(clock)
    try:
        sync.poll()  # begins serving: the boundary behind it (999_990) is skipped
        phi = runner.phi.clone()
        await round_at(sync, runner, tasks, clock, 1_000_000.1)  # no work yet: nothing to step by
        assert torch.equal(runner.phi, phi)
        clock.wall_s = 1_000_007.5  # three quarters into the round that ends at 1_000_010
        inner_steps(runner, 1)
        sync.poll()  # as after every compute job: its first inner step begins its round
        assert not tasks
        inner_steps(runner, 4)  # 2.5 s at 0.5 s a step: the usual pace
        assert runner.round_steps == 5
        phi, theta = runner.phi.clone(), runner._theta().clone()
        await round_at(sync, runner, tasks, clock, 1_000_010.1)
        # it served a quarter of the round: its usual steps are 5, so the scale is 1 and
        # m = beta * (theta - phi), phi += m (before: 20 usual steps, 4x: phi + 2.8 delta)
        m1 = BETA * (theta - phi)
        assert torch.allclose(runner.phi, phi + m1, atol=1e-6)
        assert torch.allclose(runner._theta(), runner.phi)

        # the next round is a whole one: 10 steps against the usual 20 is a slow replica,
        # its displacement read per step and scaled 2x, as before
        inner_steps(runner, 10)
        phi, theta = runner.phi.clone(), runner._theta().clone()
        await round_at(sync, runner, tasks, clock, 1_000_020.2)
        m2 = ALPHA * m1 + BETA * 2.0 * (theta - phi)
        assert torch.allclose(runner.phi, phi + m2, atol=1e-6)
    finally:
        runner.close()


class SetClock(WallClock):
    """A monotonic clock the test sets too."""

    def __init__(self, wall_s: float) -> None:
        super().__init__(wall_s)
        self.mono_s = 0.0

    def now(self) -> float:
        return self.mono_s


async def test_rounds_restart_from_a_stage_clock_that_stays_set_back() -> None:
    """Rounds on 10 s boundaries, the last at 1_000_010. The stage's clock then reads half
    an hour back (of two replicas, one set back an hour: each moves halfway). Rounds only
    move forward, so before the fix the replica waited for 1_000_020 again: half an hour
    without an outer step. Now a clock back for less than CLOCK_BACK_WAIT_S (a replica's own
    clock, set and then measured against its partners' again) resumes where it was; one
    that stays back restarts the rounds from its reading, the next boundary ten seconds on."""
    clock = SetClock(1_000_005.0)
    sync, runner, tasks = lone_replica(clock)
    try:
        sync.poll()
        inner_steps(runner, 2)
        sync.poll()
        await round_at(sync, runner, tasks, clock, 1_000_010.1)
        assert sync.last_round == 1_000_010_000

        # back briefly: no round, and the old grid resumes when it comes forward again
        clock.wall_s = 1_000_012.0 - 1800
        sync.poll()
        clock.mono_s += CLOCK_BACK_WAIT_S - 1
        sync.poll()
        assert not tasks and sync.clock_restarts == 0
        clock.wall_s = 1_000_015.0
        sync.poll()
        assert not tasks and sync.last_round == 1_000_010_000
        await round_at(sync, runner, tasks, clock, 1_000_020.1)

        # back for good: after CLOCK_BACK_WAIT_S the rounds restart from the new reading;
        # a DiLoCo partner's chunks for the old grid's next round would meet its id again
        # in half an hour, and go; those for the new grid's stay
        tensors, meta = encode_tensor(torch.ones(4), "fp32")
        for boundary in (1_000_030_000, 998_260_000):
            chunk = RingChunk(f"diloco:1:{boundary}", "h", "reduce", 0, meta, tensors=tensors)
            sync.ring.deliver(chunk)
        back = 1_000_021.0 - 1800
        clock.wall_s = back
        sync.poll()
        clock.mono_s += CLOCK_BACK_WAIT_S
        clock.wall_s = back + CLOCK_BACK_WAIT_S
        sync.poll()
        assert not tasks and sync.clock_restarts == 1
        assert sync.last_round == 998_250_000  # the boundary behind the reading
        assert sync.status()["clock_restarts"] == 1
        assert sync.ring.round_ids() == ["diloco:1:998260000"]
        inner_steps(runner, 2)
        before = runner.outer_rounds
        await round_at(sync, runner, tasks, clock, 998_260.1)  # the next: ten seconds on
        assert runner.outer_rounds == before + 1 and sync.rounds["solo"] >= 3
    finally:
        runner.close()


def test_a_replica_takes_up_the_shorter_period_its_partner_publishes() -> None:
    """H = 10 steps of 0.45 s: 4.5 s, which both 4 s and 8 s keep under hysteresis. A
    replica left on 8 s (a slow step once) keeps it alone, and goes over to 4 s once its
    partner's record says it runs on 4 s; its own record then says 4 s too."""
    sync, runner, _ = lone_replica(WallClock(1_000_000.0), round_s=0.0)
    runner.step_s = 0.45
    sync.period = 8.0
    assert sync._round_period() == 8.0 and sync.round_s == 8.0
    partner = PeerRecord("b" * 16, "127.0.0.1:2", 1, ready=True, step_s=0.45, round_s=4.0)
    sync.ctx.table.observe(partner, time.monotonic())
    sync._stage_checked = -math.inf  # the stage is read again at most once a second
    assert sync._round_period() == 4.0 and sync.round_s == 4.0
    # a partner on a grid no derived schedule takes (5 s) moves nobody
    sync.period = 8.0
    sync.ctx.table.observe(replace(partner, round_s=5.0, version=1), time.monotonic())
    sync._stage_checked = -math.inf
    assert sync._round_period() == 8.0


def test_the_period_is_derived_from_the_step_times_as_published_its_own_too() -> None:
    """H = 10; two replicas on 4 s rounds (4 s holds H median steps up to 5 s). This one's
    runner now reads 0.6 s a step, but its record still says 0.45 s, as its partner's does:
    it reads the stage as its partner does, 4.5 s, and stays on 4 s. Read fresh, the median
    of 0.45 and 0.6 put it at 5.25 s, and it alone went to 8 s until its partner read its
    next record. Once its record says 0.6 s, both read 5.25 s and both move to 8 s."""
    sync, runner, _ = lone_replica(WallClock(1_000_000.0), round_s=0.0)
    published = {"step_s": 0.45}
    sync.published_step_s = lambda: published["step_s"]
    sync.period = 4.0
    runner.step_s = 0.6
    partner = PeerRecord("b" * 16, "127.0.0.1:2", 1, ready=True, step_s=0.45, round_s=4.0)
    sync.ctx.table.observe(partner, time.monotonic())
    sync._stage_checked = -math.inf
    assert sync._round_period() == 4.0
    assert sync._ref_steps(1.0) == pytest.approx(4.0 / 0.45)  # the usual steps, as published
    published["step_s"] = 0.6
    sync._stage_checked = -math.inf
    assert sync._round_period() == 8.0
    # nothing published yet (a replica that just started): no period derived
    fresh, fresh_runner, _ = lone_replica(WallClock(1_000_000.0), round_s=0.0)
    fresh_runner.step_s = 0.45
    fresh.published_step_s = lambda: 0.0
    assert fresh._round_period() is None


@pytest.mark.parametrize("mbit, given_s", [(None, 12.57), (0.3, 60.0), (1.0, 35.72), (20.0, 12.57)])
async def test_a_replica_says_when_its_uplink_cannot_carry_its_contribution_in_time(
    mbit: float | None, given_s: float, caplog: pytest.LogCaptureFixture
) -> None:
    """A contribution takes its bytes over the rate this node's uploads get; a partner waits
    ``sync.request_timeout_s`` (10 s) plus its bytes at ``sync.min_link_mbps`` (10 Mbit/s),
    or, where the proposal announced a longer upload, that upload plus 10 s, up to
    ``sync.max_upload_wait_s`` (60 s). Stage 1's contribution here (slow weights and
    pseudo-gradient, fp32) is 3.2 MB: 1.3 s at 20 Mbit/s (12.6 s given); 25.7 s at 1 Mbit/s,
    announced, so 35.7 s given; 85.7 s at 0.3 Mbit/s against the 60 s bound, too thin.
    Before any rate is known nothing is judged. Rounds of 100 s carry any of these
    exchanges that a partner waits for."""
    clock = WallClock(999_995.0)
    rate = None if mbit is None else mbit * 125_000
    fixed = {"sync.codec": "fp32"}  # the default, auto, would take int8 at 1 Mbit/s
    sync, runner, tasks = lone_replica(clock, 100.0, uplink_bytes_s=rate, settings=fixed)
    try:
        sync.poll()
        inner_steps(runner, 2)
        sync.poll()
        await round_at(sync, runner, tasks, clock, 1_000_000.1)
        nbytes = sum(p.numel() for p in runner.module.parameters()) * 4 * 2
        status = sync.status()
        if rate is None:
            assert status["contribution_send_s"] is None
        else:
            assert status["contribution_send_s"] == pytest.approx(nbytes / rate, abs=0.05)
        assert status["contribution_given_s"] == pytest.approx(given_s, abs=0.05)
        thin = mbit == 0.3
        assert status["uplink_too_thin"] is thin
        assert sync.ctx.counters["gossip_uplink_too_thin"] == thin
        warned = [r for r in caplog.records if "too thin for NoLoCo" in r.getMessage()]
        assert len(warned) == thin
        if thin:
            assert "int8 quarters it" in warned[0].getMessage()
    finally:
        runner.close()


@pytest.mark.parametrize(
    "round_s, partners, exchange_s, start, multiple",
    [
        (20.0, [], 16.0, 1, 1),
        (10.0, [], 16.0, 1, 2),
        (10.0, [1.5, 1.0, 2.0], 9.5, 1, 1),
        (10.0, [1.0, 1.5, 40.0], 9.5, 1, 1),
        (10.0, [30.0, 1.0, 30.0], 16.0, 1, 2),
        (1.5, [], 16.0, 4, 8),
    ],
)
async def test_a_replica_whose_exchange_outlasts_the_round_takes_every_few_rounds(
    round_s: float,
    partners: list[float],
    exchange_s: float,
    start: int,
    multiple: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Stage 1's fp32 contribution (3.2 MB) takes 8.0 s at 3.2 Mbit/s, within the 18 s a
    partner waits (announced: 10 s more). An exchange is that upload, then the partner's:
    with no partner's time known, as long again, 16 s. That fits a 20 s round, but not a
    10 s one: the replica would reach its next round late, and its partners' proposals there
    meet ``not_ready`` or ``stale``. So from the next boundary it takes every 2nd round of
    the stage (20 s carry 16 s; 40 s would hold 1.5 x 16 s, but it goes up at most twice as
    many at a time), publishes 20 s, and (``sync.follow`` off; with it, the next test) skips
    the boundaries between. Recent partners
    that announced 1.5, 1 and 2 s (median 1.5) make the exchange 9.5 s, which a 10 s
    round carries; one partner announcing 40 s among them moves the median nowhere.
    Partners slower than this replica (median 30 s) count as long as its own: 16 s, as with
    none known. Behind 1.5 s rounds, spanning four (6 s) already, even eight (12 s) are too
    short: it is counted, warned and told to take rounds of at least 10 s (1.5 x 16 s over
    eight, rounded up)."""
    clock = WallClock(999_995.0)
    fixed = {"sync.codec": "fp32", "sync.follow": "false"}
    sync, runner, tasks = lone_replica(clock, round_s, uplink_bytes_s=400_000.0, settings=fixed)
    sync.partner_uploads.extend(partners)
    sync.round_multiple = start
    thin = exchange_s > multiple * round_s
    try:
        sync.poll()
        inner_steps(runner, 2)
        sync.poll()
        await round_at(sync, runner, tasks, clock, 1_000_000.1)
        status = sync.status()
        assert status["contribution_send_s"] == pytest.approx(8.0, abs=0.1)
        assert status["contribution_given_s"] == pytest.approx(18.0, abs=0.1)
        assert status["round_multiple"] == multiple
        assert status["round_s"] == status["contribution_round_s"] == multiple * round_s
        assert status["contribution_exchange_s"] == pytest.approx(exchange_s, abs=0.2)
        assert status["uplink_too_thin"] is thin
        assert sync.ctx.counters["gossip_uplink_too_thin"] == thin
        logged = [r.getMessage() for r in caplog.records]
        spans = [m for m in logged if "pairs in those" in m]
        assert len(spans) == (multiple != start)
        if round_s == 10.0 and multiple == 2:
            assert "takes every 2nd round from the next (20 s)" in spans[0]
            # the boundaries between its own are not its rounds
            clock.wall_s = 1_000_010.1
            sync.poll()
            assert not tasks
            await round_at(sync, runner, tasks, clock, 1_000_020.1)
        warned = [m for m in logged if "too thin for NoLoCo" in m]
        assert len(warned) == thin
        if thin:
            assert "exchange takes about 16 s, longer than a 12 s round" in warned[0]
            assert "sync.codec = auto, the default" in warned[0]
            assert "or rounds of at least 10 s" in warned[0]
            assert "max_upload_wait_s" not in warned[0]  # a partner waits long enough
    finally:
        runner.close()


class Direct:
    """A transport that hands NoLoCo requests to the addressed replica's ``StageSync``."""

    def __init__(self) -> None:
        self.syncs: dict[str, StageSync] = {}
        self.sent: list[tuple[str, str]] = []
        """(message type, address) of every request, in order."""

    async def request(
        self, address: str, msg: Message, timeout_s: float, peer_id: str = ""
    ) -> Message:
        self.sent.append((msg.TYPE, address))
        sync = self.syncs[address]
        try:
            if isinstance(msg, GossipFollow):
                return await sync.on_follow(msg)
            assert isinstance(msg, GossipRequest), msg
            return await sync.on_gossip(msg)
        except Refused as e:  # an Error reply, as the server sends it
            raise TransportError(e.code, e.message) from None


async def test_a_replica_that_spans_rounds_follows_a_partner_in_those_between() -> None:
    """Two replicas on 10 s rounds: ``fat`` takes every round, ``thin`` every 2nd
    (``round_multiple`` 2, published as 20 s rounds) and follows in those between. At the
    boundary 1_000_010, off thin's grid, fat has nobody to pair with (thin publishes no
    round there) and steps solo; thin sends one ``GossipFollow`` and steps with fat's
    contribution to that round, which fat never hears back from: NoLoCo's rule for a pair,
    applied on thin's side only, written out here (``sync.scale_by_steps`` off, so the
    published rule: ``m = beta * mean(d) + gamma * (mean(phi) - phi)``, momentum zero before).
    Fat's slow weights take its solo step, as if thin did not exist. At 1_000_020 both
    take the round and pair (thin proposes or is proposed to: no follow). At 1_000_040
    fat is done with the round before thin seeks it (thin's proposal hears ``stale``):
    thin follows fat in its own round instead of stepping solo."""
    clock = WallClock(1_000_005.0)
    net = Direct()
    fixed = {"sync.codec": "fp32", "sync.scale_by_steps": "false"}
    ids = {"fat": "f" * 16, "thin": "7" * 16}
    made = {
        name: lone_replica(clock, 10.0, settings=fixed, peer_id=peer_id, transport=net)
        for name, peer_id in ids.items()
    }
    (fat, fat_runner, fat_tasks), (thin, thin_runner, thin_tasks) = made["fat"], made["thin"]
    thin.round_multiple = 2
    now = time.monotonic()
    for name, sync in (("fat", fat), ("thin", thin)):
        net.syncs[name] = sync
        other = "thin" if name == "fat" else "fat"
        published = 20.0 if other == "thin" else 10.0
        sync.ctx.table.observe(
            PeerRecord(ids[other], other, 1, ready=True, round_s=published, step_s=STEP_S), now
        )
    try:
        for sync in (fat, thin):
            sync.poll()  # begins serving: the boundary behind it is skipped
        torch.manual_seed(0)
        inner_steps(fat_runner, 3)
        inner_steps(thin_runner, 2)
        phi_f, d_f = fat_runner.phi.clone(), fat_runner._theta() - fat_runner.phi
        phi_t, d_t = thin_runner.phi.clone(), thin_runner._theta() - thin_runner.phi
        clock.wall_s = 1_000_010.1
        for runner in (fat_runner, thin_runner):
            runner.step_s = STEP_S
        fat.poll()
        thin.poll()
        assert fat_tasks and thin_tasks, "both take the round at 1_000_010"
        await asyncio.gather(*fat_tasks, *thin_tasks)
        fat_tasks.clear()
        thin_tasks.clear()
        assert net.sent == [("gossip_follow", "fat")]
        assert thin.rounds == Counter(followed=1) and fat.rounds == Counter(solo=1)
        assert fat.gossip.num_followers == 1 and thin.follow_requests == 1
        m_t = BETA * (d_t + d_f) / 2 + BETA * ((phi_t + phi_f) / 2 - phi_t)  # gamma = beta
        assert torch.allclose(thin_runner.phi, phi_t + m_t, atol=1e-6)
        assert torch.allclose(fat_runner.phi, phi_f + BETA * d_f, atol=1e-6)
        status = thin.status()
        assert status["rounds"] == {"followed": 1} and status["follow_requests"] == 1
        assert fat.status()["followers_answered"] == 1

        inner_steps(fat_runner, 2)
        inner_steps(thin_runner, 1)
        clock.wall_s = 1_000_020.1
        fat.poll()
        thin.poll()
        assert fat_tasks and thin_tasks, "both take the round at 1_000_020"
        await asyncio.gather(*fat_tasks, *thin_tasks)
        assert thin.rounds["paired"] == 1 and fat.rounds["paired"] == 1
        assert [t for t, _ in net.sent[1:]].count("gossip_follow") == 0

        inner_steps(fat_runner, 2)
        inner_steps(thin_runner, 2)
        # fat now reads thin's rounds as 30 s ones, so it does not wait for thin at 1_000_040
        record = PeerRecord(
            ids["thin"], "thin", 1, ready=True, round_s=30.0, step_s=STEP_S, version=1
        )
        assert fat.ctx.table.observe(record, time.monotonic())
        clock.wall_s = 1_000_040.1
        fat.poll()
        await asyncio.gather(*fat_tasks)
        assert fat.rounds["solo"] == 2
        del net.sent[:]
        thin.poll()
        assert thin_tasks, "thin takes the round at 1_000_040"
        await asyncio.gather(*thin_tasks)
        assert net.sent == [("gossip_request", "fat"), ("gossip_follow", "fat")]
        assert thin.rounds == Counter(followed=2, paired=1) and thin.follow_requests == 2
        assert fat.gossip.num_followers == 2
    finally:
        fat_runner.close()
        thin_runner.close()


def test_partners_whose_published_period_skips_this_round_are_not_asked() -> None:
    """On 10 s rounds, at the boundary 1_000_010 s: a partner on 10 s rounds and one that
    published nothing yet are asked; one taking every 2nd round (20 s) takes 1_000_020,
    not this one, and is not; at 1_000_020 all three are."""
    clock = WallClock(1_000_010.5)
    sync, runner, _ = lone_replica(clock, 10.0)
    try:
        now = time.monotonic()
        for n, published in enumerate((10.0, 0.0, 20.0)):
            record = PeerRecord(f"{n}" * 16, f"127.0.0.1:{n + 2}", 1, ready=True, round_s=published)
            sync.ctx.table.observe(record, now)
        sync.last_round = 1_000_010_000
        assert sorted(p.round_s for p in sync._partners()) == [0.0, 10.0]
        sync.last_round = 1_000_020_000
        assert sorted(p.round_s for p in sync._partners()) == [0.0, 10.0, 20.0]
    finally:
        runner.close()


@pytest.mark.parametrize(
    "mbit, codec, thin",
    [
        (None, "fp32", False),
        (20.0, "fp32", False),
        (1.5, "bf16", False),
        (1.0, "int8", False),
        (0.4, "int8", False),
        (0.08, "int8", True),
    ],
)
async def test_sync_codec_auto_sends_the_most_precise_contribution_that_arrives_in_time(
    mbit: float | None, codec: str, thin: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Stage 1 here has 401,920 weights: its contribution (slow weights and pseudo-gradient)
    is 3.2 MB in fp32, 1.6 MB in bf16, 0.81 MB in int8; a partner waits 10 s plus its bytes
    at 10 Mbit/s. At 1.5 Mbit/s fp32 takes 17.1 s (given 12.6 s), bf16 8.6 s (given 11.3 s):
    bf16. At 1 Mbit/s bf16 takes 12.9 s, int8 6.4 s (given 10.6 s): int8. At 0.4 Mbit/s int8
    takes 16.1 s: nothing fits, so the most compact, announced with the proposal (a partner
    waits 26.1 s). At 0.08 Mbit/s int8 takes 80.9 s, past the 60 s a partner waits at most,
    and the node is told that only a higher sync.max_upload_wait_s would let it pair. Before
    a rate is known: fp32, the published rule. Rounds of 100 s carry these exchanges."""
    clock = WallClock(999_995.0)
    rate = None if mbit is None else mbit * 125_000
    auto = {"sync.codec": "auto"}
    sync, runner, tasks = lone_replica(clock, 100.0, uplink_bytes_s=rate, settings=auto)
    try:
        sync.poll()
        inner_steps(runner, 2)
        sync.poll()
        await round_at(sync, runner, tasks, clock, 1_000_000.1)
        numel = 2 * sum(p.numel() for p in runner.module.parameters())
        status = sync.status()
        assert (status["codec"], status["codec_setting"]) == (codec, "auto")
        assert status["uplink_too_thin"] is thin
        if rate is not None:  # what was judged is what was encoded: the chosen codec's bytes
            sent = status["contribution_send_s"] * rate
            assert sent == pytest.approx(numel * bytes_per_value(codec), rel=0.01, abs=rate * 0.05)
        warned = [r.getMessage() for r in caplog.records if "too thin for NoLoCo" in r.getMessage()]
        assert len(warned) == thin
        if thin:
            assert "in int8" in warned[0] and "A higher sync.max_upload_wait_s" in warned[0]
            assert "sync.codec = auto" not in warned[0]
    finally:
        runner.close()
