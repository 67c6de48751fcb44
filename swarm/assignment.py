"""Stage assignment for ``--stage auto``: which stage a joining node should serve.

This version follows the simple rule of the foundation issue: an empty stage first, else the
stage with the fewest live replicas, ties broken at random (so nodes that join together
spread out). Throughput-weighted joining and rebalancing (Petals' rule, ALGORITHMS.md
section 3) build on the same signature later.
"""

from __future__ import annotations

import random
from collections.abc import Mapping


def choose_stage(replicas: Mapping[int, int], rng: random.Random) -> int:
    """The stage to join given live replicas per stage (every stage must be a key)."""
    if not replicas:
        raise ValueError("choose_stage needs at least one stage")
    fewest = min(replicas.values())
    candidates = sorted(stage for stage, n in replicas.items() if n == fewest)
    return rng.choice(candidates)
