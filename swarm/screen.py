"""Screening a peer's weights before they are mixed into ours: refuse the poisoned ones.

NoLoCo (Kolehmainen et al., 2025, arXiv 2506.10911, section 3; ``docs/algorithms.md`` sections 4 and 8)
averages a replica's slow weights and pseudo-gradient with one random partner's every ``H``
inner steps, and a joining or recovering replica copies (or averages, CheckFree) the
weights of live peers. Neither paper asks whether those weights can be trusted. In a swarm
of strangers one broken or hostile partner that sends NaN, or its weights scaled by 1000,
would wreck every replica it pairs with. This module owns the rule that says no:

- a distance that is not finite (the peer's weights hold NaN or infinity) is refused;
- otherwise the distance is compared with a *reference*: the median of the last
  ``window`` distances this screen accepted; until ``warmup`` distances have been accepted
  (and for a screen with no history, such as a one-off recovery source) it is the RMS of
  this replica's own weights instead, a scale no honest replica of the stage is anywhere
  near. The reference is never less than how far this replica itself moved since it last
  averaged with a partner (over all the solo rounds since): an honest partner apart as long
  at the same learning rate moved about as far, so a learning-rate warm-up, a long solo
  stretch or a network partition (twins 30 s apart came back 19x their usual distance in
  the partition test) do not make honest partners look far. Nor is it less than ``floor``
  (5 %) times the weight scale: with the default multiple nothing closer than half the
  weights' own RMS is ever refused, while crude poisoning (NaN, scaled weights) always is.
  Subtler poisoning below these bounds is not caught (SECURITY.md);
- a distance above ``multiple`` times the reference is refused (``multiple`` 0 turns this
  part off; non-finite weights are refused regardless).

Only accepted distances enter the history, so a poisoner cannot drag the reference up. The
caller measures the distances (torch, on its compute thread) and acts on a refusal: a solo
outer step, the next recovery source, and a ban of the peer (``swarm.routing.Router``).

Pure policy: floats in, a verdict out; no torch, no clock, no peers.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

NON_FINITE = "non_finite"
"""Refusal reason: the peer's weights are not finite."""
TOO_FAR = "too_far"
"""Refusal reason: the peer's weights are further from ours than the rule allows."""


@dataclass(frozen=True)
class ScreenConfig:
    multiple: float = 10.0
    """Refuse weights further from ours than this multiple of the reference distance (0: off)."""
    window: int = 8
    """The reference is the median of this many most recently accepted distances."""
    warmup: int = 3
    """Accepted distances needed before the median is used (before: the weights' own RMS)."""
    floor: float = 0.05
    """The reference never drops below this fraction of our weights' RMS."""

    def __post_init__(self) -> None:
        if self.multiple < 0 or self.window < 1 or self.warmup < 0 or self.floor < 0:
            raise ValueError(f"bad weight screen settings: {self}")


class WeightScreen:
    """Judges the distance between a peer's weights and ours (see the module docstring)."""

    def __init__(self, config: ScreenConfig = ScreenConfig()) -> None:  # noqa: B008 - frozen
        self.config = config
        self.recent: deque[float] = deque(maxlen=config.window)

    def typical(self) -> float | None:
        """Median of the recently accepted distances; None while warming up."""
        if len(self.recent) < max(1, self.config.warmup):
            return None
        return statistics.median(self.recent)

    def reference(self, scale: float, movement: float = 0.0) -> float:
        """The distance a refusal is measured against. ``scale``: RMS of our own weights;
        ``movement``: how far we moved since we last averaged with a partner (0 if not
        applicable)."""
        typical = self.typical()
        base = scale if typical is None else typical
        return max(base, movement, self.config.floor * scale)

    def judge(self, distance: float, scale: float, movement: float = 0.0) -> str | None:
        """``None`` to accept (and remember) ``distance``; else the refusal reason.

        ``distance``: RMS distance between the peer's weights and ours; ``scale`` and
        ``movement`` as for ``reference``.
        """
        if not math.isfinite(distance):
            return NON_FINITE
        limit = self.config.multiple * self.reference(scale, movement)
        if self.config.multiple > 0 and distance > limit:
            return TOO_FAR
        self.recent.append(distance)
        return None

    def describe(self, distance: float, scale: float, movement: float = 0.0) -> str:
        """Human-readable comparison, for the log line of a refusal."""
        ref = self.reference(scale, movement)
        ratio = distance / ref if ref > 0 and math.isfinite(distance) else math.inf
        if movement > 0 and ref == movement:
            source = "own movement"
        elif self.typical() is None:
            source = "weight scale"
        else:
            source = "typical distance"
        return f"distance {distance:.3e} is {ratio:.1f}x the {source} {ref:.3e}"
