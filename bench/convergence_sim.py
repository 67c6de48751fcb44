"""The whole swarm in one process, for convergence studies that need many replicas and tokens.

Every replica of every stage is a real ``node.stage.runner.StageRunner``: the daemon's model
code, its inner optimizer (accumulation to ``train.step_samples``, clipping, Adam, the
learning-rate schedule, the spike guards) and its outer steps (``outer_contribution``,
``decode_offer``, ``apply_noloco``, ``apply_diloco``, ``apply_grads``, the pure rules of
``swarm.outer``). Only the network is gone: a microbatch's hops are function calls, in one
thread, one microbatch at a time, so ``R`` replicas of every stage and tens of millions of
tokens fit on two cores.

``in_flight`` (1 by default: synchronous) emulates the live pipeline's staleness: each head
replica keeps that many microbatches between their forward and their loss and backward, so
a microbatch's gradient is applied ``in_flight - 1`` inner steps after its forward, with the
weights it was made with (the runner's weight stashing), as in the daemon (PipeDream,
arXiv 1806.03377, section 3.3; SWARM, arXiv 2301.11913, section 3). It reproduces in one
process, deterministically, what asynchrony costs the live swarm. The window is also the
runners' ``train.max_in_flight`` (unless ``window`` says otherwise: a control with 2bw's
inner steps and no staleness), so ``train.staleness = "2bw"`` in ``config`` bounds the
staleness as the daemon would (an inner step per at least ``in_flight`` microbatches,
``node.stage.runner``).

What a global step is: every head replica issues one microbatch of its own data shard, and
each is routed through the block stages along a fresh random permutation of each stage's
replicas (NoLoCo's own routing, arXiv 2506.10911; SWARM's router reduces to it when all
replicas are equally fast), so every replica of every stage computes one microbatch per
global step and all of them take their inner steps together. Every method sees the same
tokens in the same order (the same seed) and the same global batch per optimizer step,
``R * step_samples`` samples per stage:

- ``noloco``: every H inner steps each stage's replicas are paired by a random perfect
  matching and each pair exchanges its offers (``docs/algorithms.md`` section 4);
- ``diloco``: every H inner steps each stage's replicas average their outer gradients (what
  the ring computes) and take DiLoCo's Nesterov step;
- ``allreduce``: data parallel, the gradients averaged at every inner step;
- ``none``: independent replicas (the routing still mixes them).

Evaluation: the fixed held-out microbatches of the head stage, each through a fixed random
path of replicas (seeded), mean loss. Spread: per block stage, the RMS distance of the
replicas' live weights from their mean, averaged over the block stages.

Used by ``bench/convergence.py`` (the study, and its check against the live swarm).
"""

from __future__ import annotations

import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.nn.utils import parameters_to_vector

from node.config import Config
from node.data.dataset import TextDataset, open_dataset
from node.stage.runner import StageRunner
from swarm.outer import rms_distance
from swarm.wirecodec import sync_codec_unmeasured

Progress = Callable[[dict[str, Any]], None]


@dataclass
class Curve:
    """What one simulated run measured, at every evaluation point."""

    method: str
    seed: int
    replicas: int
    tokens: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    spread: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    outer_rounds: int = 0
    inner_steps: int = 0


