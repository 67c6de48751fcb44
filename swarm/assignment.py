"""Stage assignment for ``--stage auto``: which stage a joining node should serve.

``choose_stage`` is the simple rule (``balance.policy = "replicas"``, the benchmark's
baseline): an empty stage first, else the stage with the fewest live replicas, ties broken at
random (so nodes that join together spread out). The default throughput rule and
rebalancing (Petals, arXiv 2209.01188; ``docs/algorithms.md`` section 3) live in ``swarm.balance``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping


def choose_stage(replicas: Mapping[int, int], rng: random.Random) -> int:
    """The stage to join given live replicas per stage (every stage must be a key)."""
    if not replicas:
        raise ValueError("choose_stage needs at least one stage")
    fewest = min(replicas.values())
    return first_drawn([s for s, n in replicas.items() if n == fewest], replicas, rng)


def first_drawn(candidates: Iterable[int], stages: Iterable[int], rng: random.Random) -> int:
    """Of tied ``candidates``, the first in an order of ``stages`` drawn from ``rng``: each
    candidate equally likely, and a pick that stays when another candidate drops out, so a
    joiner's answer is the same from one round of ``swarm.balance.settle_join`` to the next."""
    order = sorted(stages)
    rng.shuffle(order)
    rank = {s: i for i, s in enumerate(order)}
    return min(candidates, key=rank.__getitem__)


def choose_shard(num_shards: int, taken: Iterable[int], preferred: int) -> int:
    """A head node's data shard: its preferred one (a hash of its id) unless another live
    head reads it, else the lowest free one; shards stay disjoint while there are no more
    head nodes than shards, and a node keeps its shard for life (stable as others come and
    go). With every shard taken it shares its preferred one."""
    if not 0 <= preferred < num_shards:
        raise ValueError(f"preferred shard {preferred} is not in [0, {num_shards})")
    used = set(taken)
    if preferred not in used:
        return preferred
    free = [s for s in range(num_shards) if s not in used]
    return free[0] if free else preferred
