"""The head's in-flight window: how many training microbatches to keep in the pipeline.

By Little's law a pipeline keeps its slowest stage busy with about (throughput x round trip)
microbatches in flight; more than that only wait in queues, holding activations and making
the weights stashed for their backwards older. A fixed number fits one network: a LAN hop is
a fraction of a millisecond, a WAN hop 20 to 200 ms. So the window adapts, with the rule of
TCP Vegas (Brakmo and Peterson, "TCP Vegas: end to end congestion avoidance on a global
internet", IEEE JSAC 1995; ``docs/algorithms.md`` section 10):

- every completed microbatch brings its round trip (issued to its gradient back at the
  head); ``base_rtt_s`` is the round trip with nothing queued, the smallest seen;
- with ``w`` in flight and a mean round trip ``rtt`` over the last window's worth of
  completions, about ``w * (1 - base_rtt / rtt)`` microbatches are waiting in queues
  (Vegas' *diff*: expected minus actual rate, times the base round trip);
- once per window's worth of completions: fewer than ``alpha`` queued, the pipe has room
  and the window grows by one; more than ``beta``, it only queues and shrinks by one;
- a failure (a hop that timed out or was refused, a microbatch retried or dropped) cuts it
  to three quarters;
- it stays within ``[min_size, max_size]``; ``max_size`` is the memory bound
  (``train.max_in_flight``: each microbatch in flight holds its activations on every stage).

It is the default (``train.window = adaptive``), bounded by ``train.max_in_flight``: a fixed
six in flight queue tens of seconds of uploads behind a 2 Mbit/s uplink, and every hop and
microbatch misses its deadline (``bench/thin_uplink.py``).

Departure from Vegas: its base round trip is the minimum over the connection's life, which
goes stale when the path changes (here: a slower replica joins, a stage moves). As BBR does
(Cardwell et al., ACM Queue 2016), the window drops to ``min_size`` every ``probe_every_s``
until a microbatch issued in the drained pipeline comes back, and its round trip becomes
the new base. That costs about one round trip of reduced throughput per probe.

Pure policy: callers pass ``now``; no clock, no I/O. Does not own issuing microbatches
(``node.roles.head``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

HISTORY = 120
"""Window changes kept for ``node status`` (time, size)."""
MIN_SIZE = 2
"""The fewest microbatches a window keeps in flight (unless its bound is lower): what a node
of the pipeline must be able to send within a hop's deadline (``node.pipeline``'s "too
thin")."""


@dataclass(frozen=True)
class WindowConfig:
    min_size: int = MIN_SIZE
    max_size: int = 32
    initial: int = 4
    alpha: float = 1.0
    """Fewer microbatches queued than this: grow."""
    beta: float = 3.0
    """More queued than this: shrink."""
    probe_every_s: float = 30.0
    """How often the base round trip is measured again in a drained pipeline."""
    cut: float = 0.75
    """The window's multiplier after a failure."""


class InFlightWindow:
    """How many training microbatches a head keeps in flight; adapts to the pipe."""

    def __init__(self, config: WindowConfig, now: float) -> None:
        if not 1 <= config.min_size <= config.initial <= config.max_size:
            raise ValueError("window sizes must satisfy 1 <= min <= initial <= max")
        self.config = config
        self.size = config.initial
        self.base_rtt_s: float | None = None
        self.rtt_s: float | None = None
        """Mean round trip over the last adjustment's completions."""
        self.queued = 0.0
        """Vegas' diff at the last adjustment: microbatches waiting in queues."""
        self.history: deque[tuple[float, int]] = deque([(now, self.size)], maxlen=HISTORY)
        self._rtts: list[float] = []
        self._probing_since: float | None = None
        self._next_probe_s = now + config.probe_every_s

    @property
    def probing(self) -> bool:
        return self._probing_since is not None

    def limit(self, now: float) -> int:
        """Microbatches the head may have in flight now."""
        if self._probing_since is None and now >= self._next_probe_s and self.base_rtt_s:
            self._probing_since = now
            self._rtts.clear()
        return self.config.min_size if self._probing_since is not None else self.size

    def completed(self, rtt_s: float, issued_s: float, now: float) -> None:
        """A microbatch issued at ``issued_s`` came back after ``rtt_s``."""
        if self._probing_since is not None:
            if issued_s >= self._probing_since:  # issued into the drained pipeline
                self.base_rtt_s = rtt_s
                self._probing_since = None
                self._next_probe_s = now + self.config.probe_every_s
            return
        self.base_rtt_s = rtt_s if self.base_rtt_s is None else min(self.base_rtt_s, rtt_s)
        self._rtts.append(rtt_s)
        if len(self._rtts) < self.size:
            return
        self.rtt_s = sum(self._rtts) / len(self._rtts)
        self._rtts.clear()
        self.queued = self.size * (1.0 - self.base_rtt_s / self.rtt_s)
        if self.queued < self.config.alpha:
            self._resize(self.size + 1, now)
        elif self.queued > self.config.beta:
            self._resize(self.size - 1, now)

    def failed(self, now: float) -> None:
        """A microbatch was retried or dropped: the pipe is overfull, or a peer is gone."""
        self._rtts.clear()
        self._resize(math.floor(self.size * self.config.cut), now)

    def _resize(self, size: int, now: float) -> None:
        size = max(self.config.min_size, min(self.config.max_size, size))
        if size != self.size:
            self.size = size
            self.history.append((now, size))

    def status(self) -> dict[str, object]:
        return {
            "size": self.size,
            "base_rtt_ms": None if self.base_rtt_s is None else round(self.base_rtt_s * 1e3, 1),
            "rtt_ms": None if self.rtt_s is None else round(self.rtt_s * 1e3, 1),
            "queued": round(self.queued, 2),
            "probing": self.probing,
            "history": [(round(t, 1), s) for t, s in self.history],
        }