class SimulatedSwarm:
    """``replicas`` replicas of each of the ``1 + N`` stages of ``config``'s model."""

    def __init__(
        self,
        config: Config,
        replicas: int,
        seed: int,
        in_flight: int = 1,
        window: int = 0,
        speeds: dict[int, list[float]] | None = None,
        clock_every: int = 0,
        across: bool = False,
    ) -> None:
        # equal replicas: the schedules agree; unequal ones need the clock (``clock_every``)
        sync = replace(config.sync, schedule="clock" if clock_every else "steps")
        self.speeds = speeds or {}
        """Block stage -> each replica's relative speed (stages not named: equal speeds)."""
        self.clock_every = clock_every
        """Global steps per round of the clock schedule (0: every H inner steps)."""
        self.across = across
        """NoLoCo pairs in a stage of unequal ``speeds`` join a replica of the faster half
        to one of the slower half, at random (else any two at random, the published rule)."""

        self.in_flight = max(1, in_flight)
        # the emulated window is the runners' max_in_flight (train.staleness = 2bw reads it)
        train = replace(config.train, max_in_flight=window or self.in_flight)
        swarm = replace(config.swarm, seed=seed)
        self.config = replace(config, sync=sync, swarm=swarm, train=train)
        self.num_replicas = replicas
        self.num_stages = config.swarm.num_block_stages + 1
        self.route_rng = random.Random(f"route-{seed}")  # the same routes for every method
        self.pair_rng = random.Random(f"pairs-{seed}")
        self.across_rng = random.Random(f"across-{seed}")  # ``across`` leaves pair_rng's draws
        self.runners: list[list[StageRunner]] = []
        for stage in range(self.num_stages):
            row = []
            for _ in range(replicas):
                r = StageRunner(self.config, stage)
                r._build()  # the compute thread is this one
                row.append(r)
            self.runners.append(row)
        data = self.config.data
        vocab = self.config.model.vocab_size
        self.datasets: list[TextDataset] = [
            open_dataset(replace(data, num_shards=replicas), shard=i, seed=seed, vocab_size=vocab)
            for i in range(replicas)
        ]
        self.generators = [torch.Generator().manual_seed(seed * 1000 + i) for i in range(replicas)]
        self.eval_batches = self.datasets[0].eval_batches(
            self.config.train.eval_batches, data.batch_size, data.seq_len
        )
        eval_rng = random.Random(f"eval-{seed}")
        self.eval_paths = [
            [eval_rng.randrange(replicas) for _ in range(self.num_stages)]
            for _ in self.eval_batches
        ]
        self.ref_steps = {s: self._usual_steps(s) for s in range(self.num_stages)}
        """Each stage's usual inner steps per round on the clock (``_usual_steps``)."""
        self.outer_rounds = 0
        self.last_pairs: dict[int, list[tuple[int, int]]] = {}
        """Stage -> the pairs (replica indices) of its last NoLoCo round."""
        self.steps_done = 0
        self.mb = 0
        self.pending: deque[tuple[str, list[int], torch.Tensor, torch.Tensor, torch.Tensor]] = (
            deque()
        )
        """Microbatches past their forward: id, path, ids, labels, final hidden states."""

    # ---- one global step ----------------------------------------------------------------

    def _usual_steps(self, stage: int) -> float:
        """On the clock: the stage's usual inner steps per round, as the daemon derives it
        (``node.services.sync``: the period over the median of the replicas' seconds per
        step), from the share of microbatches each replica is routed; 0 off the clock."""
        if not self.clock_every:
            return 0.0
        speeds = self.speeds.get(stage) or [1.0] * self.num_replicas
        microbatches = [
            self.clock_every * self.num_replicas * v / sum(speeds) for v in speeds
        ]  # per replica and round
        per_step = self.config.train.step_samples / self.config.data.batch_size
        seconds_per_step = [self.clock_every * per_step / m for m in microbatches]
        return self.clock_every / statistics.median(seconds_per_step)

    def global_step(self) -> int:
        """Every head replica's microbatch through a random permutation of each stage's
        replicas (or, for a stage of unequal ``speeds``, to a replica drawn in proportion to
        its speed, as SWARM's routing by throughput shares work), forward and back; then
        any outer round that came due. Returns tokens."""
        perms = [list(range(self.num_replicas)) for _ in range(self.num_stages)]
        for stage in range(1, self.num_stages):
            if stage in self.speeds:
                perms[stage] = self.route_rng.choices(
                    range(self.num_replicas), weights=self.speeds[stage], k=self.num_replicas
                )
            else:
                self.route_rng.shuffle(perms[stage])
        tokens = 0
        for k in range(self.num_replicas):
            path = [k] + [perms[s][k] for s in range(1, self.num_stages)]
            self._forward(path)
            while len(self.pending) > (self.in_flight - 1) * self.num_replicas:
                tokens += self._finish()
        self.steps_done += 1
        if self.clock_every and self.steps_done % self.clock_every == 0:
            for row in self.runners:
                for r in row:
                    r.begin_outer()
        self._synchronise()
        return tokens

    def _forward(self, path: list[int]) -> None:
        data = self.config.data
        head = self.runners[0][path[0]]
        ids, labels = self.datasets[path[0]].sample_batch(
            self.generators[path[0]], data.batch_size, data.seq_len
        )
        self.mb += 1
        mb_id = f"sim.{self.mb}"
        x = head.head_embed(ids)
        for stage in range(1, self.num_stages):
            x = self.runners[stage][path[stage]].block_forward(mb_id, x, train=True)
        self.pending.append((mb_id, path, ids, labels, x))

    def _finish(self) -> int:
        """The oldest microbatch in flight: its loss, its backward; returns its tokens."""
        mb_id, path, ids, labels, x = self.pending.popleft()
        head = self.runners[0][path[0]]
        _, grad = head.head_loss(x, labels, train=True)
        if grad is not None:  # else a loss spike: nobody trains on it, as in the daemon
            for stage in range(self.num_stages - 1, 0, -1):
                grad = self.runners[stage][path[stage]].block_backward(mb_id, grad)
            head.head_backward(ids, grad)
        else:
            for stage in range(1, self.num_stages):
                self.runners[stage][path[stage]].drop_saved(mb_id)
        return int(ids.numel())

    def _synchronise(self) -> None:
        """Run the rounds that came due on every replica of a stage. A replica that skipped
        an inner step (its gradient norm spiked) reaches the round a step later; those
        already there hold their steps meanwhile, as the daemon's replicas do."""
        for row in self.runners:
            due = {r.sync_due for r in row}
            if due == {"outer"}:
                method = self.config.sync.method
                if method == "noloco":
                    self._noloco(row, self.ref_steps[row[0].stage])
                else:
                    self._diloco(row)
                for r in row:
                    r.finish_sync(True)
                self.outer_rounds += 1
            elif due == {"grads"}:
                grads = [r.pending_grads for r in row]
                mean = torch.stack([g for g in grads if g is not None]).mean(0)
                for r in row:
                    r.apply_grads(mean)
                    r.finish_sync(False)

    def _noloco(self, row: list[StageRunner], ref_steps: float = 0.0) -> None:
        order = self._pairing(row[0].stage, len(row))
        codec = sync_codec_unmeasured(self.config.sync.codec)  # no links here: fp32 for auto
        offers = {i: row[i].outer_contribution(codec, ref_steps) for i in order}
        self.last_pairs[row[0].stage] = list(zip(order[0::2], order[1::2], strict=False))
        for a, b in self.last_pairs[row[0].stage]:
            offer_b, offer_a = row[a].decode_offer(offers[b]), row[b].decode_offer(offers[a])
            row[a].apply_noloco(offer_b, ref_steps)
            row[b].apply_noloco(offer_a, ref_steps)
        if len(order) % 2:  # the odd replica out steps alone
            row[order[-1]].apply_noloco(None, ref_steps)

    def _pairing(self, stage: int, n: int) -> list[int]:
        """Replica indices in pairing order: ``order[0::2]`` with ``order[1::2]``. At random;
        with ``across`` and unequal speeds, each of the faster half with one of the slower
        half (ties in speed broken at random), so no round pairs the fast together."""
        order = list(range(n))
        self.pair_rng.shuffle(order)
        speeds = self.speeds.get(stage)
        if not (self.across and speeds) or len(set(speeds)) < 2:
            return order
        ranked = sorted(order, key=lambda i: -speeds[i])  # stable: shuffled among equals
        fast, slow = ranked[: n // 2], ranked[n // 2 :]
        self.across_rng.shuffle(slow)  # pair_rng draws as without ``across``: other stages'
        # pairs stay those of the published rule's runs
        return [i for pair in zip(fast, slow, strict=False) for i in pair] + slow[len(fast) :]

    def _diloco(self, row: list[StageRunner]) -> None:
        mean = torch.stack([r.outer_delta() for r in row]).mean(0)
        places = [r.place for r in row]
        for r in row:
            r.apply_diloco(mean)
        if all(places):  # every member shares its place: the mean, as the daemon's ring has it
            mean_place = sum(p[0] for p in places) / len(places)
            for r in row:
                r.take_place(mean_place, self.ref_steps[r.stage])

    # ---- measurements -------------------------------------------------------------------

    def evaluate(self) -> float:
        losses = []
        for (ids, labels), path in zip(self.eval_batches, self.eval_paths, strict=True):
            x = self.runners[0][path[0]].head_embed(ids)
            for stage in range(1, self.num_stages):
                x = self.runners[stage][path[stage]].block_forward("eval", x, train=False)
            loss, _ = self.runners[0][path[0]].head_loss(x, labels, train=False)
            losses.append(loss)
        return statistics.mean(losses)

    def slow_spread(self, stage: int) -> float:
        """``spread_of`` one stage's slow weights (what ``bench.sync_unequal`` samples live)."""
        return spread_of([r.phi for r in self.runners[stage]])

    def spread(self) -> float:
        """RMS distance of each block stage's replicas from their mean, averaged."""
        out = []
        for row in self.runners[1:]:
            thetas = torch.stack(
                [parameters_to_vector(r.module.parameters()).detach() for r in row]
            )
            out.append(float(torch.sqrt(((thetas - thetas.mean(0)) ** 2).mean())))
        return statistics.mean(out)


def distances_from_mean(states: list[torch.Tensor]) -> list[float]:
    """RMS distance of each replica's weights from the replicas' mean, one per replica."""
    mean = torch.stack(states).mean(0)
    return [rms_distance(s, mean) for s in states]


def spread_of(states: list[torch.Tensor]) -> float:
    """RMS distance of each replica's weights from the replicas' mean, averaged over them."""
    return statistics.mean(distances_from_mean(states))


def simulate(
    config: Config,
    replicas: int,
    seed: int,
    tokens: int,
    num_evals: int = 10,
    progress: Progress | None = None,
    milestones: list[int] | None = None,
    in_flight: int = 1,
    window: int = 0,
) -> Curve:
    """Train the simulated swarm for ``tokens`` tokens, evaluating at the start and
    ``num_evals`` times on the way; or, with ``milestones``, at the first global step that
    reaches each of those token counts (those of another curve, to compare at equal tokens).
    ``in_flight``: microbatches each head replica keeps in flight, ``window``: the runners'
    ``max_in_flight`` (0: ``in_flight``; ``SimulatedSwarm``)."""
    swarm = SimulatedSwarm(config, replicas, seed, in_flight, window)
    curve = Curve(config.sync.method, seed, replicas)
    t0 = time.monotonic()
    done = 0
    if milestones is None:
        milestones = [0, *(tokens * (i + 1) // num_evals for i in range(num_evals))]

    def point() -> None:
        curve.tokens.append(done)
        curve.eval_loss.append(swarm.evaluate())
        curve.spread.append(swarm.spread())
        curve.wall_s.append(round(time.monotonic() - t0, 1))
        if progress is not None:
            progress(
                {
                    "method": curve.method,
                    "seed": seed,
                    "tokens": done,
                    "eval_loss": curve.eval_loss[-1],
                    "spread": curve.spread[-1],
                }
            )

    for milestone in milestones:
        while done < milestone:
            done += swarm.global_step()
        point()
    curve.outer_rounds = swarm.outer_rounds
    curve.inner_steps = swarm.runners[1][0].step
    return curve
