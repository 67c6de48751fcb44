"""Outer synchronisation of a stage's replicas, as the daemon runs it.

NoLoCo (arXiv 2506.10911), DiLoCo (arXiv 2311.08105) or plain data parallelism; the update
rules are ``swarm.outer``'s, the rules in words in ``docs/algorithms.md``. NoLoCo and DiLoCo
rounds happen on a wall-clock grid shared by the stage's replicas (``sync.schedule =
"clock"``, ``swarm.schedule``: replicas of unequal speed still meet), or every H inner steps
of each replica (``"steps"``, the papers' lockstep rule); data parallel all-reduces at every
inner step.

Owns the glue between the runner (which holds its optimizer steps when a round is due,
while forward and backward keep flowing) and the swarm services that move the bytes:
``swarm.gossip`` for NoLoCo, ``swarm.allreduce`` for DiLoCo and data parallel. A round's
torch work (snapshots, encoding, the update rules) runs on the compute thread; the event
loop only waits on the network. Every round ends in a defined way: NoLoCo paired, followed
(``swarm.gossip``, point 7: a replica spanning rounds, in those between, and in its
own where no partner was free) or solo;
DiLoCo and data parallel all-reduced or, when the ring fails, solo (each replica applies
its own pseudo-gradient or gradient). A NoLoCo partner's offer passes ``swarm.screen``
first: one that is malformed, not finite or too far from this replica is refused (solo
step) and the partner banned (``node.services.guard``); banned peers are never chosen as partners.
Also keeps the statistics ``node status`` and the metrics show.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import torch

from node.config import SyncConfig
from node.context import NodeContext
from node.logs import RateLimitedLog
from node.services.guard import RequestGuard
from node.stage.outer import Offer
from node.stage.runner import StageRunner
from protocol.messages import GossipFollow, GossipReply, GossipRequest, Hop, PeerRecord, RingChunk
from protocol.quant import tensor_bytes
from swarm.allreduce import RingAllReduce, RingFailed
from swarm.gossip import Contribution, GossipConfig, GossipService
from swarm.schedule import (
    MAX_ROUND_MULTIPLE,
    PACE_ROUNDS,
    ROUND_ROOM,
    round_multiple,
    round_period,
    round_share,
)
from swarm.screen import ScreenConfig, WeightScreen
from swarm.seams import Refused
from swarm.wirecodec import SYNC_CANDIDATES, sync_codec, sync_codec_unmeasured

log = logging.getLogger(__name__)

THIN_GOSSIP_WARNING_EVERY_S = 300.0
"""How often a replica whose uplink cannot carry its NoLoCo contribution in time says so."""

PARTNER_UPLOADS = 8
"""Recent partners' announced upload times an exchange's length is estimated from (their
median: a partner that announces a wrong time moves it only with half of them)."""


def weight_screen(config: SyncConfig) -> WeightScreen:
    """The screen a replica puts its partners' offers through, as configured."""
    return WeightScreen(
        ScreenConfig(
            multiple=config.screen_multiple,
            window=config.screen_window,
            warmup=config.screen_warmup,
        )
    )


