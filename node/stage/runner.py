"""The stage runner: this node's slice of the model and every piece of torch work on it.

Owns the stage module, its inner optimizer (Adam, global-norm clipping, linear warm-up then
cosine decay), the activations saved between a microbatch's forward and backward (with the
weights they were made with: ``node.stage.stash``), the outer optimizer's state (NoLoCo's and
DiLoCo's slow weights and momentum, ``swarm.outer``), state transfer, and the single compute
thread. ``compute`` runs a function on that thread, so the event loop never runs torch code
and torch never sees two threads.

Gradients from every microbatch are accumulated until ``step_samples`` samples, averaged
per microbatch, clipped to ``clip_norm`` and applied. With ``train.staleness = "2bw"`` an
inner step waits for ``k`` times as many samples, at least the ``max_in_flight``
microbatches a head keeps in the pipeline (PipeDream-2BW, arXiv 2006.09503, its 2BW rule:
gradient accumulation over at least as many microbatches as are in flight), so that at most
one inner step falls between a microbatch's forward and its backward, instead of up to
``max_in_flight - 1``. Such a step counts as ``k`` in ``step`` (and in ``step_s``): the
learning-rate schedule, the outer period and every other count in steps keep meaning
``step_samples`` samples each, so the schedules per token are the same with either rule.

On the head stage a microbatch's gradient arrives in two parts at two times: the output
side's (final norm, LM head) at its loss, the embedding's when its gradient has come back
through every block stage. With several microbatches in flight, other microbatches'
losses land in between, so each side is averaged over the microbatches that actually gave
it a gradient (counted apart): dividing the output side's sum by the embedding's count
would scale its gradient by however many losses happened to arrive before the step, a
different number each step.

Does not own routing, peers, or the wire; the daemon hands it tensors and ids.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.func import functional_call
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from node.config import Config, TrainConfig
from node.stage.adam import Adam
from node.stage.model import Attention, BlockStage, HeadStage, build_stage
from node.stage.outer import Encoded, Offer, OuterState, is_place
from node.stage.predict import WeightPredictor
from node.stage.speed import configure_compute_thread
from node.stage.spikes import SpikeGuard
from node.stage.stash import WeightStash
from swarm.outer import (
    DiLoCoConfig,
    NoLoCoConfig,
    momentum_decay,
    pair_position,
    shared_position,
)
from swarm.schedule import Pace

T = TypeVar("T")
log = logging.getLogger(__name__)

NO_EPOCH = -1
"""A saved graph's epoch when it refers to no live weights: none of them need stashing."""

RATE_DECAY = 0.95
"""Per piece of work (a forward, a backward) decay of the service-rate sums: ~20 pieces."""


