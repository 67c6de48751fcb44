"""The daemon's side of ``--stage auto``: its own speed, the stage it joins, and moves.

Owns three things (policy in ``swarm.balance``, after Petals' block selection, arXiv
2209.01188, and SWARM's rebalancing, arXiv 2301.11913, section 3.2):

- **Own speed.** At start-up a ``--stage auto`` node benchmarks one block stage
  (``node.stage.speed``, cached in the state directory); with any configured compute delay
  that is what it publishes as its service rate until real work has been measured.
- **Joining.** ``balance.policy = "throughput"`` joins an empty stage first, else the block
  stage with the lowest total service rate; ``"replicas"`` keeps the simpler rule of the
  fewest replicas (a baseline for the benchmark).
- **Rebalancing.** At randomised intervals (uniform in 0.5..1.5 x ``balance.interval_s``) a
  movable node (``--stage auto``, not the head) runs the swarm-wide plan on what it knows
  (records of the stages its table holds, stand-ins from summaries for the rest, in which
  case the plan picks the source stage from totals first) and moves if the plan names it: not before it has served its stage for ``balance.warmup_s``
  (its rate must be a measurement), not within ``balance.cooldown_s`` of its last move, and
  not while any block replica is still joining or moving (their rates are not settled), for
  at most ``balance.transit_limit_s`` each (``swarm.balance.Transit``: a replica stuck,
  or claiming to be, does not hold the swarm's moves and refills for good).
- **Asking first.** Before it moves, a node the plan names asks each replica of the stage
  it leaves and of the stage it joins (``MoveRequest``) and goes only if all agree; it
  answers their requests the same way (``swarm.balance.MoveLock``: one replica at a time
  leaves or joins a stage, the lower peer id first). A replica that cannot be reached is
  not waited for: it cannot be moving too. Only replicas the table holds are asked (a far
  target known by a summary alone is not).

Counts moves, the moves it gave up because another replica moved first, and the answers it
gave; keeps the latest plan for ``node status`` and the metrics.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from node.context import NodeContext
from node.stage.speed import cached_or_measured_rate, with_delay
from protocol.messages import MoveAnswer, MoveRequest, PeerRecord
from swarm.assignment import choose_stage
from swarm.balance import (
    Move,
    MoveLock,
    Replica,
    Transit,
    join_stage,
    plan_move,
    settle_join,
)
from swarm.seams import NO_ANSWER, Refused, TransportError

log = logging.getLogger(__name__)


class Balancer:
    """Own speed, stage choice and throughput rebalancing for one node."""

    def __init__(
        self,
        ctx: NodeContext,
        *,
        record: Callable[[], PeerRecord],
        move_to: Callable[[int], Awaitable[None]],
    ) -> None:
        """``record()``: this node as peers see it; ``move_to(stage)``: leave this stage
        for another (the daemon's)."""
        self.ctx = ctx
        self.record = record
        self.move_to = move_to
        self.config = ctx.config.balance
        self.block_rate = 0.0
        """This node's measured (or cached) undelayed block-stage rate, samples/s."""
        self.moves = 0
        self.yielded = 0
        """Moves the plan named this node for that it did not make: another went first."""
        self.answers = {"granted": 0, "refused": 0}
        """Other replicas' requests to leave or join our stage, by our answer."""
        self.last_move_s: float | None = None
        self.last_plan: Move | None = None
        self.rng = random.Random(f"balance-{ctx.peer_id}")
        self.lock = MoveLock(ctx.peer_id)
        self.transit = Transit(self.config.transit_limit_s)
        self._overdue: set[tuple[str, int, int]] = set()
        """Replicas logged as no longer waited for (each once)."""

    # ---- own speed ----------------------------------------------------------------------

    async def measure(self) -> float:
        """Benchmark (or read the cached figure for) one block stage on this device. Only
        ``--stage auto`` nodes under the throughput policy need it; pinned nodes publish
        what they measure once work flows (a peer without a rate counts as a typical one)."""
        c = self.ctx.config
        if self.config.benchmark_s <= 0 or c.node.stage != "auto":
            return 0.0
        if self.config.policy != "throughput":
            return 0.0
        cache = Path(c.node.state_dir) / "speed.json" if c.node.state_dir else None
        self.block_rate = await asyncio.to_thread(cached_or_measured_rate, c, cache)
        return self.block_rate

    def estimate(self, stage: int) -> float:
        """What this node expects to serve on ``stage`` before it has measured real work."""
        return with_delay(self.block_rate, self.ctx.config, stage) if stage > 0 else 0.0

    # ---- the swarm as the policy sees it ------------------------------------------------

    def replicas(self, *, ready_only: bool) -> list[Replica]:
        """Live peers (and this node once it serves) as policy records."""
        state = self.ctx.state
        everyone = self.ctx.everyone().values()
        records = [r for rs in everyone for r in rs if r.ready or not ready_only]
        if state.stage >= 0 and not state.leaving and (state.ready or not ready_only):
            records.append(self.record())
        return [_policy_record(r) for r in records]

    def choose(self, announced: int = -1) -> int:
        """The stage a joining ``--stage auto`` node takes under the configured policy. With
        ``announced`` (the stage we announced and are settling on), one round of turn-taking
        among the nodes that announced it at the same moment: the lower peer ids go first
        (``swarm.balance.settle_join``)."""
        ctx = self.ctx
        records = [r for rs in ctx.everyone().values() for r in rs if r.peer_id != ctx.peer_id]
        settling = {r.peer_id for r in records if r.settling}
        others = [_policy_record(r) for r in records]
        stage = settle_join(ctx.peer_id, announced, others, settling, self._pick)
        rivals = [r.peer_id for r in records if r.settling and r.stage == announced >= 0]
        ahead = sum(p < ctx.peer_id for p in rivals)
        counts = {s: sum(r.stage == s for r in records) for s in range(ctx.num_stages)}
        totals = {
            s: round(sum(r.rate for r in others if r.stage == s), 1) for s in range(ctx.num_stages)
        }
        log.info(
            "stage auto: replicas per stage %s, samples/s %s%s -> stage %d",
            counts,
            totals,
            f", {len(rivals)} other(s) announced stage {announced} with us ({ahead} ahead)"
            if announced >= 0
            else "",
            stage,
        )
        return stage

    def _pick(self, placed: Sequence[Replica], rng: random.Random) -> int:
        """The configured joining rule over ``placed``."""
        n = self.ctx.num_stages
        if self.config.policy == "replicas":
            counts = {s: sum(r.stage == s for r in placed) for s in range(n)}
            if counts[0]:  # as with throughput: the head stage only when it is empty
                counts.pop(0)
            return choose_stage(counts, rng)
        return join_stage(placed, n, rng, self.block_rate or 1.0)

    # ---- rebalancing --------------------------------------------------------------------

    def in_transit(self) -> int:
        """Block replicas joining or moving that rebalancing and refills wait for now; one
        not ready for ``balance.transit_limit_s`` is no longer waited for (logged once,
        counted as ``transit_overdue``): it may be stuck, or saying so on purpose."""
        ctx = self.ctx
        now = ctx.clock.now()
        waiting = self.transit.waiting([r for rs in ctx.everyone().values() for r in rs], now)
        overdue = set(self.transit.overdue(now))
        for peer_id, _, stage in sorted(overdue - self._overdue):
            log.warning(
                "stage %d: replica %s has not been ready for %.0fs; rebalancing and refills"
                " no longer wait for it",
                stage,
                peer_id[:8],
                self.config.transit_limit_s,
            )
            ctx.counters["transit_overdue"] += 1
        self._overdue = overdue
        return len(waiting)

    @property
    def movable(self) -> bool:
        return self.ctx.config.node.stage == "auto" and self.ctx.state.stage > 0

    async def run(self) -> None:
        """Rebalancing checks at randomised intervals, until cancelled."""
        if self.config.policy != "throughput" or self.config.interval_s <= 0:
            return
        while True:
            await asyncio.sleep(self.config.interval_s * self.rng.uniform(0.5, 1.5))
            await self.check()

    async def check(self) -> Move | None:
        """Plan the swarm's best move; make it if it is ours. Returns the move made."""
        ctx, state = self.ctx, self.ctx.state
        if not state.serving or not self.movable:
            return None
        now = time.monotonic()
        if now - state.stage_since < self.config.warmup_s:
            return None  # our own rate is still the estimate, not a measurement
        if self.last_move_s is not None and now - self.last_move_s < self.config.cooldown_s:
            return None
        if self.in_transit():
            return None  # someone is joining or moving: wait until their rates mean something
        plan = plan_move(
            self.replicas(ready_only=True),
            ctx.num_stages,
            self.config.quality,
            by_stage=ctx.partial,
        )
        self.last_plan = plan
        if plan is None or plan.peer_id != ctx.peer_id:
            return None
        if not await self.ask_to_move(plan):
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
        try:
            await self.move_to(plan.target)
        finally:
            self.lock.reset()
        return plan

    # ---- one replica at a time leaves or joins a stage ----------------------------------

    async def ask_to_move(self, plan: Move) -> bool:
        """Ask every replica of the stage we leave and of the stage we join whether we may;
        True when we go (False is counted in ``yielded``)."""
        ctx = self.ctx
        if not self.lock.want(ctx.clock.now()):
            log.info("rebalancing: another replica is moving from or to stage %d", plan.source)
            self.yielded += 1
            return False
        asked = [
            r
            for r in ctx.table.records()
            if r.stage in (plan.source, plan.target) and not r.leaving and r.peer_id != ctx.peer_id
        ]
        msg = MoveRequest(stage=plan.source, target=plan.target, sender=ctx.peer_id)
        answers = await asyncio.gather(*(self._ask(r, msg) for r in asked))
        go = self.lock.conclude(all(answers))
        if not go:
            log.info(
                "rebalancing: another replica moves from or to stage %d or %d first; staying",
                plan.source,
                plan.target,
            )
            self.yielded += 1
        return go

    async def _ask(self, peer: PeerRecord, msg: MoveRequest) -> bool:
        """Whether ``peer`` lets us move (one that cannot be reached cannot be moving too)."""
        timeout_s = self.ctx.config.membership.request_timeout_s
        try:
            reply = await self.ctx.transport.request(peer.address, msg, timeout_s, peer.peer_id)
        except TransportError as e:
            if e.code in NO_ANSWER:
                log.info("rebalancing: %s did not answer (%s); not waiting", peer.peer_id[:8], e)
                return True
            log.info("rebalancing: %s refused our move: %s", peer.peer_id[:8], e)
            return False
        if not isinstance(reply, MoveAnswer):
            log.info("rebalancing: %s answered %s to a move request", peer.peer_id[:8], reply.TYPE)
            return False
        if not reply.granted:
            log.info("rebalancing: %s keeps us: %s", peer.peer_id[:8], reply.reason)
        return reply.granted

    def on_request(self, msg: MoveRequest) -> MoveAnswer:
        """A replica asks to leave our stage or to join it (``MoveLock.answer``); a request
        about two stages we do not serve is granted (our answer does not matter there)."""
        ctx, stage = self.ctx, self.ctx.state.stage
        if not 0 < msg.target < ctx.num_stages or msg.target == msg.stage:
            raise Refused(
                "bad_move",
                f"a move from stage {msg.stage} to {msg.target} (block stages are "
                f"1..{ctx.num_stages - 1})",
                400,
            )
        if stage not in (msg.stage, msg.target):
            return MoveAnswer(granted=True, reason=f"this node serves stage {stage}")
        granted, reason = self.lock.answer(msg.sender, ctx.clock.now())
        self.answers["granted" if granted else "refused"] += 1
        log.info(
            "rebalancing: %s asks to move from stage %d to %d: %s",
            msg.sender[:8],
            msg.stage,
            msg.target,
            "yes" if granted else f"no, {reason}",
        )
        return MoveAnswer(granted=granted, reason=reason)

    def status(self) -> dict[str, Any]:
        plan = self.last_plan
        return {
            "policy": self.config.policy,
            "own_block_rate": round(self.block_rate, 2),
            "movable": self.movable,
            "moves": self.moves,
            "yielded": self.yielded,
            "answers": dict(self.answers),
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


def _policy_record(r: PeerRecord) -> Replica:
    return Replica(r.peer_id, r.stage, r.throughput, r.movable)
