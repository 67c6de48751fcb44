"""Weight prediction: a training forward runs on the weights its gradient will be applied to.

With microbatches in flight, a block stage's gradient lands some inner steps after its
forward. Weight stashing (``node.stage.stash``) keeps the backward on the forward's weights,
so the gradient is a true one, but of weights ``tau`` steps old, applied to today's. SpecTrain
(Chen, Yang and Cheng, 2018, arXiv 1809.02839) predicts instead where the
weights will be when the gradient is applied, and runs the forward, and so the backward,
there: the live weights plus ``tau`` times their velocity, the optimizer's recent move per
step (the smoothed gradient times the learning rate, for its momentum SGD). Our optimizer is
Adam, so the velocity here is its last inner step's move, which its first moment makes the
move it will most nearly repeat.

``tau`` is measured, not configured: a moving average of the inner steps that passed
between a forward and its backward on this replica, the staleness the pipeline actually
has (it depends on the stage's place in the pipeline, the head's window, the step size and
the peers' speeds). With no microbatch in flight it is 0 and the forward runs on the live
weights. ``train.predict_weights``: off by default. In one process at the daemon's sizes
it lowered a stale run's eval loss 8 %, but the same extrapolation without staleness lowers
a synchronous run 9 %: what it buys there is not freshness (``bench/README.md``).

Owns the measured delay, the last inner step's move and the predicted tensors. Does not own
the weights, the optimizer or the stash (the runner's): a prediction holds only for the
weights' epoch it was made at, so any other change of the weights (an outer step, rebuilt
or adopted weights) ends it until the next inner step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

DELAY_WEIGHT = 0.1
"""Weight of each observed delay in the moving average (about the last ten backwards)."""


class WeightPredictor:
    """The measured gradient delay of one replica and, when enabled, its predicted weights."""

    def __init__(self, enabled: bool, fixed_steps: float = 0.0) -> None:
        self.enabled = enabled
        self.fixed_steps = fixed_steps
        """Extrapolate by this many steps instead of the measured delay (0: the delay;
        ``train.predict_steps``, the benchmark's control without staleness)."""
        self.delay = 0.0
        """Inner steps between a forward and its backward, a moving average (0 until one)."""
        self._seen = False
        self._move: list[torch.Tensor] | None = None
        self._epoch = -1
        """The weights' epoch ``_move`` was recorded at (``WeightStash.epoch``)."""

    def observe(self, steps: float) -> None:
        """A backward arrived ``steps`` inner steps after its forward."""
        if not self._seen:
            self.delay, self._seen = float(steps), True
        else:
            self.delay += DELAY_WEIGHT * (float(steps) - self.delay)

    def before_step(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """Copies of the weights an inner step is about to change (None when disabled), in
        the last move's buffers: no forward's graph refers to them (a prediction is a new
        tensor), so one copy of the weights is all this ever holds."""
        if not self.enabled:
            return None
        if self._move is None:
            return [p.detach().clone() for p in params]
        with torch.no_grad():
            for m, p in zip(self._move, params, strict=True):
                m.copy_(p.detach())
        self._epoch = -1  # no prediction from these until the step's move is in them
        return self._move

    def after_step(
        self, params: Sequence[torch.Tensor], before: list[torch.Tensor] | None, epoch: int
    ) -> None:
        """Record the step's move, ``params - before``, valid at the weights' ``epoch``."""
        if before is None:
            return
        with torch.no_grad():
            for b, p in zip(before, params, strict=True):
                b.sub_(p.detach()).neg_()
        self._move, self._epoch = before, epoch

    def weights(
        self, named: Iterable[tuple[str, torch.Tensor]], epoch: int
    ) -> dict[str, torch.Tensor] | None:
        """The predicted weights by name, ``p + delay * move``, still attached to ``p`` (so a
        backward through them accumulates into ``p.grad``); None when there is nothing to
        predict (disabled, no delay, no step since the weights last changed otherwise)."""
        ahead = self.fixed_steps or self.delay
        if not self.enabled or self._move is None or epoch != self._epoch or ahead <= 0:
            return None
        return {
            name: p + move.mul(ahead) for (name, p), move in zip(named, self._move, strict=True)
        }