class StageSync:
    """Runs outer rounds for this node's stage replica."""

    def __init__(
        self,
        ctx: NodeContext,
        runner: StageRunner,
        guard: RequestGuard,
        *,
        clock_offset: Callable[[], float],
        published_step_s: Callable[[], float],
        uplink_bytes_s: Callable[[], float | None],
    ) -> None:
        """``clock_offset()``: what to add to this machine's wall clock to read the stage's
        (``swarm.membership.MembershipService.stage_offset_s``). ``published_step_s()``: this
        replica's seconds per inner step as its record last told its partners (0: not yet),
        the figure the stage's step times are read with (``_step_times``).
        ``uplink_bytes_s()``: the rate an outer sync's upload gets, what the hops leave of the
        rate their receivers report, which one timed-out hop does not lower (None: not known
        yet; ``node.pipeline.HopSender.sync_bytes_s``)."""
        self.ctx = ctx
        self.runner = runner
        self.guard = guard
        self.clock_offset = clock_offset
        self.published_step_s = published_step_s
        self.uplink_bytes_s = uplink_bytes_s
        self.contribution_send_s: float | None = None
        """Seconds this replica's last NoLoCo contribution takes to upload at that rate."""
        self.contribution_given_s: float | None = None
        """Seconds a partner waits for it (``swarm.gossip.GossipConfig``)."""
        self.contribution_round_s: float | None = None
        """The clock round's seconds it was judged against (None: rounds by steps)."""
        self.partner_uploads: deque[float] = deque(maxlen=PARTNER_UPLOADS)
        """The upload seconds this replica's recent NoLoCo partners announced (those that
        said: ``swarm.gossip.Contribution.upload_s``), the latest last."""
        self._thin_log = RateLimitedLog(log, THIN_GOSSIP_WARNING_EVERY_S)
        self.codec: str = sync_codec_unmeasured(ctx.config.sync.codec)
        """The codec of this replica's last outer-sync transfer (``sync.codec``, or what
        ``auto`` chose for it)."""
        self.offset_s = 0.0
        """The stage's clock minus this machine's, as last read (seconds)."""
        self._told_offset_s = 0.0
        self._back_since: float | None = None
        """Since when (monotonic) the stage's clock has read more than a round before the
        last round taken (``_clock_went_back``)."""
        self.clock_restarts = 0
        """Times the rounds restarted from a stage clock that was set back."""
        self.stage = runner.stage
        self.config = ctx.config.sync
        self.method = self.config.method
        self.rounds: Counter[str] = Counter()
        self.seconds_sum = 0.0
        self.seconds_count = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.proposals = 0
        """NoLoCo proposals this replica made, over all its rounds."""
        self.follow_requests = 0
        """``GossipFollow`` requests this replica made (``swarm.gossip``, point 7)."""
        self.spread_rms: float | None = None
        self.spread_sum = 0.0
        self.spread_count = 0
        self.spread_history: deque[tuple[int, float]] = deque(maxlen=256)
        self.last_partner: str | None = None
        self.running = False
        """A round is in progress (a stage move waits for it)."""
        self.clocked = self.method in ("noloco", "diloco") and self.config.schedule == "clock"
        self.period: float | None = None
        """Seconds per round on the clock schedule (None until the stage's step times are
        known, when derived)."""
        self.round_multiple = 1
        """How many of the stage's clock rounds one round of this replica spans: more than
        one where its NoLoCo exchange outlasts the stage's round
        (``swarm.schedule.round_multiple``). With ``sync.follow`` it follows a partner in
        the stage's rounds between (``_follows_between``)."""
        self._stage_checked = -math.inf
        self.last_round = -1
        """The id of the last round started: a grid boundary in ms, or an outer step count."""
        self._round_began_ms: int | None = None
        """Where this replica's current clock round began on the stage's clock: the
        boundary of its last outer step, or its first inner step (a replica serving with no
        work yet, its pipeline incomplete, is not training; ``swarm.schedule.round_share``)."""
        self._join_round: int | None = None
        """A later clock round a partner is in: taken next, at once."""
        self.gossip = GossipService(
            GossipConfig(
                request_timeout_s=self.config.request_timeout_s,
                hold_s=self.config.hold_s,
                round_deadline_s=self.config.round_deadline_s,
                listen_s=self.config.listen_s,
                min_rate_bytes_s=self.config.min_link_mbps * 125_000,
                max_upload_wait_s=self.config.max_upload_wait_s,
            ),
            transport=ctx.transport,
            clock=ctx.clock,
            rng=ctx.rng,
            self_id=ctx.peer_id,
            stage=self.stage,
            replicas=self._partners,
        )
        self.screen = weight_screen(self.config)
        self.ring = RingAllReduce(
            ctx.transport,
            ctx.clock,
            ctx.peer_id,
            codec=sync_codec_unmeasured(self.config.codec),
            step_timeout_s=self.config.ring_step_timeout_s,
            max_held_bytes=self.config.ring_inbox_bytes,
            min_rate_bytes_s=self.config.min_link_mbps * 125_000,
            compute=runner.compute,
        )

    def _partners(self) -> list[PeerRecord]:
        """Live replicas of our stage that gossip may pair with: banned ones are skipped,
        and on the clock schedule so are those whose published period puts no boundary at
        this round's (one taking every other round, ``round_multiple``, or one still on a
        coarser grid): asked, they would hold the proposal and answer ``not_ready``."""
        now = self.ctx.clock.now()
        boundary = self.last_round if self.clocked else None
        return [
            p
            for p in self.ctx.table.replicas(self.stage)
            if not self.ctx.router.is_quarantined(p.peer_id, now)
            and (boundary is None or _on_grid(boundary, p.round_s))
        ]

    # ---- incoming -----------------------------------------------------------------------

    async def on_gossip(self, req: GossipRequest) -> GossipReply:
        if self.method != "noloco":
            raise Refused("no_gossip", f"this replica synchronises with {self.method}, not noloco")
        return await self.gossip.handle_request(req)

    async def on_follow(self, req: GossipFollow) -> GossipReply:
        if self.method != "noloco":
            raise Refused("no_gossip", f"this replica synchronises with {self.method}, not noloco")
        return await self.gossip.handle_follow(req)

    def on_ring_chunk(self, chunk: RingChunk) -> None:
        if self.method not in ("diloco", "allreduce"):
            raise Refused("no_ring", f"this replica synchronises with {self.method}, not a ring")
        kind, stage, number = _parse_round_id(chunk.round_id)
        if kind not in ("diloco", "dp") or not number.isdigit() or len(number) > 18:
            raise Refused("bad_round_id", f"ring round id {chunk.round_id[:64]!r}", 400)
        if stage != str(self.stage):
            raise Refused("wrong_stage", f"ring round of stage {stage[:8]}, not {self.stage}")
        self.ring.deliver(chunk)

    # ---- rounds -------------------------------------------------------------------------

    def poll(self) -> None:
        """Start a round if one is due (a grid boundary passed, or the runner counted H
        steps or holds gradients for data parallel), none is running and the replica serves
        (not while it joins, moves or leaves). The daemon calls it after every compute job
        and once a second, so a replica without work still keeps the clock."""
        if self.running or not self.ctx.state.serving:
            return
        if self.clocked:
            boundary = self._boundary_due()
            if boundary is not None:
                self.running = True
                self.ctx.spawn(self._clock_round(boundary))
        elif self.runner.sync_due is not None:
            self.running = True
            self.ctx.spawn(self._round(self.runner.sync_due, self.runner.outer_rounds))

    def _round_period(self) -> float | None:
        """The clock schedule's period: set, or derived from the stage's step times. The
        stage is looked at again (its step times, its clock) at most once a second: this
        runs after every job."""
        now = self.ctx.clock.now()
        if now - self._stage_checked >= 1.0:
            self._stage_checked = now
            self._read_offset()
            if self.config.round_s <= 0:
                partners = [p.round_s for p in self.ctx.table.replicas(self.stage)]
                self.period = round_period(
                    self._step_times(), self.config.outer_steps, self.period, partners
                )
            if period := self._period_s():  # the pace's window: the last rounds
                self.runner.pace.window_s = PACE_ROUNDS * period
        return self._period_s()

    @property
    def round_s(self) -> float:
        """The period this replica's rounds run on, as its record publishes it (0: none
        yet, or not on the clock schedule)."""
        return (self._period_s() or 0.0) if self.clocked else 0.0

    def _grid_s(self) -> float | None:
        """Seconds between the boundaries this replica takes: its period, or the stage's
        where it spans rounds and follows in those between (``_follows_between``)."""
        return self._stage_period_s() if self._follows_between() else self._period_s()

    def _follows_between(self) -> bool:
        """Whether this replica follows a partner (``swarm.gossip``, point 7) in the
        stage's rounds between those its own rounds span: NoLoCo, ``sync.follow``, and a
        span of more than one round."""
        return self.method == "noloco" and self.config.follow and self.round_multiple > 1

    def _period_s(self) -> float | None:
        """The period this replica's clock rounds run on: the stage's, times the rounds one
        of its rounds spans (None: not known yet)."""
        stage_s = self._stage_period_s()
        return None if stage_s is None else stage_s * self.round_multiple

    def _stage_period_s(self) -> float | None:
        """The stage's clock period: set, or as last derived (None: not yet)."""
        return self.config.round_s if self.config.round_s > 0 else self.period

    def _step_times(self) -> list[float]:
        """Seconds per inner step of the stage's replicas, this one included (0: unknown),
        each as its record published it, its own too: every replica then reads the same
        figures, and so derives the same period and the same usual steps per round. With its
        own figure fresh and its partners' as published, a median near a band's edge read
        on either side of it for a refresh at a time, and two replicas could settle on
        different periods (``swarm.schedule.round_period``)."""
        partners = [p.step_s for p in self.ctx.table.replicas(self.stage)]
        return [*partners, self.published_step_s()]

    def _boundary_due(self) -> int | None:
        """The latest grid boundary (ms since the epoch) passed and not taken yet, if any. A
        replica that starts serving skips the boundary already behind it."""
        join, self._join_round = self._join_round, None
        if join is not None and join > self.last_round:
            return join  # a partner is in it already (``_unless_superseded``)
        period = self._round_period()
        if self._round_began_ms is None and self.runner.round_steps > 0:
            self._round_began_ms = self._stage_ms()  # its first inner step: its first round
        grid = self._grid_s()
        if period is None or grid is None:
            return None
        period_ms = round(grid * 1000)
        latest = self._stage_ms() // period_ms * period_ms
        if self.last_round < 0:
            self.last_round = latest
            return None
        if latest < self.last_round - period_ms:
            self._clock_went_back(latest, period)
            return None
        self._back_since = None
        return latest if latest > self.last_round else None

    def _clock_went_back(self, latest: int, period: float) -> None:
        """The stage's clock reads more than a round before the last round taken (a
        replica's clock was set back). A clock that comes forward again within
        ``max(CLOCK_BACK_WAIT_S, period)`` (this machine's own, set and then measured
        against its partners' again) resumes the rounds where they were; one that stays
        back (two replicas, one set back an hour, each moved halfway) restarts them from
        where it now reads, as a replica that begins serving does, instead of waiting out
        the whole step."""
        now = self.ctx.clock.now()
        back_s = (self.last_round - latest) / 1000
        if self._back_since is None:
            self._back_since = now
            log.warning(
                "clock: stage %d's clock went back %.0f s (a replica's clock was set back); "
                "outer rounds restart from its new reading if it stays back for %.0f s",
                self.stage,
                back_s,
                max(CLOCK_BACK_WAIT_S, period),
            )
        elif now - self._back_since >= max(CLOCK_BACK_WAIT_S, period):
            log.warning(
                "clock: stage %d's clock stayed %.0f s back; outer rounds restart from it",
                self.stage,
                back_s,
            )
            self._back_since = None
            self.clock_restarts += 1
            self.last_round = latest
            self.gossip.rewind(latest)
            # chunks partners sent for the old grid's rounds, ahead of the new reading, would
            # meet those round ids again
            self.forget_stale_rounds(self._stage_ms() + round(period * 1000) + CLOCK_SKEW_MS)
            self._round_began_ms = latest if self.runner.round_steps > 0 else None

    def _stage_ms(self) -> int:
        """The stage's clock, ms since the epoch, on which its rounds' grid lies: this
        machine's wall clock plus the offset its pings measured (``_read_offset``)."""
        return round((self.ctx.clock.wall() + self.offset_s) * 1000)

    def _read_offset(self) -> None:
        """Read the stage's clock offset again; one that moved by a second or more since it
        was last told is logged."""
        self.offset_s = self.clock_offset()
        if abs(self.offset_s - self._told_offset_s) >= 1.0:
            self._told_offset_s = self.offset_s
            if abs(self.offset_s) < 1.0:
                log.info("clock: this machine's clock agrees with stage %d's", self.stage)
            else:
                log.warning(
                    "clock: this machine's clock is %.1f s %s stage %d's (the median of its "
                    "replicas'); outer rounds follow the stage's",
                    abs(self.offset_s),
                    "behind" if self.offset_s > 0 else "ahead of",
                    self.stage,
                )

    async def _clock_round(self, boundary_ms: int) -> None:
        self.last_round = boundary_ms
        grid = self._grid_s() or 0.0
        share = round_share(self._round_began_ms, boundary_ms, round(grid * 1000))
        # between the rounds it spans, a replica follows (its own are on its period's grid)
        follow = self._follows_between() and not _on_grid(boundary_ms, self._period_s() or 0.0)
        # the next round begins now, or for a replica that had no work at its next inner step
        self._round_began_ms = boundary_ms if self.runner.round_steps > 0 else None
        await self.runner.compute(self.runner.begin_outer)
        await self._round("outer", boundary_ms, share, follow)

    async def _round(
        self, kind: str, round_id: int, share: float = 1.0, follow: bool = False
    ) -> None:
        """Run one round; ``share``: the part of a clock round this replica trained in;
        ``follow``: a NoLoCo round in which it follows a partner instead of exchanging."""
        t0 = time.monotonic()
        if kind == "outer":
            self.last_round = round_id
        try:
            if kind == "grads":
                await self._allreduce_grads()
            elif self.method == "noloco":
                await self._noloco(round_id, share, follow)
            else:
                await self._diloco(round_id, share)
        except Exception:
            self.rounds["failed"] += 1
            log.exception("outer round failed; continuing without it")
        finally:
            self.seconds_sum += time.monotonic() - t0
            self.seconds_count += 1
            await self.runner.compute(self.runner.finish_sync, kind == "outer")
            self.running = False
        self.poll()

    def _ref_steps(self, share: float) -> float:
        """On the clock schedule: the stage's usual inner steps in ``share`` of a round (the
        part this replica trained in), the period over the median of its replicas' seconds
        per step, times ``share`` (0 when unknown, or on the steps schedule). A replica that
        follows between the rounds it spans takes a round at every boundary of the stage's:
        the period is the stage's."""
        period = self._grid_s()
        if not self.clocked or not period:
            return 0.0
        measured = [s for s in self._step_times() if s > 0]
        return share * period / statistics.median(measured) if measured else 0.0

    async def _noloco(self, round_: int, share: float, follow: bool = False) -> None:
        """One NoLoCo round: exchange contributions with a partner, or, with ``follow``,
        take a partner's without sending ours (``swarm.gossip``, point 7); a replica that
        spans rounds also follows in a round it sought in full and found no partner for.
        Then the outer step with what came (solo if nothing did)."""
        ref_steps = self._ref_steps(share)
        steps = self.runner.round_steps  # held: no inner step until the round ends
        if follow:
            outcome = await self.gossip.follow(round_)
        else:
            codec = self._codec(2 * self.runner.outer.phi.numel(), self.gossip.config.allowed_s)
            tensors, meta = await self.runner.compute(
                self.runner.outer_contribution, codec, ref_steps
            )
            nbytes = tensor_bytes(tensors)
            mine = Contribution(tensors, meta, upload_s=self._judge_uplink(nbytes, codec))
            outcome = await self.gossip.exchange(round_, mine, self._follows_between())
            self.proposals += outcome.num_attempts
            self.bytes_sent += nbytes * outcome.num_sent
        self.follow_requests += outcome.num_follows
        offer = None
        if outcome.contribution is not None and outcome.partner_id is not None:
            self.bytes_received += tensor_bytes(outcome.contribution.tensors)
            if outcome.contribution.upload_s > 0:
                self.partner_uploads.append(outcome.contribution.upload_s)
            offer = await self._screened(outcome.partner_id, outcome.contribution)
            if offer is None:
                self.rounds["rejected"] += 1
                outcome.partner_id = None
        spread = await self.runner.compute(self.runner.apply_noloco, offer, ref_steps)
        if spread is not None:
            self.spread_rms, self.last_partner = spread, outcome.partner_id
            self.spread_sum += spread
            self.spread_count += 1
            self.spread_history.append((self.runner.outer_rounds, spread))
            self.rounds["followed" if outcome.followed else "paired"] += 1
        else:
            self.rounds["solo"] += 1
        log.info(
            "noloco outer step %d: %s%s%s",
            self.runner.outer_rounds + 1,
            f"{'followed' if outcome.followed else 'paired with'} {outcome.partner_id[:8]}, "
            f"spread {spread:.2e}"
            if outcome.partner_id and spread is not None
            else "solo",
            f"; {steps} inner steps, the stage's usual {ref_steps:.0f}" if ref_steps else "",
            f" (refusals {dict(outcome.refusals)})" if outcome.refusals else "",
        )

    def _codec(self, numel: int, allowed_s: Callable[[float], float]) -> str:
        """``sync.codec``; with ``auto``, the most precise one in which ``numel`` values cross
        this node's uplink within ``allowed_s`` of their bytes (``swarm.wirecodec``)."""
        if self.config.codec != "auto":
            return self.config.codec
        rate = self.uplink_bytes_s()
        codec = sync_codec(numel, rate, allowed_s, self.codec)
        if codec != self.codec:
            log.info(
                "sync.codec auto: %s for outer rounds from now (%d values a transfer, "
                "uploads get %.2f Mbit/s)",
                codec,
                numel,
                (rate or 0.0) * 8 / 1e6,
            )
            self.codec = codec
        return codec

    def _judge_uplink(self, nbytes: int, codec: str) -> float:
        """Note whether a contribution of ``nbytes`` can reach a partner before it stops
        waiting: its upload at the rate this node's uploads get against the partner's
        ``request_timeout_s`` plus its time at ``sync.min_link_mbps``, or, announced with the
        proposal, the upload's own time, up to ``sync.max_upload_wait_s``. If it cannot, every
        exchange it sends ends solo for both, and a partner that accepted its proposal
        refuses its proposals for ``lapse_ban_s`` after (``lapsed``, ``swarm.gossip``). Where
        its exchange (its upload, then its partner's) outlasts a clock round, it would reach
        its next round late: it takes every 2nd, 4th ... of the stage's rounds instead
        (``_span_rounds``), and only where even ``MAX_ROUND_MULTIPLE`` are too short can it
        not pair. Either way this node is counted (``gossip_uplink_too_thin``) and told
        what would fit.
        Returns the upload's seconds, announced with the proposal (0: the rate is not
        known)."""
        rate = self.uplink_bytes_s()
        self.contribution_send_s = send_s = None if not rate else nbytes / rate
        given_s = self.gossip.config.promise_s(nbytes, send_s or 0.0)
        self.contribution_given_s = given_s
        if self.clocked:
            self._span_rounds(self.contribution_exchange_s)
        self.contribution_round_s = (self._period_s() or None) if self.clocked else None
        if not self.uplink_too_thin():
            return send_s or 0.0
        self.ctx.counters["gossip_uplink_too_thin"] += 1
        exchange_s = self.contribution_exchange_s
        assert rate and send_s is not None and exchange_s is not None
        where = (
            f"a partner waits {given_s:.0f} s for it"
            if send_s > given_s
            else f"with its partner's upload an exchange takes about {exchange_s:.0f} s, "
            f"longer than a {self.contribution_round_s:.0f} s round, so it reaches its next "
            "round late"
        )
        self._thin_log.log(
            "thin",
            logging.WARNING,
            "this node's uplink is too thin for NoLoCo: its contribution (%.1f MB in %s) "
            "takes %.0f s at the %.2f Mbit/s its uploads get beside its hops, and %s; its "
            "rounds end solo. %s",
            nbytes / 1e6,
            codec,
            send_s,
            rate * 8 / 1e6,
            where,
            self._thin_advice(codec, send_s, given_s, exchange_s),
        )
        return send_s

    def _span_rounds(self, exchange_s: float | None) -> None:
        """Take every ``round_multiple``-th of the stage's rounds, from the next boundary on,
        as an exchange of ``exchange_s`` needs (``swarm.schedule.round_multiple``); a change
        is logged."""
        stage_s = self._stage_period_s()
        if stage_s is None or exchange_s is None:
            return  # nothing to judge by: the span stays
        multiple = round_multiple(exchange_s, stage_s, self.round_multiple)
        if multiple == self.round_multiple:
            return
        more, self.round_multiple = multiple > self.round_multiple, multiple
        (log.warning if more else log.info)(
            "noloco: an exchange (this replica's upload, then its partner's) takes about "
            "%.0f s against the stage's %.0f s round: this replica takes %s round from the "
            "next (%.0f s) and pairs in those%s",
            exchange_s,
            stage_s,
            _every(multiple),
            stage_s * multiple,
            (
                "; its partners pair among themselves in the others"
                + (", and it follows one of them there" if self.config.follow else "")
            )
            if multiple > 1
            else "",
        )

    def _thin_advice(self, codec: str, send_s: float, given_s: float, exchange_s: float) -> str:
        """What would let a replica whose contribution takes ``send_s`` in ``codec``, waited
        for ``given_s``, its exchange ``exchange_s``, pair."""
        if send_s > given_s:
            fix = "a higher sync.max_upload_wait_s on every replica"
        else:
            fix = (
                f"rounds of at least {_round_up(ROUND_ROOM * exchange_s / MAX_ROUND_MULTIPLE)} "
                f"s (sync.round_s on every replica: an exchange takes about {exchange_s:.0f} s, "
                f"and this replica takes at most every {_ordinal(MAX_ROUND_MULTIPLE)} round)"
            )
        if codec != SYNC_CANDIDATES[-1]:
            fix = (
                "sync.codec = auto, the default (the codec that fits: bf16 halves it, int8 "
                f"quarters it), or {fix}"
            )
        if not fix.startswith("sync."):  # a setting's name keeps its case
            fix = fix[0].upper() + fix[1:]
        return f"{fix} would let it pair"

    @property
    def contribution_exchange_s(self) -> float | None:
        """About how long an exchange of the last contribution takes: its upload, then its
        partner's (None: the rate is not known). The partner's is the median of what recent
        partners announced (``partner_uploads``), as long as this replica's own where none
        said, and never longer: a partner slower than this replica is that partner's
        uplink to mend, and it judges itself. So a thin replica whose partners upload
        quickly is not told its uplink is too thin for a round its exchanges fit (its
        partner's half assumed as long as its own, a 30 s round behind a 20 s upload was),
        and a partner cannot make it warn by announcing a long upload."""
        send_s = self.contribution_send_s
        if send_s is None:
            return None
        theirs = statistics.median(self.partner_uploads) if self.partner_uploads else send_s
        return send_s + min(send_s, theirs)

    def uplink_too_thin(self) -> bool:
        """Whether this replica's last NoLoCo contribution could not reach a partner in time:
        its upload takes longer than a partner waits, or its exchange takes longer than the
        most clock rounds it may span (``MAX_ROUND_MULTIPLE``; short of those it spans more
        from its next round)."""
        send_s, given_s = self.contribution_send_s, self.contribution_given_s
        exchange_s, period = self.contribution_exchange_s, self.contribution_round_s
        if send_s is None or given_s is None or exchange_s is None:
            return False
        spans_most = self.round_multiple >= MAX_ROUND_MULTIPLE
        return send_s > given_s or (period is not None and exchange_s > period and spans_most)

    async def _screened(self, partner_id: str, contribution: Contribution) -> Offer | None:
        """The partner's offer if it passes the screen; else None, and the partner is banned."""
        try:
            offer = await self.runner.compute(
                self.runner.decode_offer, (contribution.tensors, contribution.meta)
            )
        except ValueError as e:  # malformed, or does not fit this stage
            self.guard.ban(partner_id, "gossip", "malformed", str(e))
            return None
        screen = self.screen
        if not self.guard.screen(
            screen, partner_id, "gossip", offer.distance, offer.scale, offer.movement
        ):
            return None
        return offer

    def members(self) -> list[Hop]:
        me = Hop(self.stage, self.ctx.peer_id, self.ctx.state.address)
        peers = [Hop(p.stage, p.peer_id, p.address) for p in self.ctx.table.replicas(self.stage)]
        return sorted([me, *peers], key=lambda h: h.peer_id)

    async def _ring_mean(
        self,
        round_id: str,
        flat: torch.Tensor,
        clock_round: int | None = None,
        side: list[float] | None = None,
    ) -> tuple[torch.Tensor, list[float] | None]:
        """The means of ``flat`` and of the scalars ``side`` over the stage's replicas, or
        ``flat`` and None when the ring fails (the side mean is None too when a member sent
        none). ``clock_round``: this round's boundary on the clock schedule; a partner's
        chunk for a later boundary ends the round at once (see ``_newer_clock_round``)."""
        members = self.members()
        self.ring.codec = self._codec(flat.numel() // len(members), self.ring.allowed_s)
        sent0, recv0 = self.ring.bytes_sent, self.ring.bytes_received
        try:
            ring = asyncio.ensure_future(
                self.ring.allreduce_with_side(round_id, members, flat, side or [])
            )
            if clock_round is not None:
                await self._unless_superseded(ring, clock_round)
            result = await ring
            self.rounds["allreduced" if len(members) > 1 else "solo"] += 1
            return result
        except RingFailed as e:
            self.rounds["failed"] += 1
            log.warning(
                "%s: ring of %d failed (%s); applying this replica's own update",
                round_id,
                len(members),
                e,
            )
            return flat, None
        finally:
            self.bytes_sent += self.ring.bytes_sent - sent0
            self.bytes_received += self.ring.bytes_received - recv0

    async def _unless_superseded(self, ring: asyncio.Future[Any], boundary: int) -> None:
        """Wait for ``ring``; cancel it (``RingFailed``) as soon as a partner's chunk shows
        it is in a later clock round, and take that round next.

        Two replicas that start a clock round one boundary apart (one became ready just
        after a boundary the other took with it as a member) each wait out the ring's
        timeout, fail, and take the latest boundary then; when the timeout is not a multiple
        of the period they stay one boundary apart for good, every round failing (CI saw 14
        in a row). The later round wins: the replica behind joins it at once."""
        while not ring.done():
            await asyncio.wait({ring}, timeout=0.2)
            now_ms = self._stage_ms()
            newer = _newer_clock_round(self.ring.round_ids(), self.stage, boundary, now_ms)
            if newer is not None and not ring.done():
                ring.cancel()
                self._join_round = newer
                raise RingFailed(f"a partner is already in the round of boundary {newer}")

    async def _diloco(self, round_: int, share: float) -> None:
        """DiLoCo's outer step with the ring's mean pseudo-gradient; with
        ``sync.diloco_share_schedule`` the ring also averages the members' places in the
        learning-rate schedule, which on the clock schedule differ between replicas of
        unequal speed."""
        round_id = f"diloco:{self.stage}:{round_}"
        delta = await self.runner.compute(self.runner.outer_delta)
        clock = round_ if self.clocked else None
        mean, place = await self._ring_mean(round_id, delta, clock, self.runner.place)
        await self.runner.compute(self.runner.apply_diloco, mean)
        if place:
            await self.runner.compute(self.runner.take_place, place[0], self._ref_steps(share))

    async def _allreduce_grads(self) -> None:
        grads = self.runner.pending_grads
        assert grads is not None
        mean, _ = await self._ring_mean(f"dp:{self.stage}:{self.runner.step}", grads)
        await self.runner.compute(self.runner.apply_grads, mean)

    def forget_stale_rounds(self, diloco_ceiling: float = math.inf) -> None:
        """Drop ring mailboxes of rounds this replica has passed (late or foreign chunks),
        and of DiLoCo rounds after ``diloco_ceiling`` (a set-back clock's old grid)."""
        floors = {"diloco": max(0, self.last_round), "dp": self.runner.step}

        def keep(round_id: str) -> bool:
            kind, _, number = _parse_round_id(round_id)
            if not number.isdigit() or int(number) < floors.get(kind, 0):
                return False
            return kind != "diloco" or int(number) <= diloco_ceiling

        self.ring.forget_stale(keep)

    def status(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "codec": self.codec,
            "codec_setting": self.config.codec,
            "outer_steps": self.runner.outer_rounds,
            "schedule": self.config.schedule if self.method in ("noloco", "diloco") else "steps",
            "round_s": self._round_period() if self.clocked else None,
            "rounds": dict(self.rounds),
            "seconds_sum": round(self.seconds_sum, 3),
            "seconds_count": self.seconds_count,
            "bytes_sent": self.bytes_sent + self.gossip.bytes_to_followers,
            "bytes_received": self.bytes_received,
            "spread_rms": self.spread_rms,
            "spread_rms_mean": self.spread_sum / self.spread_count if self.spread_count else None,
            "spread_history": list(self.spread_history),
            "last_partner": self.last_partner,
            "in_progress": self.running,
            "typical_distance": self.screen.typical(),
            "promises_lapsed": self.gossip.num_lapsed,
            "proposals": self.proposals,
            "follow_requests": self.follow_requests,
            "followers_answered": self.gossip.num_followers,
            "places_clamped": self.runner.places_clamped,
            "clock_offset_s": round(self.offset_s, 3),
            "clock_restarts": self.clock_restarts,
            "contribution_send_s": _rounded(self.contribution_send_s),
            "contribution_given_s": _rounded(self.contribution_given_s),
            "contribution_round_s": _rounded(self.contribution_round_s),
            "contribution_exchange_s": _rounded(self.contribution_exchange_s),
            "round_multiple": self.round_multiple,
            "uplink_too_thin": self.uplink_too_thin(),
        }


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)