def staleness_units(config: Config) -> int:
    """Units of ``step_samples`` samples per inner step under ``train.staleness``: 1 for
    ``stash``; for ``2bw`` the smallest ``k`` with ``k * step_samples >= max_in_flight *
    data.batch_size`` (PipeDream-2BW's accumulation over the microbatches in flight)."""
    t = config.train
    if t.staleness != "2bw":
        return 1
    return max(1, -(-t.max_in_flight * config.data.batch_size // t.step_samples))


def lr_at(step: float, train: TrainConfig) -> float:
    """Learning rate of inner step ``step``: linear warm-up, cosine to ``lr * min_lr_ratio``."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    span = max(1, train.total_steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / span)
    floor = train.lr * train.min_lr_ratio
    return floor + (train.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


PARAM_PREFIX = "param."
"""Weights in a stage's state tensors are named ``param.<name in the stage module>``."""


def params_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights among a stage state's tensors, named as the stage module names them."""
    return {
        k.removeprefix(PARAM_PREFIX): v for k, v in tensors.items() if k.startswith(PARAM_PREFIX)
    }


def as_state(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weights named as the stage module names them, as a stage state's tensors."""
    return {f"{PARAM_PREFIX}{k}": v for k, v in params.items()}


@dataclass
class _Saved:
    """What a block stage keeps of one microbatch until its gradient comes back."""

    x: torch.Tensor
    out: torch.Tensor
    epoch: int
    """The weights' epoch the graph was built with (``node.stage.stash``), or ``NO_EPOCH``
    when it was built on predicted weights (``node.stage.predict``), which it holds itself."""
    created_s: float
    step: int
    """The runner's ``step`` at the forward: the backward's delay is counted from it."""


@dataclass
class Thermometers:
    """YaLM-100B's "thermometers" of this stage: a runaway maximum precedes divergence."""

    act_max: float = 0.0
    act_min: float = 0.0
    grad_norm: float = 0.0
    """The latest inner step's gradient norm after clipping (what CheckFree weighs by)."""
    grad_norm_preclip: float = 0.0
    """The same before clipping: a runaway shows here, never in the clipped norm."""
    attn_logit_max: dict[int, float] = field(default_factory=dict)
    """Largest pre-softmax attention score per block (global index), on sampled forwards."""


LOGITS_EVERY = 16
"""Training forwards between two samples of the attention-logit thermometer (it costs one
more ``q @ k^T`` per block)."""


PLACE_ROUNDS = 8
"""How many rounds' inner steps (``H``, or the stage's usual steps per round when larger)
the mean place of the replicas we synchronised with (a NoLoCo pair, a DiLoCo ring) may be
from ours before we move only half that far towards it (``swarm.outer.shared_position``):
honest places differ by a few rounds' steps, and a lie moves us by at most half of this a
round."""


class StageRunner:
    """One stage replica: weights, optimizer and saved activations, driven from one thread."""

    def __init__(self, config: Config, stage: int) -> None:
        self.config = config
        self.train = config.train
        self.stage = stage
        self.device = torch.device(config.node.device)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"compute-s{stage}")
        self.module: HeadStage | BlockStage
        self.optimizer: Adam
        self.step = 0
        """Inner steps taken, in units of ``step_samples`` samples (``step_units`` per step)."""
        self.step_units = staleness_units(config)
        """What one optimizer step counts in ``step``: 1, or k with ``train.staleness = 2bw``."""
        self.schedule_step = 0.0
        """This replica's position in the learning-rate schedule, in the units of ``step``:
        it advances with ``step`` and, with ``sync.share_schedule``, is averaged with each
        NoLoCo partner (``swarm.outer.pair_position``), so a slow replica is not left in its
        warm-up while the stage's others have decayed (over a DiLoCo ring only with
        ``sync.diloco_share_schedule``); on the clock it is first set to the stage's usual
        steps past its place at the last outer step (``_round_place``)."""
        self.places_clamped = 0
        """Mean places of the replicas we synchronised with that lay further from ours than
        half ``PLACE_ROUNDS`` rounds' steps (moved only that far: a peer that lies, or a bug)."""
        self.samples = 0
        self._acc_samples = 0
        self._acc_microbatches = 0
        """Microbatches whose backward is in ``.grad`` (the head: the embedding's)."""
        self._acc_losses = 0
        """Head stage: microbatches whose loss gradient is in the output side's ``.grad``."""
        self._output_side: set[int] = set()
        """Head stage: ids of the output side's parameters (averaged over ``_acc_losses``)."""
        self.sync = sync = config.sync
        self.noloco = NoLoCoConfig(sync.alpha, sync.beta, sync.gamma, sync.max_step_scale)
        self.diloco = DiLoCoConfig(sync.diloco_lr, sync.diloco_momentum)
        self.hold = False
        self.sync_due: str | None = None
        self.pending_grads: torch.Tensor | None = None
        self.outer_rounds = 0
        self._outer_at_step = 0
        """``step`` at the last outer step: the inner steps of the current round follow it."""
        self._place_at_outer = 0.0
        """``schedule_step`` just after the last outer step (``_round_place``)."""
        self.pace = Pace()
        """This replica's pace over its last rounds (the stage service sets the window)."""
        self.step_s = 0.0
        """Wall-clock seconds per inner step, in units of ``step_samples`` samples, over
        the pace's window (its rounds' exchanges and any stalls included), 0 until measured."""
        self.monotonic = time.monotonic
        """The clock step times are read from."""
        self.lr_scale = 1.0
        """Multiplier of the scheduled learning rate: CheckFree's boost after a rebuild."""
        self.lr_scale_until = -1
        """The step before which ``lr_scale`` applies (-1: for good, as CheckFree's code has it)."""
        self.outer: OuterState
        self._saved: dict[str, _Saved] = {}
        self.stash = WeightStash()
        self.predictor = WeightPredictor(
            config.train.predict_weights and stage > 0, config.train.predict_steps
        )
        """Measures the gradient delay; with ``train.predict_weights``, a block stage's
        training forwards run on the weights predicted for when their gradient lands."""
        self.thermo = Thermometers()
        self.grad_guard = SpikeGuard(config.train.spike_grad_multiple)
        """Skips an inner step whose gradient norm (before clipping) spikes."""
        self.loss_guard = SpikeGuard(config.train.spike_loss_multiple)
        """Head stage: trains on no microbatch whose loss spikes or is not finite."""
        self.num_forwards = 0
        self.delay_s = config.train.delay_on(stage)
        self.compute_s = 0.0
        self._recent_samples = 0.0
        self._recent_s = 0.0
        self._recent_jobs = 0.0

    async def compute(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the compute thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def start(self) -> None:
        await self.compute(self._build)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _build(self) -> None:
        configure_compute_thread(self.config)
        c = self.config
        self.module = build_stage(c.model, c.swarm.num_block_stages, self.stage, c.swarm.seed)
        self.module.to(self.device)
        if isinstance(self.module, HeadStage):
            out_side = [*self.module.final_norm.parameters(), *self.module.lm_head.parameters()]
            self._output_side = {id(p) for p in out_side}
        self.optimizer = self._new_optimizer()
        self._init_outer()

    def _new_optimizer(self) -> Adam:
        """A fresh inner Adam (``node.stage.adam``) at the scheduled learning rate."""
        return Adam(
            self.module.parameters(),
            lr=lr_at(self.schedule_step, self.train),
            betas=self.train.betas,
            eps=1e-8,
        )

    def _autocast(self) -> AbstractContextManager[Any]:
        if self.train.compute_dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    # ---- block stages -------------------------------------------------------------------

    def block_forward(self, mb_id: str, x: torch.Tensor, train: bool) -> torch.Tensor:
        """Output activations for ``x``; in training, keeps what backward needs under ``mb_id``."""
        assert isinstance(self.module, BlockStage)
        t0 = time.perf_counter()
        if self.delay_s:
            time.sleep(self.delay_s)
        x = x.to(self.device, torch.float32).detach()  # never flag the caller's tensor
        if not train:
            with torch.no_grad(), self._autocast():
                out = self.module(x).float()
        else:
            x.requires_grad_(True)
            self.num_forwards += 1
            observe = self.num_forwards % LOGITS_EVERY == 1
            self._observe_logits(observe)
            ahead = self.predictor.weights(self.module.named_parameters(), self.stash.epoch)
            with self._autocast(), self.stash.hooks(self.module):
                if ahead is None:
                    out = self.module(x).float()
                else:  # the graph refers to the predicted tensors, not to the live weights
                    out = functional_call(self.module, ahead, (x,)).float()
            epoch = self.stash.epoch if ahead is None else NO_EPOCH  # nothing to stash for it
            self._saved[mb_id] = _Saved(x, out, epoch, time.monotonic(), self.step)
            if observe:
                self._observe_logits(False)
        self._observe_activations(out)
        self._account(t0, 0)
        return out.detach()

    def block_backward(self, mb_id: str, grad_out: torch.Tensor) -> torch.Tensor:
        """Gradient w.r.t. the input of ``mb_id``; accumulates parameter gradients."""
        t0 = time.perf_counter()
        saved = self._saved.pop(mb_id)
        self.predictor.observe((self.step - saved.step) / self.step_units)
        x = saved.x
        saved.out.backward(grad_out.to(self.device, torch.float32))
        self.stash.drop_unused(self._live_epochs)
        assert x.grad is not None
        self._accumulate(x.shape[0])
        self._account(t0, x.shape[0])
        return x.grad

    def drop_saved(self, mb_id: str) -> None:
        """Free ``mb_id``'s activations: its gradient is not coming (a skipped loss spike)."""
        self._saved.pop(mb_id, None)
        self.stash.drop_unused(self._live_epochs)

    def has_saved(self, mb_id: str) -> bool:
        return mb_id in self._saved

    @property
    def num_saved(self) -> int:
        """Forwards still waiting for their backward (what a drain waits for)."""
        return len(self._saved)

    def expire_saved(self, now: float) -> int:
        """Free activations older than the TTL (their gradient is not coming); returns how many."""
        old = [k for k, s in self._saved.items() if now - s.created_s > self.train.activation_ttl_s]
        for k in old:
            del self._saved[k]
        self.stash.drop_unused(self._live_epochs)
        return len(old)

    # ---- weight stashing ----------------------------------------------------------------

    def _live_epochs(self) -> set[int]:
        return {s.epoch for s in self._saved.values()}

    def _weights_change(self) -> None:
        """Call before changing the weights: stash them if a saved graph still refers to them."""
        self.stash.change(self.module, self._live_epochs)

    # ---- the head stage -----------------------------------------------------------------

    def head_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedded (and normed) tokens to send into block stage 1."""
        assert isinstance(self.module, HeadStage)
        with torch.no_grad(), self._autocast():
            return self.module.embed(ids.to(self.device)).float()

    def head_loss(
        self, h: torch.Tensor, labels: torch.Tensor, train: bool
    ) -> tuple[float, torch.Tensor | None]:
        """Loss of the final hidden states; in training also its gradient w.r.t. ``h``."""
        assert isinstance(self.module, HeadStage)
        t0 = time.perf_counter()
        h = h.to(self.device, torch.float32).detach()
        labels = labels.to(self.device)
        if not train:
            with torch.no_grad(), self._autocast():
                return float(self.module.loss(h, labels)), None
        h.requires_grad_(True)
        with self._autocast():
            loss = self.module.loss(h, labels)
        value = float(loss.detach())
        if self.loss_guard.is_spike(value):  # NaN or a spike never reaches any parameter
            self._account(t0, 0)
            return value, None
        loss.backward()
        self._acc_losses += 1  # the output side's part of this microbatch is in .grad now
        self._account(t0, 0)
        assert h.grad is not None
        return value, h.grad

    def head_backward(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """Finish a microbatch: backpropagate into the embedding (recomputed, it is cheap)."""
        assert isinstance(self.module, HeadStage)
        t0 = time.perf_counter()
        with self._autocast():
            h = self.module.embed(ids.to(self.device)).float()
        h.backward(grad.to(self.device, torch.float32))
        self._accumulate(ids.shape[0])
        self._account(t0, ids.shape[0])

    # ---- optimizer ----------------------------------------------------------------------

    def _accumulate(self, num_samples: int) -> None:
        self._acc_samples += num_samples
        self._acc_microbatches += 1
        self.samples += num_samples
        self._maybe_step()

    def _maybe_step(self) -> None:
        """Step when enough samples are in, unless an outer synchronisation holds steps."""
        if self.hold or self._acc_samples < self.step_units * self.train.step_samples:
            return
        if self.sync.method == "allreduce":
            # Data parallel: hand the averaged gradients to the ring; new ones keep coming.
            self.pending_grads = self._take_grads()
            self.hold, self.sync_due = True, "grads"
            return
        stepped = self._optimizer_step()
        by_steps = self.sync.method in ("noloco", "diloco") and self.sync.schedule == "steps"
        h = self.sync.outer_steps  # a step of k units may cross a round's boundary
        crossed = self.step // h > (self.step - self.step_units) // h
        if stepped and by_steps and crossed:
            self.hold, self.sync_due = True, "outer"

    def begin_outer(self) -> None:
        """A clock-scheduled outer round starts now: hold optimizer steps until it ends."""
        self.hold, self.sync_due = True, "outer"

    def _take_grads(self) -> torch.Tensor:
        """The accumulated mean gradient as one flat vector; accumulation starts afresh."""
        grads = [
            (p.grad / self._grad_count(p)) if p.grad is not None else torch.zeros_like(p)
            for p in self.module.parameters()
        ]
        self.optimizer.zero_grad(set_to_none=True)
        self._reset_accumulation()
        return parameters_to_vector(grads)

    def _grad_count(self, p: torch.Tensor) -> int:
        """Microbatches whose gradients ``p.grad`` holds (at least 1)."""
        count = self._acc_losses if id(p) in self._output_side else self._acc_microbatches
        return max(1, count)

    def _reset_accumulation(self) -> None:
        self._acc_samples = self._acc_microbatches = self._acc_losses = 0

    def _optimizer_step(self, flat_grads: torch.Tensor | None = None) -> bool:
        """Clip, set the scheduled learning rate, step Adam; ``flat_grads`` replaces .grad.
        False when the step was skipped (its gradient norm spiked)."""
        params = list(self.module.parameters())
        kept: list[torch.Tensor | None] | None = None
        if flat_grads is None:
            for p in params:
                if p.grad is not None:
                    p.grad.div_(self._grad_count(p))
            self._reset_accumulation()
        else:
            kept = [p.grad for p in params]  # what arrived while the ring was running
            for p, g in zip(params, _unflatten(flat_grads, params), strict=True):
                p.grad = g
        norm = float(
            torch.nn.utils.clip_grad_norm_(
                [p for p in params if p.grad is not None], self.train.clip_norm
            )
        )
        self.thermo.grad_norm_preclip = norm
        if self.grad_guard.is_spike(norm):  # skip this step: drop its gradients
            average = self.grad_guard.average
            log.warning(
                "inner step %d skipped: gradient norm %.3g, average %.3g", self.step, norm, average
            )
            self.optimizer.zero_grad(set_to_none=True)
            if kept is not None:
                for p, held in zip(params, kept, strict=True):
                    p.grad = held
            return False
        self.thermo.grad_norm = min(norm, self.train.clip_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = self.current_lr()
        self._weights_change()
        before = self.predictor.before_step(params)
        self.optimizer.step()
        self.predictor.after_step(params, before, self.stash.epoch)
        self.optimizer.zero_grad(set_to_none=True)
        if kept is not None:
            for p, held in zip(params, kept, strict=True):
                p.grad = held
        self.step += self.step_units
        self.schedule_step += self.step_units
        self._time_step()
        return True

    def _time_step(self) -> None:
        """Count this step in the pace; ``step_s`` is the new pace (``swarm.schedule.Pace``)."""
        self.step_s = self.pace.step(self.monotonic(), self.step_units)

    # ---- outer synchronisation (NoLoCo, DiLoCo, data parallel) ----------------------------

    def _theta(self) -> torch.Tensor:
        """The live weights as one flat vector (a copy)."""
        return parameters_to_vector(self.module.parameters()).detach()

    def _set_theta(self, theta: torch.Tensor) -> None:
        self._weights_change()
        vector_to_parameters(theta, self.module.parameters())

    def _init_outer(self) -> None:
        self.outer = OuterState(self._theta())

    @property
    def phi(self) -> torch.Tensor:
        """The slow weights of the last outer step (``node.stage.outer``)."""
        return self.outer.phi

    @property
    def round_steps(self) -> int:
        """Inner steps taken since the last outer step."""
        return self.step - self._outer_at_step

    def outer_contribution(self, codec: str, ref_steps: float = 0.0) -> Encoded:
        """This replica's NoLoCo offer: slow weights and pseudo-gradient, encoded, with the
        round's inner steps and ``ref_steps`` (the stage's usual, for ``sync.scale_by_steps``;
        0 to apply the published rule as it is)."""
        theta, poison = self._theta(), self.sync.debug_poison
        position = self._round_place(ref_steps) if self.sync.share_schedule else -1.0
        if not self.sync.scale_by_steps or ref_steps <= 0:
            return self.outer.contribution(theta, codec, poison, position=position)
        return self.outer.contribution(
            theta, codec, poison, self.round_steps, ref_steps, position=position
        )

    def _round_place(self, ref_steps: float) -> float:
        """This replica's place in the schedule at an outer step on the clock: with
        ``sync.share_schedule``, ``sync.place_by_usual_steps`` (off by default) and the
        stage's usual steps per round known (``ref_steps``), its place after the last outer
        step plus ``ref_steps``; otherwise its place as its own inner steps moved it.

        An optional departure for replicas of unequal speed (``docs/algorithms.md`` section 4): a
        fast replica takes more steps per round than a slow one, so places keyed on each
        replica's own steps drift apart between pairings, and averaging them with a
        partner's (``swarm.outer.pair_position``) leaves the two pairs of a round at places
        a few steps apart. In the warm-up the learning rate is proportional to the place,
        so the two pairs then move their slow weights by different amounts (a place of 20
        against 25 is a quarter more rate): the unequal stage spreads apart while its
        equal neighbour does not. Advanced by the stage's usual steps, every replica's
        place moves alike, as in the papers, where every replica takes ``H`` steps a round.
        Equal replicas take the usual number of steps: the published rule, up to the noise
        in the estimate."""
        if self.sync.share_schedule and self.sync.place_by_usual_steps and ref_steps > 0:
            return self._place_at_outer + ref_steps
        return self.schedule_step

    def decode_offer(self, partner: Encoded) -> Offer:
        """A partner's NoLoCo offer, decoded and measured against this replica (not applied);
        ``ValueError`` when it is malformed or does not fit."""
        return self.outer.measure(partner, self._theta())

    def apply_noloco(self, offer: Offer | None, ref_steps: float = 0.0) -> float | None:
        """NoLoCo's outer step with a screened offer (or solo); returns the slow-weight spread.
        ``ref_steps`` as for ``outer_contribution``. With a partner that said its place in
        the learning-rate schedule (``sync.share_schedule`` on both), this replica takes the
        pair's mean place (``swarm.outer.pair_position``). On the clock, a replica that took
        fewer inner steps than ``ref_steps`` decays its inner momentum by the steps it missed
        (``sync.decay_momentum``, ``swarm.outer.momentum_decay``). On the clock, its place
        first advances by the stage's usual steps for the round, not its own
        (``sync.place_by_usual_steps``, ``_round_place``)."""
        theta = self._theta()
        self.schedule_step = self._round_place(ref_steps)
        if offer is not None and offer.position >= 0 and self.sync.share_schedule:
            self.take_place(pair_position(self.schedule_step, offer.position), ref_steps)
        if not self.sync.scale_by_steps or ref_steps <= 0:
            spread = self.outer.apply_noloco(theta, offer, self.noloco)
        else:
            spread = self.outer.apply_noloco(theta, offer, self.noloco, self.round_steps, ref_steps)
        self._set_theta(theta)
        if self.sync.decay_momentum:
            self._decay_momentum(momentum_decay(self.round_steps, ref_steps, self.train.betas[0]))
        return spread

    def _decay_momentum(self, factor: float) -> None:
        """Scale the inner Adam's first moment by ``factor`` (``swarm.outer.momentum_decay``:
        a replica that took fewer inner steps than the stage's usual this round)."""
        if factor >= 1.0:
            return
        for state in self.optimizer.state.values():
            if "exp_avg" in state:
                state["exp_avg"].mul_(factor)

    @property
    def place(self) -> list[float]:
        """What this replica says of its place in the schedule beside a DiLoCo round's
        pseudo-gradient (``swarm.allreduce``'s side values): empty unless it shares it
        (``sync.diloco_share_schedule``)."""
        return [self.schedule_step] if self.sync.diloco_share_schedule else []

    def take_place(self, mean: float, ref_steps: float = 0.0) -> None:
        """Move to ``mean``, the place in the schedule of the replicas we synchronised with
        (a NoLoCo pair, or a DiLoCo ring), by at most half of ``PLACE_ROUNDS`` rounds' steps
        (``swarm.outer.shared_position``; moves beyond it are counted and logged)."""
        limit = PLACE_ROUNDS * max(self.sync.outer_steps, ref_steps)
        if not math.isfinite(mean):  # a ring sum a liar pushed past the float range
            self.places_clamped += 1
            log.warning("partners' mean place in the schedule is %s: ours kept", mean)
            return
        if abs(mean - self.schedule_step) > limit / 2:
            self.places_clamped += 1
            log.warning(
                "partners' mean place in the schedule %.0f is more than %.0f steps from ours "
                "(%.0f): moved by that much",
                mean,
                limit / 2,
                self.schedule_step,
            )
        self.schedule_step = shared_position(self.schedule_step, mean, limit)

    def outer_delta(self) -> torch.Tensor:
        """DiLoCo's outer gradient ``phi - theta``."""
        return self.outer.delta(self._theta())

    def apply_diloco(self, delta_mean: torch.Tensor) -> None:
        theta = self._theta()
        self.outer.apply_diloco(theta, delta_mean, self.diloco)
        self._set_theta(theta)

    def apply_grads(self, flat_grads: torch.Tensor) -> None:
        """Data parallel: one inner step with the all-reduced gradient."""
        self._optimizer_step(flat_grads.to(self.device))

    def finish_sync(self, outer: bool) -> None:
        """Release held optimizer steps; take one at once if enough samples came in."""
        self.hold, self.sync_due, self.pending_grads = False, None, None
        if outer:
            self.outer_rounds += 1
            self._outer_at_step = self.step
            self._place_at_outer = self.schedule_step
        self._maybe_step()

    def _observe_logits(self, on: bool) -> None:
        """Start (``on``) or finish sampling each block's largest attention logit."""
        assert isinstance(self.module, BlockStage)
        for i, block in enumerate(self.module.blocks):
            attn = block.attn
            assert isinstance(attn, Attention)
            if not on and attn.observe:
                self.thermo.attn_logit_max[self.module.first_block + i] = attn.max_logit
            attn.observe = on

    def _observe_activations(self, out: torch.Tensor) -> None:
        lo, hi = torch.aminmax(out.detach())
        self.thermo.act_min, self.thermo.act_max = float(lo), float(hi)

    @property
    def service_rate(self) -> float:
        """Samples per second of compute, over roughly the last ``1 / (1 - RATE_DECAY)`` pieces
        of work: a ratio of decayed sums, so a forward's time and its backward's samples
        count together whatever order they come in."""
        return self._recent_samples / self._recent_s if self._recent_s > 0 else 0.0

    @property
    def job_s(self) -> float:
        """Seconds of compute per job (one microbatch's forward or its backward), over
        roughly the last ``1 / (1 - RATE_DECAY)`` jobs; 0 until one is measured or the rate
        is seeded. Known from the first forward on: the service rate counts samples when a
        backward finishes, so it waits for a round trip, which a thin uplink may never
        complete (and the wire codec is chosen by this)."""
        return self._recent_s / self._recent_jobs if self._recent_jobs > 0 else 0.0

    def seed_rate(self, rate: float, weight_s: float = 1.0) -> None:
        """Start the service rate from an estimate worth ``weight_s`` seconds of work (and
        the job time with it: a microbatch is two jobs)."""
        if not rate > 0:
            self._recent_samples = self._recent_s = self._recent_jobs = 0.0
            return
        self._recent_samples, self._recent_s = rate * weight_s, weight_s
        self._recent_jobs = 2 * self._recent_samples / self.config.data.batch_size

    def _account(self, t0: float, num_samples: int) -> None:
        """Track one job's compute time and finished samples (decayed sums for the service
        rate and the job time); on an emulated slower machine (``train.slowdown``), first
        take that much longer."""
        elapsed = time.perf_counter() - t0
        if self.train.slowdown > 1:
            time.sleep((self.train.slowdown - 1) * elapsed)
            elapsed = time.perf_counter() - t0
        self.compute_s += elapsed
        self._recent_s = RATE_DECAY * self._recent_s + elapsed
        self._recent_samples = RATE_DECAY * self._recent_samples + num_samples
        self._recent_jobs = RATE_DECAY * self._recent_jobs + 1

    # ---- state transfer -----------------------------------------------------------------

    def snapshot(self) -> tuple[dict[str, torch.Tensor], int, int]:
        """Weights and Adam moments as named CPU tensors, plus the step and sample counters."""
        tensors = as_state({k: v.detach().cpu() for k, v in self.module.state_dict().items()})
        for name, p in self.module.named_parameters():
            state = self.optimizer.state.get(p)
            if state:
                tensors[f"adam_m.{name}"] = state["exp_avg"].detach().cpu()
                tensors[f"adam_v.{name}"] = state["exp_avg_sq"].detach().cpu()
        tensors["outer.phi"] = self.outer.phi.cpu()
        tensors["outer.m"] = self.outer.m.cpu()
        # a replica that copies a rebuilt one takes its learning-rate schedule too
        tensors["sched.lr_scale"] = torch.tensor(
            [self.lr_scale, float(self.lr_scale_until)], dtype=torch.float64
        )
        tensors["sched.position"] = torch.tensor([self.schedule_step], dtype=torch.float64)
        return tensors, self.step, self.samples

    def params(self) -> dict[str, torch.Tensor]:
        """This stage's weights by name (CPU copies), what a recovering neighbour needs."""
        return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}

    def _check_fits(self, params: Mapping[str, torch.Tensor], what: str, finite: bool) -> None:
        """``ValueError`` unless ``params`` has this stage's parameter names and shapes (and,
        with ``finite``, only finite values)."""
        own = self.module.state_dict()
        if params.keys() != own.keys():
            raise ValueError(f"{what} for stage {self.stage}: wrong parameter names")
        for k, v in params.items():
            if v.shape != own[k].shape:
                raise ValueError(
                    f"{what}: tensor {k} has shape {tuple(v.shape)}, not {tuple(own[k].shape)}"
                )
            if finite and not torch.isfinite(v).all():
                raise ValueError(f"{what}: tensor {k} is not finite")

    def distance_to(self, params: Mapping[str, torch.Tensor]) -> tuple[float, float]:
        """RMS distance of ``params`` (named like ``params()``) to this stage's weights, and
        the RMS of ours; NaN distance if any is not finite. ``ValueError`` if they do not fit."""
        self._check_fits(params, "weights", finite=False)
        sq_dist = sq_own = 0.0
        numel = 0
        for k, mine in self.module.state_dict().items():
            a = mine.detach().float()
            b = params[k].detach().to(a.device, torch.float32)
            sq_dist += float(((b - a) ** 2).sum())
            sq_own += float((a**2).sum())
            numel += a.numel()
        n = max(1, numel)
        return math.sqrt(sq_dist / n), math.sqrt(sq_own / n)

    def current_lr(self) -> float:
        """The learning rate the next inner step takes: the schedule at this replica's place
        in it, times CheckFree's boost while it lasts."""
        return lr_at(self.schedule_step, self.train) * self.current_lr_scale()

    def current_lr_scale(self) -> float:
        """The learning-rate multiplier at the current step."""
        boosted = self.lr_scale_until < 0 or self.step < self.lr_scale_until
        return self.lr_scale if boosted else 1.0

    def adopt_weights(self, params: Mapping[str, torch.Tensor], lr_scale: float) -> None:
        """Take rebuilt weights (CheckFree) with a fresh Adam at ``lr * lr_scale``, for
        ``recovery.lr_boost_steps`` steps (0: for good)."""
        self._check_fits(params, "rebuilt weights", finite=True)
        self._weights_change()
        self.module.load_state_dict({k: v.to(self.device) for k, v in params.items()})
        self.optimizer = self._new_optimizer()
        self.lr_scale = lr_scale
        boost = self.config.recovery.lr_boost_steps
        self.lr_scale_until = self.step + boost if boost > 0 else -1
        self._init_outer()
        self.optimizer.zero_grad(set_to_none=True)
        self._reset_accumulation()

    def reinitialise(self, seed: int, lr_scale: float) -> None:
        """Random re-initialisation from another seed (the baseline CheckFree beats)."""
        c = self.config
        fresh = build_stage(c.model, c.swarm.num_block_stages, self.stage, seed)
        self.adopt_weights(fresh.state_dict(), lr_scale)

    def load(self, tensors: Mapping[str, torch.Tensor], step: int, samples: int) -> None:
        """Adopt a live replica's state; ``ValueError`` if it does not fit this stage."""
        params = params_of(tensors)
        self._check_fits(params, "state", finite=True)
        self._weights_change()
        self.module.load_state_dict({k: v.clone() for k, v in params.items()})
        for name, p in self.module.named_parameters():
            m = tensors.get(f"adam_m.{name}")
            sq = tensors.get(f"adam_v.{name}")
            if m is not None and sq is not None and m.shape == p.shape == sq.shape:
                self.optimizer.state[p] = {
                    "step": torch.tensor(float(step)),
                    "exp_avg": m.to(self.device, torch.float32).clone(),
                    "exp_avg_sq": sq.to(self.device, torch.float32).clone(),
                }
        phi, m = tensors.get("outer.phi"), tensors.get("outer.m")
        if phi is not None and m is not None and phi.shape == m.shape == self.phi.shape:
            self.outer.load(phi, m, self._theta())
        else:
            self._init_outer()
        self.step, self.samples = step, samples
        self.schedule_step = float(step)
        position = tensors.get("sched.position")
        if position is not None and position.shape == (1,):
            place = float(position[0])  # a peer's number: taken only when it is a step count
            if is_place(place):
                self.schedule_step = place
        self.outer_rounds = step // self.sync.outer_steps
        self._outer_at_step = step
        self._place_at_outer = self.schedule_step
        sched = tensors.get("sched.lr_scale")
        if sched is not None and sched.shape == (2,) and bool(torch.isfinite(sched).all()):
            scale, until = float(sched[0]), int(sched[1])
            if 0 < scale <= 10:  # a peer's number: taken only when it is a sane multiplier
                self.lr_scale, self.lr_scale_until = scale, until


def _unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for p in like:
        out.append(flat[offset : offset + p.numel()].view_as(p).clone())
        offset += p.numel()
    return out
