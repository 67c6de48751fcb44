"""The head stage's role: issue microbatches, finish them, evaluate.

A head-stage node is where every microbatch starts and ends (SWARM's "trainer", arXiv
2301.11913, section 3). This module owns:

- keeping training microbatches in the pipeline, as many as the in-flight window allows
  (``train.window = adaptive``, the default; ``swarm.window``: it learns from each
  microbatch's round trip, up to ``max_in_flight``) or, with ``train.window = fixed``,
  ``max_in_flight`` of them, pausing while some block stage has no ready replica;
- the deadline of each microbatch: one not completed in time is re-issued on a fresh route
  (``retried``) up to ``max_attempts`` issues, then ``dropped``; every issued microbatch ends
  as exactly one of completed, retried or dropped, evaluation ones included, so at any
  moment ``issued == completed + retried + dropped + pending`` (``status()``). A replica
  that could not pass one on says so (``on_dropped``), and it is re-issued at once, its
  window slot free again, instead of at its deadline. Each issue's id ends in 64 random
  bits, so a peer the microbatch never reached cannot name it in such a notice;
- the loss at the end of the pipeline, the gradient sent back along the recorded path, and
  the embedding's backward when it returns;
- evaluation on the fixed held-out split, through the same pipeline without gradients.

Its two jobs (``node.roles.base.StageRole``): a forward that came home gets its loss and its
gradient sent back; a backward that came home finishes the microbatch in the embedding.

Does not own routing or the network (``node.pipeline``) or torch state (``node.stage.runner``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from node.context import NodeContext
from node.data.dataset import TextDataset, open_dataset, shard_of
from node.pipeline import HopSender, Job, Send
from node.stage.runner import StageRunner
from protocol.messages import Ack, Backward, Dropped, Forward, Hop, prepare
from protocol.quant import WireTensor, encode_tensor
from swarm.assignment import choose_shard
from swarm.recovery import checkfree_plus_route
from swarm.seams import Refused
from swarm.window import MIN_SIZE, InFlightWindow, WindowConfig

log = logging.getLogger(__name__)

LOSS_HISTORY = 360
LOSS_HISTORY_EVERY_S = 2.0


@dataclass
class Pending:
    """A microbatch this head node issued and has not finished."""

    seq: int
    ids: torch.Tensor
    labels: torch.Tensor
    attempt: int
    deadline_s: float
    eval_result: asyncio.Future[float] | None = None
    mb_id: str = ""
    issued_s: float = 0.0
    """When it was issued (its round trip ends when its gradient is back)."""


@dataclass
class EvalPoint:
    step: int
    elapsed_s: float
    loss: float


@dataclass
class _Window:
    """Tokens completed over the last ``span_s`` seconds, for a steady tokens/s figure."""

    span_s: float = 20.0
    events: deque[tuple[float, int]] = field(default_factory=deque)

    def add(self, now: float, tokens: int) -> None:
        self.events.append((now, tokens))
        while self.events and now - self.events[0][0] > self.span_s:
            self.events.popleft()

    def rate(self, now: float) -> float:
        while self.events and now - self.events[0][0] > self.span_s:
            self.events.popleft()
        if not self.events:
            return 0.0
        return sum(t for _, t in self.events) / max(
            1e-3, min(self.span_s, now - self.events[0][0] + 1e-3)
        )


class HeadRole:
    """Drives training from a head-stage node."""

    forward_kind = "loss"

    def __init__(self, ctx: NodeContext, runner: StageRunner, hops: HopSender) -> None:
        self.ctx = ctx
        self.runner = runner
        self.hops = hops
        self.config = ctx.config
        self.train = ctx.config.train
        self.dataset: TextDataset | None = None
        self.shard = -1
        self.gen = torch.Generator().manual_seed(int(ctx.peer_id[:8], 16))
        self.pending: dict[str, Pending] = {}
        self._seq = 0
        self._num_issues = 0
        self._wake = asyncio.Event()
        self.last_loss: float | None = None
        self.loss_ema: float | None = None
        self.loss_history: deque[tuple[int, float]] = deque(maxlen=LOSS_HISTORY)
        """(tokens, loss EMA), one point every ``LOSS_HISTORY_EVERY_S``: the page's curve."""
        self._loss_sampled_s = 0.0
        self.tokens = 0
        self.started_s: float | None = None
        self.window = _Window()
        self.in_flight: InFlightWindow | None = None
        """The adaptive in-flight window (``train.window = adaptive``), else None."""
        if self.train.window == "adaptive":
            top = self.train.max_in_flight
            config = WindowConfig(min_size=min(MIN_SIZE, top), max_size=top, initial=min(4, top))
            self.in_flight = InFlightWindow(config, time.monotonic())
        self.evals: list[EvalPoint] = []
        self._eval_lock = asyncio.Lock()
        self._eval_data: list[tuple[torch.Tensor, torch.Tensor]] = []

    async def prepare(self) -> None:
        """Load this node's data shard and the shared eval split (on the compute thread)."""
        data = self.config.data
        taken = [
            p.data_shard for p in self.ctx.table.replicas(0, ready_only=False) if p.data_shard >= 0
        ]
        preferred = shard_of(self.ctx.peer_id, data.num_shards)
        shard = data.shard if data.shard >= 0 else choose_shard(data.num_shards, taken, preferred)
        self.shard = shard

        def load() -> TextDataset:
            seed, vocab_size = self.config.swarm.seed, self.config.model.vocab_size
            return open_dataset(data, shard=shard, seed=seed, vocab_size=vocab_size)

        self.dataset = await self.runner.compute(load)
        self._eval_data = self.dataset.eval_batches(
            self.train.eval_batches, data.batch_size, data.seq_len
        )
        log.info(
            "data: shard %d/%d, %d train tokens, %d eval tokens",
            shard,
            data.num_shards,
            self.dataset.num_train_tokens,
            self.dataset.num_eval_tokens,
        )

    # ---- the loop -----------------------------------------------------------------------

    def unserved(self) -> list[int]:
        """Block stages with no ready replica that this node knows of (from its table for
        the stages next to it, from summaries for the rest)."""
        view = self.ctx.stages()
        return [s for s in range(1, self.ctx.num_stages) if s not in view or not view[s].ready]

    def pipeline_complete(self) -> bool:
        return not self.unserved()

    async def run(self) -> None:
        await self._wait_for_pipeline()
        if self.train.eval_interval_s > 0:
            await self.evaluate()
        self.started_s = time.monotonic()
        next_eval = time.monotonic() + self.train.eval_interval_s
        while not self.ctx.state.leaving:
            self._check_deadlines()
            if self.pipeline_complete():
                while self._num_training() < self._window_limit():
                    await self._issue(self._sample(), attempt=1)
            else:
                await self._wait_for_pipeline()
            if self.train.eval_interval_s > 0 and time.monotonic() >= next_eval:
                next_eval = time.monotonic() + self.train.eval_interval_s
                self.ctx.spawn(self._evaluate_quietly())
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=0.2)

    async def _wait_for_pipeline(self) -> None:
        announced = False
        while not self.pipeline_complete() and not self.ctx.state.leaving:
            if not announced:
                missing = self.unserved()
                log.info("waiting for replicas of stage(s) %s before issuing microbatches", missing)
                announced = True
            await asyncio.sleep(0.3)
        if announced:
            log.info("pipeline complete: every stage has a replica")

    def _window_limit(self) -> int:
        if self.in_flight is None:
            return self.train.max_in_flight
        return self.in_flight.limit(time.monotonic())

    def _num_training(self) -> int:
        return sum(1 for p in self.pending.values() if p.eval_result is None)

    def _sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.dataset is not None
        return self.dataset.sample_batch(
            self.gen, self.config.data.batch_size, self.config.data.seq_len
        )

    async def _issue(
        self,
        batch: tuple[torch.Tensor, torch.Tensor],
        attempt: int,
        seq: int | None = None,
        eval_result: asyncio.Future[float] | None = None,
    ) -> None:
        """Embed a microbatch and send it into block stage 1."""
        runner = self.runner
        if seq is None:
            self._seq += 1
            seq = self._seq
        ids, labels = batch
        now = time.monotonic()
        p = Pending(
            seq,
            ids,
            labels,
            attempt,
            now + self.train.microbatch_deadline_s,
            eval_result,
            issued_s=now,
        )
        self._num_issues += 1
        p.mb_id = f"{self.ctx.peer_id[:8]}.{seq}.{self._num_issues}.{secrets.token_hex(8)}"
        self.pending[p.mb_id] = p
        self.ctx.counters["microbatches_issued"] += 1  # with the insert: issued == ended + pending
        codec = self.hops.codec(ids.numel() * self.config.model.d_model, runner.job_s)
        route: list[int] = []
        if self.config.recovery.method == "checkfree+" and eval_result is None:
            route = checkfree_plus_route(seq, self.config.swarm.num_block_stages)
        mb_id, path = p.mb_id, [Hop(0, self.ctx.peer_id, self.ctx.state.address)]

        def compute() -> Forward:
            tensors, meta = encode_tensor(runner.head_embed(ids), codec, name="h")
            return prepare(
                Forward(
                    mb_id=mb_id,
                    target_stage=route[0] if route else 1,
                    path=path,
                    eval=eval_result is not None,
                    meta=meta,
                    tensors=tensors,
                    route=route,
                )
            )

        msg = await runner.compute(compute)
        self.ctx.spawn(self._send_first(p, msg))

    async def _send_first(self, p: Pending, msg: Forward) -> None:
        if await self.hops.send_to_stage(msg.target_stage, msg) is not None:
            self._reissue_now(p)

    def on_dropped(self, msg: Dropped) -> Ack:
        """A replica could not pass microbatch ``msg.mb_id`` on: re-issue it now
        (``stale_microbatch`` if it is no longer pending; one whose gradient is being applied
        here is left to finish)."""
        p = self._pending(msg.mb_id)
        if p.deadline_s == math.inf:
            return Ack(detail="finishing")
        self.ctx.counters["drop_notices"] += 1
        log.info(
            "microbatch %s went no further than stage %d (replica %s); re-issuing now",
            msg.mb_id,
            msg.stage,
            msg.sender[:8],
        )
        self._reissue_now(p)
        return Ack()

    def _reissue_now(self, p: Pending) -> None:
        """Re-issue ``p`` on the loop's next turn rather than wait out its deadline (one of
        its hops went nowhere); the loop counts it as retried or dropped."""
        p.deadline_s = 0.0
        self._wake.set()

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for mb_id, p in list(self.pending.items()):
            if p.deadline_s > now:
                continue
            del self.pending[mb_id]
            if not self.pipeline_complete():
                p.attempt -= 1  # a missing stage is not this microbatch's fault
            if self.in_flight is not None and p.eval_result is None:
                self.in_flight.failed(now)
            if p.attempt < self.train.max_attempts:
                self.ctx.counters["microbatches_retried"] += 1
                why = "missed its deadline" if p.deadline_s else "was dropped on its way"
                log.info("microbatch %s %s; re-issuing", mb_id, why)
                self.ctx.spawn(self._issue((p.ids, p.labels), p.attempt + 1, p.seq, p.eval_result))
            else:
                self.ctx.counters["microbatches_dropped"] += 1
                log.warning("microbatch %s dropped after %d attempts", mb_id, p.attempt)
                if p.eval_result is not None and not p.eval_result.done():
                    p.eval_result.set_exception(TimeoutError(f"eval microbatch {mb_id} dropped"))

    # ---- the jobs of a microbatch that came home ----------------------------------------

    def forward_job(self, msg: Forward, h: WireTensor) -> Job:
        """Final hidden states arrived: loss, and for training the gradient sent back."""
        p = self._pending(msg.mb_id)
        runner = self.runner
        codec = self.hops.codec(math.prod(h.shape), runner.job_s)

        async def job() -> Send | None:
            if p.eval_result is not None:
                loss, _ = await runner.compute(
                    lambda: runner.head_loss(h.decode(), p.labels, False)
                )
                if self.pending.pop(msg.mb_id, None) is not None:  # else its deadline counted it
                    self.ctx.counters["microbatches_completed"] += 1
                if not p.eval_result.done():
                    p.eval_result.set_result(loss)
                return None

            def compute() -> tuple[float, Backward | None]:
                loss, grad = runner.head_loss(h.decode(), p.labels, True)
                if grad is None:  # a spike or NaN: no gradient for this microbatch
                    return loss, None
                tensors, meta = encode_tensor(grad, codec, name="g")
                index = len(msg.path) - 1
                back = Backward(
                    mb_id=msg.mb_id, index=index, path=msg.path, meta=meta, tensors=tensors
                )
                return loss, prepare(back)

            loss, back = await runner.compute(compute)
            self._record_loss(loss)
            if back is None:
                self._skip(msg.mb_id, loss)
                return None
            return lambda: self._send_back(p, back)

        return job

    async def _send_back(self, p: Pending, msg: Backward) -> None:
        if await self.hops.send_to(msg.path[msg.index], msg) is not None:
            self._reissue_now(p)

    def backward_job(self, msg: Backward, g: WireTensor) -> Job:
        """The gradient reached the head again: backprop into the embedding; microbatch done.

        The microbatch stays pending until the embedding's backward has run, so it ends exactly
        once: completed here, or retried or dropped by its deadline when this backward is
        refused (a full queue) or fails.
        """
        p = self._pending(msg.mb_id)
        runner = self.runner

        async def job() -> None:
            if self.pending.get(msg.mb_id) is not p:
                return  # its deadline passed while queued: already counted as retried or dropped
            p.deadline_s = math.inf  # no re-issue while its gradient is being applied
            try:
                await runner.compute(lambda: runner.head_backward(p.ids, g.decode()))
            except BaseException:
                p.deadline_s = 0.0  # re-issue it instead
                raise
            if self.pending.pop(msg.mb_id, None) is None:
                return  # a failed send home re-armed its deadline meanwhile: already counted
            tokens, now = p.ids.numel(), time.monotonic()
            self.tokens += tokens
            self.window.add(now, tokens)
            if self.in_flight is not None:
                self.in_flight.completed(now - p.issued_s, p.issued_s, now)
            self.ctx.counters["microbatches_completed"] += 1
            self._wake.set()

        return job

    def _skip(self, mb_id: str, loss: float) -> None:
        """End a microbatch whose loss spiked (or is not finite) untrained: it counts as
        dropped, and as a skipped spike (``loss_spikes_skipped``); the stages downstream free its
        saved activations when they expire."""
        if self.pending.pop(mb_id, None) is None:
            return  # its deadline counted it already
        self.ctx.counters["microbatches_dropped"] += 1
        self.ctx.counters["loss_spikes_skipped"] += 1
        average = self.runner.loss_guard.average
        log.warning("microbatch %s skipped: loss %.4g, running average %.4g", mb_id, loss, average)
        self._wake.set()

    def _pending(self, mb_id: str) -> Pending:
        p = self.pending.get(mb_id)
        if p is None:
            raise Refused("stale_microbatch", f"{mb_id} is no longer pending here", 410)
        return p

    def _record_loss(self, loss: float) -> None:
        if not math.isfinite(loss):
            self.ctx.counters["non_finite_loss"] += 1
            log.warning("non-finite training loss %s", loss)
            return
        self.last_loss = loss
        self.loss_ema = loss if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * loss
        now = time.monotonic()
        if not self.loss_history or now - self._loss_sampled_s >= LOSS_HISTORY_EVERY_S:
            self.loss_history.append((self.tokens, round(self.loss_ema, 4)))
            self._loss_sampled_s = now

    # ---- evaluation ---------------------------------------------------------------------

    async def evaluate(self) -> float:
        """Mean loss over the fixed held-out microbatches, through the live pipeline."""
        async with self._eval_lock:
            await self._wait_for_pipeline()
            loop = asyncio.get_running_loop()
            futures = [loop.create_future() for _ in self._eval_data]
            for batch, fut in zip(self._eval_data, futures, strict=True):
                await self._issue(batch, attempt=1, eval_result=fut)
            limit_s = self.train.microbatch_deadline_s * self.train.max_attempts + 5.0
            # not wait_for(gather(...)): cancelled at shutdown, that leaves the gather's
            # CancelledError unread on Python 3.11, an error line (tests/test_architecture.py)
            async with asyncio.timeout(limit_s):
                losses = await asyncio.gather(*futures)
            loss = float(sum(losses) / len(losses))
            elapsed = time.monotonic() - self.started_s if self.started_s else 0.0
            self.evals.append(EvalPoint(self.runner.step, round(elapsed, 2), loss))
            log.info("eval loss %.4f at step %d", loss, self.evals[-1].step)
            return loss

    async def _evaluate_quietly(self) -> None:
        try:
            await self.evaluate()
        except TimeoutError as e:
            log.warning("evaluation abandoned: %s", e or "timed out")

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "loss": self.last_loss,
            "loss_ema": self.loss_ema,
            "eval_loss": self.evals[-1].loss if self.evals else None,
            "evals": [vars(e) for e in self.evals],
            "loss_history": list(self.loss_history),
            "tokens": self.tokens,
            "tokens_per_s": round(self.window.rate(now), 1),
            "train_s": round(now - self.started_s, 1) if self.started_s else 0.0,
            "in_flight": self._num_training(),
            "window": {"size": self.train.max_in_flight, "policy": "fixed"}
            if self.in_flight is None
            else {"policy": "adaptive", **self.in_flight.status()},
            "pending": len(self.pending),  # evaluation microbatches too: the accounting's rest
            "pipeline_complete": self.pipeline_complete(),
            "data_shard": self.shard,
        }