def _on_grid(boundary_ms: int, period_s: float) -> bool:
    """Whether a replica on clock rounds of ``period_s`` (0: not published) takes the round
    of ``boundary_ms``."""
    period_ms = round(period_s * 1000)
    return period_ms <= 0 or boundary_ms % period_ms == 0


def _ordinal(n: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(n, f"{n}th")


def _every(multiple: int) -> str:
    """How a replica taking every ``multiple``-th round says so: "every", "every 2nd"..."""
    return "every" if multiple == 1 else f"every {_ordinal(multiple)}"


def _round_up(seconds: float) -> int:
    """``seconds`` rounded up to a whole minute past a minute, to ten seconds below it."""
    step = 60 if seconds > 60 else 10
    return int(math.ceil(seconds / step) * step)


CLOCK_BACK_WAIT_S = 30.0
"""How long the stage's clock may read more than a round before the last round taken before
the rounds restart from it (or one period, if longer): time for a replica whose own clock
was set to measure its partners' again, after which its stage clock comes forward."""

CLOCK_SKEW_MS = 2000
"""How far ahead of this node's clock a partner's round may be: a boundary further in the
future is no round a partner can be in (its chunks are ignored for catching up, so a member
cannot send this replica to a round that never comes)."""


def _newer_clock_round(round_ids: list[str], stage: int, boundary: int, now_ms: int) -> int | None:
    """The latest DiLoCo clock round of ``stage`` after ``boundary`` that a partner has
    started (its chunks wait in a mailbox here) and whose boundary has passed, give or take
    ``CLOCK_SKEW_MS``; None if there is none."""
    later = []
    for round_id in round_ids:
        kind, of, number = _parse_round_id(round_id)
        if kind != "diloco" or of != str(stage) or not number.isdigit():
            continue
        if boundary < int(number) <= now_ms + CLOCK_SKEW_MS:
            later.append(int(number))
    return max(later, default=None)


def _parse_round_id(round_id: str) -> tuple[str, str, str]:
    """``(kind, stage, number)`` of a ring round id ``kind:stage:number`` (empty parts if not)."""
    parts = round_id.split(":")
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 else ("", "", "")
