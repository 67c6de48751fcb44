"""Admission of requests from peers: how often one may ask, and whether a request is new.

A swarm of strangers must survive peers that are broken or hostile (issue 7). The frame
decoder (``protocol``) already refuses what is malformed; this module holds the pure
policies the daemon applies to a well-formed request before it does any work for it,
keyed by the peer the request claims to come from (``protocol.auth.claimed_sender``;
authenticated in a keyed swarm, a mere claim in an open one):

- ``TokenBuckets``: a per-key token bucket (``rate_per_s`` refill, ``burst`` capacity), so
  one peer flooding requests is refused with ``rate_limited`` while others are served.
  Keys are bounded in number (least recently used forgotten), so key churn costs no memory.
- ``RecentIds``: a bounded set of recently accepted microbatch ids, so a duplicate
  ``Forward`` or ``Backward`` is refused rather than computed twice.

Pure: explicit ``now``; no clock, no I/O. Refusing, counting and logging are the daemon's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    updated: float


class TokenBuckets:
    """One token bucket per key; ``rate_per_s`` <= 0 admits everything."""

    def __init__(self, rate_per_s: float, burst: float, max_keys: int = 4096) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, got {max_keys}")
        self.rate_per_s = rate_per_s
        self.burst = max(1.0, burst)
        self.max_keys = max_keys
        self._buckets: OrderedDict[Hashable, _Bucket] = OrderedDict()

    def allow(self, key: Hashable, now: float) -> bool:
        """Take one token from ``key``'s bucket; False (nothing taken) when it is empty."""
        if self.rate_per_s <= 0:
            return True
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket(self.burst, now)
            if len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
            elapsed = max(0.0, now - b.updated)
            b.tokens = min(self.burst, b.tokens + elapsed * self.rate_per_s)
            b.updated = now
        if b.tokens < 1.0:
            return False
        b.tokens -= 1.0
        return True

    def __len__(self) -> int:
        return len(self._buckets)


class RecentIds:
    """The last ``capacity`` ids added; older ones are forgotten first."""

    def __init__(self, capacity: int = 8192) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._ids: OrderedDict[Hashable, None] = OrderedDict()

    def add(self, key: Hashable) -> None:
        self._ids[key] = None
        self._ids.move_to_end(key)
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def clear(self) -> None:
        self._ids.clear()

    def __contains__(self, key: object) -> bool:
        return key in self._ids

    def __len__(self) -> int:
        return len(self._ids)
