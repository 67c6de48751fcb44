"""Keeping every stage filled: detect a lost stage, refill it, rebuild its weights.

Owns the daemon's side of CheckFree (arXiv 2506.15461; policy in ``swarm.recovery``):

- **Watch.** Every second the node looks at its peer table; a stage with no ready replica
  is *empty* from that moment. Head nodes meanwhile pause new microbatches (``node.roles.head``
  waits for a complete pipeline) rather than failing them.
- **Refill.** A joining ``--stage auto`` node takes an empty stage first (``node.services.balance``).
  If none has come after ``recovery.refill_wait_s``, the lowest-id replica of the block
  stage with the most replicas (never its last) moves there; every node computes the same
  answer from its table, so one node moves.
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
  restarts it tells every peer to roll back to its own last save.

Every source's weights (a replica copied at join, the neighbours a rebuild averages, a head
backup) pass ``swarm.screen`` first: non-finite ones, or ones further from this replica's
current weights than ``recovery.screen_multiple`` times their RMS, are refused, the source
banned (``node.services.guard``) and the next one tried.

Keeps the counts ``node status`` and the metrics show: recoveries by kind, seconds from the
stage being seen empty to the node serving it, and the source stages used.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from node.stage.checkpoint import load_checkpoint, save_checkpoint
from protocol.messages import FetchState, HeadBackup, PeerRecord, Rollback, StageState, expect
from swarm.recovery import RecoveryPlan, choose_mover, plan_recovery, random_seed, weighted_average
from swarm.screen import ScreenConfig, WeightScreen
from swarm.seams import Refused, TransportError

if TYPE_CHECKING:
    from node.daemon import Node

log = logging.getLogger(__name__)


class RecoveryService:
    """Watches for empty stages and rebuilds the one this node takes over."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.config = node.config.recovery
        self.empty_since: dict[int, float] = {}
        self.recoveries: Counter[str] = Counter()
        self.seconds_sum = 0.0
        self.seconds_count = 0
        self.last: dict[str, Any] | None = None
        self.head_backup: tuple[int, dict[str, torch.Tensor]] | None = None
        self._last_backup_step = 0
        self._last_save_step = 0
        self._busy = False
        self.checkpoint_dir = self.config.checkpoint_dir or str(
            Path(tempfile.gettempdir()) / f"murmuration-checkpoints-{node.config.swarm.name}"
        )

    async def screen_source(self, peer_id: str, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether the weights in ``tensors`` (``param.*`` entries) may be used; if not, the
        source is banned. ``ValueError`` when they do not fit this stage at all."""
        runner = self.node.runner
        assert runner is not None
        params = _params(tensors)
        distance, scale = await runner.run(runner.distance_to, params)
        screen = WeightScreen(ScreenConfig(multiple=self.config.screen_multiple, warmup=1))
        reason = screen.judge(distance, scale)
        if reason is not None:
            self.node.guard.ban(peer_id, "recovery", reason, screen.describe(distance, scale))
        return reason is None

    @property
    def head_backup_step(self) -> int:
        return self.head_backup[0] if self.head_backup else 0

    def poll(self) -> None:
        """After each job: save a checkpoint or send a head backup when one is due."""
        node, runner = self.node, self.node.runner
        if runner is None or not node.ready or node.leaving or self._busy:
            return
        if (
            self.config.method == "checkpoint"
            and runner.step >= self._last_save_step + self.config.checkpoint_every
        ):
            self._busy, self._last_save_step = True, runner.step
            node.spawn(self._save())
        elif (
            self.config.method == "checkfree+"
            and node.stage == 0
            and runner.step >= self._last_backup_step + self.config.head_backup_every
        ):
            self._busy, self._last_backup_step = True, runner.step
            node.spawn(self._send_head_backup())

    async def _save(self) -> None:
        runner = self.node.runner
        assert runner is not None
        try:
            tensors, step, samples = await runner.run(runner.snapshot)
            await runner.run(
                save_checkpoint, self.checkpoint_dir, self.node.stage, tensors, step, samples
            )
        finally:
            self._busy = False

    async def _send_head_backup(self) -> None:
        runner = self.node.runner
        assert runner is not None
        try:
            params = await runner.run(runner.params)
            msg = HeadBackup(
                step=runner.step,
                sender=self.node.peer_id,
                tensors={f"param.{k}": v for k, v in params.items()},
            )
            for peer in self.node.table.replicas(1)[:2]:
                try:
                    await self.node.link.request(peer.address, msg, 30.0, peer.peer_id)
                except TransportError as e:
                    log.warning("head backup to %s failed: %s", peer.peer_id[:8], e)
        finally:
            self._busy = False

    def on_head_backup(self, msg: HeadBackup) -> None:
        if self.node.stage != 1:
            raise Refused("wrong_stage", "head backups are kept by stage-1 replicas")
        sender = self.node.table.get(msg.sender)
        if sender is not None and sender.stage != 0:  # unknown senders the guard refused
            raise Refused(
                "wrong_stage",
                f"head backup from peer {msg.sender[:8]} of stage {sender.stage}, not a head",
            )
        if msg.step >= self.head_backup_step:
            self.head_backup = (msg.step, dict(msg.tensors))

    async def on_rollback(self, msg: Rollback) -> None:
        """Checkpoint-restart: another stage restarted from its save; go back to ours."""
        runner = self.node.runner
        if self.config.method != "checkpoint" or runner is None:
            raise Refused("no_checkpoints", "this node does not use checkpoint-restart")
        saved = await runner.run(load_checkpoint, self.checkpoint_dir, self.node.stage)
        if saved is None:
            return
        tensors, step, samples = saved
        await runner.run(runner.load, tensors, step, samples)
        self.recoveries["rollback"] += 1
        log.warning(
            "rolled back to the step-%d checkpoint (stage %d restarted at step %d)",
            step,
            msg.stage,
            msg.step,
        )

    def live(self) -> dict[int, list[PeerRecord]]:
        """Ready replicas per stage, this node included when it serves; peers that just
        failed to answer (banned by the router) do not count: they are probably dead but
        not yet expired from the table."""
        node = self.node
        now = node.clock.now()
        banned = {pid for pid, st in node.router.stats.items() if st.banned_until > now}
        live = {
            s: [r for r in node.table.replicas(s) if r.peer_id not in banned]
            for s in range(node.num_stages)
        }
        if node.ready and not node.leaving and node.stage >= 0:
            live[node.stage].append(node.record())
        return live

    async def run(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            await self.check()

    async def check(self) -> None:
        """Note empty stages; move there if this node is the one that should."""
        node = self.node
        if not node.ready or node.leaving:
            return
        now = time.monotonic()
        live = self.live()
        for stage, replicas in live.items():
            if replicas:
                self.empty_since.pop(stage, None)
            elif stage not in self.empty_since:
                self.empty_since[stage] = now
                log.warning("stage %d has no live replica", stage)
        for stage, since in sorted(self.empty_since.items()):
            if stage == 0 or node.stage == 0 or now - since < self.config.refill_wait_s:
                continue  # the head stage is refilled by joining head nodes (it has no neighbours)
            if choose_mover(stage, node.record(), live):
                log.warning(
                    "stage %d empty for %.0fs: moving there from stage %d",
                    stage,
                    now - since,
                    node.stage,
                )
                await node.move_to(stage)
                return

    async def rebuild(self, stage: int) -> RecoveryPlan:
        """Load ``stage``'s weights into the (new) runner following the recovery plan."""
        node = self.node
        runner = node.runner
        assert runner is not None
        t_empty = self.empty_since.get(stage, time.monotonic())
        plan = plan_recovery(
            stage, node.config.swarm.num_block_stages, self.live(), self.config.method
        )
        if plan.kind == "copy":
            return plan  # the daemon copies a live replica itself
        if plan.kind == "seed":
            pass  # nothing to rebuild from: the swarm's initial weights stay
        elif plan.kind == "random":
            seed = random_seed(node.rng)
            await runner.run(runner.reinitialise, seed, self.config.lr_scale)
        elif plan.kind == "checkpoint":
            saved = await runner.run(load_checkpoint, self.checkpoint_dir, stage)
            if saved is None:
                plan = RecoveryPlan(stage, "seed")  # no save yet: the swarm's initial weights
                saved = ({}, 0, 0)
            tensors, step, samples = saved
            if tensors:
                await runner.run(runner.load, tensors, step, samples)
                await self._broadcast_rollback(stage, step)
        elif plan.kind == "head_copy":
            holder = max(
                (r for rs in self.live().values() for r in rs if r.head_backup_step > 0),
                key=lambda r: r.head_backup_step,
            )
            state = expect(
                await node.link.request(holder.address, FetchState(stage=0), 60.0, holder.peer_id),
                StageState,
            )
            if await self.screen_source(holder.peer_id, state.tensors):
                await runner.run(runner.adopt_weights, _params(state.tensors), self.config.lr_scale)
            else:  # a poisoned backup (its holder is banned now): the initial weights it is
                plan = RecoveryPlan(stage, "seed")
        else:
            states = [await self._fetch_params(src.stage) for src in plan.sources]
            weights = [src.weight for src in plan.sources]
            merged = await runner.run(weighted_average, states, weights)
            await runner.run(runner.adopt_weights, merged, self.config.lr_scale)
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

    async def _broadcast_rollback(self, stage: int, step: int) -> None:
        msg = Rollback(stage=stage, step=step, sender=self.node.peer_id)

        async def tell(peer: PeerRecord) -> None:
            try:
                await self.node.link.request(peer.address, msg, 30.0, peer.peer_id)
            except TransportError as e:
                log.warning("rollback request to %s failed: %s", peer.peer_id[:8], e)

        await asyncio.gather(*(tell(p) for p in self.node.table.records()))

    async def _fetch_params(self, stage: int) -> dict[str, torch.Tensor]:
        """Weights of the most advanced live replica of ``stage`` that answers."""
        now = self.node.clock.now()
        for peer in sorted(self.node.table.replicas(stage), key=lambda p: -p.step):
            if self.node.router.is_quarantined(peer.peer_id, now):
                continue
            try:
                reply = await self.node.link.request(
                    peer.address, FetchState(stage=stage), 60.0, peer.peer_id
                )
                state = expect(reply, StageState)
                if not await self.screen_source(peer.peer_id, state.tensors):
                    continue
            except (TransportError, ValueError) as e:
                log.warning("fetching stage %d from %s failed: %s", stage, peer.peer_id[:8], e)
                continue
            return _params(state.tensors)
        raise RuntimeError(f"no replica of stage {stage} answered")

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


def _params(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights in a ``StageState``'s tensors, named as the stage module names them."""
    return {k.removeprefix("param."): v for k, v in tensors.items() if k.startswith("param.")}
