"""Keeping every stage filled: detect a lost stage, refill it, rebuild its weights.

Owns the daemon's side of CheckFree (arXiv 2506.15461; policy in ``swarm.recovery``):

- **Watch.** Every second the node looks at its peer table (and, for the stages it does not
  hold, at their summaries); a stage with no ready replica is *empty* from that moment. A
  replica whose request from this node failed and that has been silent since does not
  count (``swarm.routing.Router.unresponsive``). Head nodes meanwhile pause new
  microbatches (``node.roles.head`` waits for a complete pipeline) rather than failing them.
- **Refill.** A joining ``--stage auto`` node takes an empty stage first (``node.services.balance``).
  If none has come after ``recovery.refill_wait_s``, the lowest-id replica of the block
  stage with the most replicas (never its last) moves there; every node computes the same
  answer from its table, so one node moves, and nobody while a block replica is joining or
  moving (a refiller on its way; each waited for at most ``balance.transit_limit_s``). With neighbourhood tables only the stages that
  hold the empty one give (they see it empty in their tables; a far stage's summary could
  be made up by any member).
- **Rebuild.** A node taking over a stage copies a live replica if there is one; otherwise
  it follows the plan: CheckFree's gradient-norm-weighted average of the nearest live block
  stages, CheckFree+'s copy of a boundary stage's swap partner, a single neighbour's copy,
  or random re-initialisation (a baseline). Rebuilt weights start a fresh Adam at
  ``lr * recovery.lr_scale``.
- **CheckFree+ head backups.** Head nodes send their (small) weights to stage-1 replicas
  every ``head_backup_every`` steps; a node that takes over an empty head stage copies the
  freshest backup.
- **Checkpoint-restart** (the other baseline): every node saves its stage every
  ``checkpoint_every`` steps; a lost stage restarts from its last save, and the node that
  restarts it tells every peer to roll back to its own last save (with neighbourhood
  tables: the peers it holds, and each passes it on once to the peers it holds).

Every source's weights (a replica copied at join, the neighbours a rebuild averages, a head
backup) are fetched and screened by ``node.services.statefetch``: a refused source is banned
and the next one tried.

Keeps the counts ``node status`` and the metrics show: recoveries by kind, seconds from the
stage being seen empty to the node serving it, and the source stages used.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from node.context import NodeContext
from node.services.statefetch import StateFetcher
from node.stage.checkpoint import load_checkpoint, save_checkpoint
from node.stage.runner import as_state, params_of
from protocol.messages import HeadBackup, PeerRecord, Rollback, StageState
from swarm.recovery import RecoveryPlan, choose_mover, plan_recovery, random_seed, weighted_average
from swarm.seams import Refused, TransportError

log = logging.getLogger(__name__)


class RecoveryService:
    """Watches for empty stages and rebuilds the one this node takes over."""

    def __init__(
        self,
        ctx: NodeContext,
        *,
        states: StateFetcher,
        record: Callable[[], PeerRecord],
        move_to: Callable[[int], Awaitable[None]],
        in_transit: Callable[[], int],
    ) -> None:
        """``record()``: this node as peers see it; ``move_to(stage)``: leave this stage
        for another (the daemon's); ``in_transit()``: block replicas joining or moving that
        a refill waits for (the balancer's)."""
        self.ctx = ctx
        self.states = states
        self.record = record
        self.move_to = move_to
        self.in_transit = in_transit
        self.config = ctx.config.recovery
        self.empty_since: dict[int, float] = {}
        self.seen_live: set[int] = set()
        """Stages this node has seen with a live replica: only those can lose their last one
        (counted in ``stages_seen_empty``, logged as a warning); a stage yet to be served is
        empty too, for a refill, but that is news only at info level."""
        self.recoveries: Counter[str] = Counter()
        self.seconds_sum = 0.0
        self.seconds_count = 0
        self.last: dict[str, Any] | None = None
        self.head_backup: tuple[int, dict[str, torch.Tensor]] | None = None
        self._last_backup_step = 0
        self._last_save_step = 0
        self._busy = False
        self._rolled_back: set[tuple[int, int]] = set()  # (stage, step) of restarts heard
        self.checkpoint_dir = self.config.checkpoint_dir or str(
            Path(tempfile.gettempdir()) / f"murmuration-checkpoints-{ctx.config.swarm.name}"
        )

    @property
    def head_backup_step(self) -> int:
        return self.head_backup[0] if self.head_backup else 0

    def poll(self) -> None:
        """After each job: save a checkpoint or send a head backup when one is due."""
        ctx, runner = self.ctx, self.ctx.state.runner
        if runner is None or not ctx.state.serving or self._busy:
            return
        if (
            self.config.method == "checkpoint"
            and runner.step >= self._last_save_step + self.config.checkpoint_every
        ):
            self._busy, self._last_save_step = True, runner.step
            ctx.spawn(self._save())
        elif (
            self.config.method == "checkfree+"
            and ctx.stage == 0
            and runner.step >= self._last_backup_step + self.config.head_backup_every
        ):
            self._busy, self._last_backup_step = True, runner.step
            ctx.spawn(self._send_head_backup())

    async def _save(self) -> None:
        runner = self.ctx.state.the_runner()
        try:
            tensors, step, samples = await runner.compute(runner.snapshot)
            await runner.compute(
                save_checkpoint, self.checkpoint_dir, runner.stage, tensors, step, samples
            )
        finally:
            self._busy = False

    async def _send_head_backup(self) -> None:
        runner = self.ctx.state.the_runner()
        try:
            params = await runner.compute(runner.params)
            msg = HeadBackup(step=runner.step, sender=self.ctx.peer_id, tensors=as_state(params))
            for peer in self.ctx.table.replicas(1)[:2]:
                try:
                    await self.ctx.transport.request(peer.address, msg, 30.0, peer.peer_id)
                except TransportError as e:
                    log.warning("head backup to %s failed: %s", peer.peer_id[:8], e)
        finally:
            self._busy = False

    def on_head_backup(self, msg: HeadBackup) -> None:
        if self.ctx.stage != 1:
            raise Refused("wrong_stage", "head backups are kept by stage-1 replicas")
        sender = self.ctx.table.get(msg.sender)
        if sender is not None and sender.stage != 0:  # unknown senders the guard refused
            raise Refused(
                "wrong_stage",
                f"head backup from peer {msg.sender[:8]} of stage {sender.stage}, not a head",
            )
        if msg.step >= self.head_backup_step:
            self.head_backup = (msg.step, dict(msg.tensors))

    async def on_rollback(self, msg: Rollback) -> None:
        """Checkpoint-restart: another stage restarted from its save; go back to ours."""
        runner = self.ctx.state.runner
        if self.config.method != "checkpoint" or runner is None:
            raise Refused("no_checkpoints", "this node does not use checkpoint-restart")
        if (msg.stage, msg.step) in self._rolled_back:
            return  # heard already, from another neighbour
        self._rolled_back.add((msg.stage, msg.step))
        if self.ctx.partial:
            # the restarting node told the stages next to it: pass it on down the ring
            self.ctx.spawn(self._broadcast_rollback(msg.stage, msg.step, but=msg.sender))
        saved = await runner.compute(load_checkpoint, self.checkpoint_dir, runner.stage)
        if saved is None:
            return
        tensors, step, samples = saved
        await runner.compute(runner.load, tensors, step, samples)
        self.recoveries["rollback"] += 1
        log.warning(
            "rolled back to the step-%d checkpoint (stage %d restarted at step %d)",
            step,
            msg.stage,
            msg.step,
        )

    def live(self) -> dict[int, list[PeerRecord]]:
        """Ready replicas per stage known (``NodeContext.everyone``), this node included when
        it serves; peers that just failed to answer and have not spoken to us since
        (``Router.unresponsive``) do not count: they are probably dead but not yet expired
        from the table. One that failed a hop but keeps sending us its own requests counts:
        the hop probably waited in this node's own thin uplink."""
        ctx = self.ctx
        unresponsive = ctx.router.unresponsive(ctx.clock.now())
        live = {
            s: [r for r in records if r.ready and r.peer_id not in unresponsive]
            for s, records in ctx.everyone().items()
        }
        if ctx.state.serving and ctx.stage >= 0:
            live.setdefault(ctx.stage, []).append(self.record())
        return live

    async def run(self) -> None:
        """Watch for empty stages every second, until cancelled."""
        while True:
            await asyncio.sleep(1.0)
            await self.check()

    async def check(self) -> None:
        """Note empty stages; move there if this node is the one that should."""
        ctx = self.ctx
        if not ctx.state.serving:
            return
        now = time.monotonic()
        live = self.live()
        for stage, replicas in live.items():
            if replicas:
                self.empty_since.pop(stage, None)
                self.seen_live.add(stage)
            elif stage not in self.empty_since:
                self.empty_since[stage] = now
                source = "" if ctx.table.covers(stage) else " (by a peer's summary)"
                if stage not in self.seen_live:  # a swarm starting, a replica on its way
                    log.info("stage %d has no live replica yet%s", stage, source)
                    continue
                ctx.counters["stages_seen_empty"] += 1
                log.warning("stage %d has no live replica%s", stage, source)
        for stage, since in sorted(self.empty_since.items()):
            if stage == 0 or ctx.stage == 0 or now - since < self.config.refill_wait_s:
                continue  # the head stage is refilled by joining head nodes (it has no neighbours)
            table = ctx.table
            if not table.covers(stage):
                continue  # known empty by a summary only: the stages that hold it refill it
            donors = {s for s in live if table.covers(stage, own=s)}
            if choose_mover(stage, self.record(), live, donors, self.in_transit()):
                log.warning(
                    "stage %d empty for %.0fs: moving there from stage %d",
                    stage,
                    now - since,
                    ctx.stage,
                )
                await self.move_to(stage)
                return

    async def rebuild(self, stage: int) -> RecoveryPlan:
        """Load ``stage``'s weights into the (new) runner following the recovery plan."""
        ctx = self.ctx
        runner = ctx.state.the_runner()
        t_empty = self.empty_since.get(stage, time.monotonic())
        plan = plan_recovery(
            stage, ctx.config.swarm.num_block_stages, self.live(), self.config.method
        )
        if plan.kind == "copy":
            return plan  # the daemon copies a live replica itself
        if plan.kind == "seed":
            pass  # nothing to rebuild from: the swarm's initial weights stay
        elif plan.kind == "random":
            seed = random_seed(ctx.rng)
            await runner.compute(runner.reinitialise, seed, self.config.lr_scale)
        elif plan.kind == "checkpoint":
            saved = await runner.compute(load_checkpoint, self.checkpoint_dir, stage)
            if saved is None:
                plan = RecoveryPlan(stage, "seed")  # no save yet: the swarm's initial weights
                saved = ({}, 0, 0)
            tensors, step, samples = saved
            if tensors:
                await runner.compute(runner.load, tensors, step, samples)
                await self._broadcast_rollback(stage, step)
        elif plan.kind == "head_copy":
            holder = max(
                (r for rs in self.live().values() for r in rs if r.head_backup_step > 0),
                key=lambda r: r.head_backup_step,
            )
            state = await self.states.fetch_from(holder.address, holder.peer_id, 0)
            if await self.states.screened(holder.peer_id, state.tensors):
                await runner.compute(
                    runner.adopt_weights, params_of(state.tensors), self.config.lr_scale
                )
            else:  # a poisoned backup (its holder is banned now): the initial weights it is
                plan = RecoveryPlan(stage, "seed")
        else:
            states = [await self._fetch_params(src.stage) for src in plan.sources]
            weights = [src.weight for src in plan.sources]
            merged = await runner.compute(weighted_average, states, weights)
            await runner.compute(runner.adopt_weights, merged, self.config.lr_scale)
        seconds = time.monotonic() - t_empty
        self.recoveries[plan.kind] += 1
        self.seconds_sum += seconds
        self.seconds_count += 1
        self.last = {
            "stage": stage,
            "kind": plan.kind,
            "sources": [{"stage": s.stage, "weight": round(s.weight, 6)} for s in plan.sources],
            "seconds": round(seconds, 2),
        }
        log.warning(
            "rebuilt stage %d by %s from %s in %.1fs",
            stage,
            plan.kind,
            self.last["sources"],
            seconds,
        )
        return plan

    async def _broadcast_rollback(self, stage: int, step: int, but: str = "") -> None:
        """Tell every peer of the table (``but`` the one that told us) to roll back."""
        self._rolled_back.add((stage, step))
        msg = Rollback(stage=stage, step=step, sender=self.ctx.peer_id)

        async def tell(peer: PeerRecord) -> None:
            try:
                await self.ctx.transport.request(peer.address, msg, 30.0, peer.peer_id)
            except TransportError as e:
                log.warning("rollback request to %s failed: %s", peer.peer_id[:8], e)

        await asyncio.gather(*(tell(p) for p in self.ctx.table.records() if p.peer_id != but))

    async def _fetch_params(self, stage: int) -> dict[str, torch.Tensor]:
        """Weights of the most advanced live replica of ``stage`` that answers."""
        state: StageState | None = await self.states.fetch(stage)
        if state is None:
            raise RuntimeError(f"no replica of stage {stage} answered")
        return params_of(state.tensors)

    def status(self) -> dict[str, Any]:
        return {
            "method": self.config.method,
            "recoveries": dict(self.recoveries),
            "seconds_sum": round(self.seconds_sum, 2),
            "seconds_count": self.seconds_count,
            "last": self.last,
            "empty_stages": sorted(self.empty_since),
            "head_backup_step": self.head_backup_step,
        }
