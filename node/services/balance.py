"""The daemon's side of ``--stage auto``: its own speed, the stage it joins, and moves.

Owns three things (policy in ``swarm.balance``, ALGORITHMS.md section 3):

- **Own speed.** At start-up a ``--stage auto`` node times forward plus backward of one block stage on its
  device with a microbatch of the configured shape (``balance.benchmark_s`` of work, after a
  warm-up), plus any configured compute delay. The figure is cached in the state directory
  keyed by everything it depends on, so a restart does not pay for it again. It is what the
  node publishes as its service rate until real work has been measured.
- **Joining.** ``balance.policy = "throughput"`` joins an empty stage first, else the block
  stage with the lowest total service rate; ``"replicas"`` keeps the simpler rule of the
  fewest replicas (a baseline for the benchmark).
- **Rebalancing.** At randomised intervals (uniform in 0.5..1.5 x ``balance.interval_s``) a
  movable node (``--stage auto``, not the head) runs the swarm-wide plan on its table and
  moves if the plan names it: not before it has served its stage for ``balance.warmup_s``
  (its rate must be a measurement), not within ``balance.cooldown_s`` of its last move, and
  not while any block replica is still joining or moving (their rates are not settled).

Counts moves and keeps the latest plan for ``node status`` and the metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from node.config import Config
from node.stage.model import build_stage
from swarm.assignment import choose_stage
from swarm.balance import Move, Replica, join_stage, plan_move

if TYPE_CHECKING:
    from node.daemon import Node

log = logging.getLogger(__name__)


def compute_delay(config: Config, stage: int) -> float:
    """The artificial delay per forward on ``stage`` (``train.compute_delay_s``, limited to
    ``train.compute_delay_stages`` when that is set)."""
    train = config.train
    if not train.compute_delay_s:
        return 0.0
    if train.compute_delay_stages and stage not in train.compute_delay_stages:
        return 0.0
    return train.compute_delay_s


def speed_key(config: Config) -> str:
    """Everything the benchmark figure depends on, as a cache key."""
    d = config.data
    return json.dumps(
        {
            "model": dataclasses.asdict(config.model),
            "block_stages": config.swarm.num_block_stages,
            "batch": d.batch_size,
            "seq": d.seq_len,
            "device": config.node.device,
            "threads": config.node.threads,
            "dtype": config.train.compute_dtype,
            "torch": torch.__version__,
        },
        sort_keys=True,
    )


def measure_block_rate(config: Config, budget_s: float) -> float:
    """Samples per second of forward plus backward through one block stage, undelayed."""
    torch.set_num_threads(config.node.threads)
    device = torch.device(config.node.device)
    stage = build_stage(config.model, config.swarm.num_block_stages, 1, config.swarm.seed)
    stage.to(device)
    b, t = config.data.batch_size, config.data.seq_len
    x = torch.randn(b, t, config.model.d_model, device=device)
    autocast: Any = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if config.train.compute_dtype == "bfloat16"
        else torch.autocast(device.type, enabled=False)
    )

    def once() -> None:
        xi = x.detach().requires_grad_(True)
        with autocast:
            out = stage(xi).float()
        out.backward(torch.ones_like(out))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    once()  # warm-up: allocator, kernels, lazy init
    runs, t0 = 0, time.perf_counter()
    while runs < 3 or time.perf_counter() - t0 < budget_s:
        once()
        runs += 1
    return b * runs / (time.perf_counter() - t0)


def with_delay(rate: float, config: Config, stage: int) -> float:
    """A block rate slowed by the stage's artificial delay (one per microbatch forward)."""
    delay = compute_delay(config, stage)
    if rate <= 0 or not delay:
        return rate
    return config.data.batch_size / (config.data.batch_size / rate + delay)


