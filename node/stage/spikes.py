"""Loss-spike guard: skip the step whose loss or gradient norm jumps far above its usual.

YaLM-100B's practice (``docs/algorithms.md`` section 9): a sudden spike in the loss or the
gradient norm is more often a bad batch or a numerical accident than a lesson, and training
on it can wreck weeks of work; skipping it costs one batch. A value is a spike when it is
not finite, or, once ``warmup`` values have been accepted, when it exceeds ``multiple``
times the running average of the accepted ones (an exponential moving average with
``decay``). Only accepted values enter the average, so a few spikes cannot drag it up. But
``patience`` finite spikes in a row are no spike: the level itself has changed (a stage was
lost and rebuilt, say, and the loss jumps for good), and refusing every value from then on
would stop training altogether; the average restarts from the new level instead.

Pure: floats in, a verdict out. The runner applies it to each inner step's gradient norm
before clipping and the head stage to each microbatch's loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class SpikeGuard:
    multiple: float
    """A value above this multiple of the running average is a spike (0: only non-finite)."""
    warmup: int = 20
    """Values accepted before the multiple applies (early training moves fast)."""
    decay: float = 0.95
    """Weight of the old average in each update (about the last 20 values)."""
    patience: int = 8
    """This many finite spikes in a row are a new level, not spikes: the average restarts."""
    average: float = 0.0
    num_accepted: int = 0
    num_spikes: int = 0
    num_rebaselines: int = 0
    _run: int = 0

    def is_spike(self, value: float) -> bool:
        """Judge ``value``; an accepted one updates the average."""
        if not math.isfinite(value):
            self.num_spikes += 1
            return True
        warm = self.num_accepted >= self.warmup
        if warm and self.multiple > 0 and value > self.multiple * self.average:
            self._run += 1
            if self._run < self.patience:
                self.num_spikes += 1
                return True
            self.num_rebaselines += 1  # a new level: accept it, and average from it
            self.num_accepted = 0
        self._run = 0
        if self.num_accepted == 0:
            self.average = value
        else:
            self.average = self.decay * self.average + (1 - self.decay) * value
        self.num_accepted += 1
        return False