class Balancer:
    """Own speed, stage choice and throughput rebalancing for one node."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.config = node.config.balance
        self.block_rate = 0.0
        """This node's measured (or cached) undelayed block-stage rate, samples/s."""
        self.moves = 0
        self.last_move_s: float | None = None
        self.last_plan: Move | None = None
        self.rng = random.Random(f"balance-{node.peer_id}")

    # ---- own speed ----------------------------------------------------------------------

    def _cache_path(self) -> Path | None:
        state_dir = self.node.config.node.state_dir
        return Path(state_dir) / "speed.json" if state_dir else None

    async def measure(self) -> float:
        """Benchmark (or read the cached figure for) one block stage on this device. Only
        ``--stage auto`` nodes under the throughput policy need it; pinned nodes publish
        what they measure once work flows (a peer without a rate counts as a typical one)."""
        c = self.node.config
        if (
            self.config.benchmark_s <= 0
            or c.node.stage != "auto"
            or self.config.policy != "throughput"
        ):
            return 0.0
        key, path = speed_key(self.node.config), self._cache_path()
        if path is not None and path.is_file():
            try:
                cached = json.loads(path.read_text())
                if cached.get("key") == key and float(cached["rate"]) > 0:
                    self.block_rate = float(cached["rate"])
                    log.info("own speed %.1f samples/s (cached in %s)", self.block_rate, path)
                    return self.block_rate
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("ignoring unreadable speed cache %s: %s", path, e)
        t0 = time.monotonic()
        self.block_rate = await asyncio.to_thread(
            measure_block_rate, self.node.config, self.config.benchmark_s
        )
        log.info(
            "own speed %.1f samples/s through one block stage (measured in %.1fs)",
            self.block_rate,
            time.monotonic() - t0,
        )
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps({"key": key, "rate": self.block_rate}))
            except OSError as e:
                log.warning("cannot cache own speed in %s: %s", path, e)
        return self.block_rate

    def estimate(self, stage: int) -> float:
        """What this node expects to serve on ``stage`` before it has measured real work."""
        return with_delay(self.block_rate, self.node.config, stage) if stage > 0 else 0.0

    # ---- the swarm as the policy sees it ------------------------------------------------

    def replicas(self, *, ready_only: bool) -> list[Replica]:
        """Live peers (and this node once it serves) as policy records."""
        node = self.node
        records = [r for r in node.table.records() if not r.leaving and (r.ready or not ready_only)]
        if node.stage >= 0 and not node.leaving and (node.ready or not ready_only):
            records.append(node.record())
        return [Replica(r.peer_id, r.stage, r.throughput, r.movable) for r in records]

    def choose(self) -> int:
        """The stage a joining ``--stage auto`` node takes under the configured policy."""
        node = self.node
        if self.config.policy == "replicas":
            counts = node.table.stage_counts(node.num_stages)
            if counts[0]:  # as with throughput: the head stage only when it is empty
                counts.pop(0)
            stage = choose_stage(counts, node.rng)
            log.info("stage auto: replicas per stage %s -> joining stage %d", counts, stage)
            return stage
        joining = self.replicas(ready_only=False)
        stage = join_stage(joining, node.num_stages, node.rng, self.block_rate or 1.0)
        totals = {
            s: round(sum(r.rate for r in joining if r.stage == s), 1)
            for s in range(node.num_stages)
        }
        log.info("stage auto: samples/s per stage %s -> joining stage %d", totals, stage)
        return stage

    # ---- rebalancing --------------------------------------------------------------------

    @property
    def movable(self) -> bool:
        node = self.node
        return node.config.node.stage == "auto" and node.stage > 0

    async def run(self) -> None:
        if self.config.policy != "throughput" or self.config.interval_s <= 0:
            return
        while True:
            await asyncio.sleep(self.config.interval_s * self.rng.uniform(0.5, 1.5))
            await self.check()

    async def check(self) -> Move | None:
        """Plan the swarm's best move; make it if it is ours. Returns the move made."""
        node = self.node
        if not node.ready or node.leaving or not self.movable:
            return None
        now = time.monotonic()
        if now - node.stage_since < self.config.warmup_s:
            return None  # our own rate is still the estimate, not a measurement
        if self.last_move_s is not None and now - self.last_move_s < self.config.cooldown_s:
            return None
        if any(r.stage > 0 and not r.ready and not r.leaving for r in node.table.records()):
            return None  # someone is joining or moving: wait until their rates mean something
        plan = plan_move(self.replicas(ready_only=True), node.num_stages, self.config.quality)
        self.last_plan = plan
        if plan is None or plan.peer_id != node.peer_id:
            return None
        log.warning(
            "rebalancing: moving from stage %d to stage %d (bottleneck %.1f -> %.1f samples/s)",
            plan.source,
            plan.target,
            plan.current_min,
            plan.new_min,
        )
        self.moves += 1
        self.last_move_s = now
        await node.move_to(plan.target)
        return plan

    def status(self) -> dict[str, Any]:
        plan = self.last_plan
        return {
            "policy": self.config.policy,
            "own_block_rate": round(self.block_rate, 2),
            "movable": self.movable,
            "moves": self.moves,
            "last_move_age_s": (
                None if self.last_move_s is None else round(time.monotonic() - self.last_move_s, 1)
            ),
            "plan": None
            if plan is None
            else {
                "peer_id": plan.peer_id,
                "source": plan.source,
                "target": plan.target,
                "current_min": round(plan.current_min, 2),
                "new_min": round(plan.new_min, 2),
            },
        }
