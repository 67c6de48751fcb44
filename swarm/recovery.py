"""CheckFree recovery policy: how to rebuild a lost stage, and who refills it.

CheckFree (Blagoev et al., 2025, arXiv 2506.15461; ``docs/algorithms.md`` section 6). When every
replica of block stage ``s`` is gone, the node that takes the stage over rebuilds it from
its neighbours instead of a checkpoint::

    w_prev = ||g_{s-1}|| + 1e-4      w_next = ||g_{s+1}|| + 1e-4
    W_s    = (w_next * W_{s+1} + w_prev * W_{s-1}) / (w_next + w_prev)

with ``||g_k||`` the stage's latest post-clip gradient norm (published in heartbeats), then
trains on with a fresh Adam at ``lr * 1.1``. A surviving replica is copied instead. If a
neighbour is also gone, the nearest live block stage on that side stands in. The rule
needs block stages on both sides; for a boundary stage (1 or N) plain CheckFree copies its
one live neighbour, and **CheckFree+** does better: the router swaps stages 1 and 2, and
N-1 and N, on every odd microbatch, so each learns its partner's job, and a lost boundary
stage is rebuilt by copying its swap partner (1 from 2 and 2 from 1, N from N-1 and N-1
from N: each of the four has learned its partner's job). CheckFree+ needs N >= 4 so the
swaps do not overlap.

Pure functions: stage tables in, plans out. Fetching weights and applying them is the
daemon's job (``node.services.recovery``).
"""

from __future__ import annotations

import random
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from protocol.messages import PeerRecord

EPSILON = 1e-4
RecoveryMethod = Literal["checkfree", "checkfree+", "checkpoint", "random"]
"""How a lost stage is rebuilt (``recovery.method``); listed once, here."""
METHODS: tuple[str, ...] = get_args(RecoveryMethod)


@dataclass(frozen=True)
class Source:
    """One stage to take weights from, with its weight in the average."""

    stage: int
    weight: float


@dataclass(frozen=True)
class RecoveryPlan:
    """How to obtain stage ``stage``'s weights: ``kind`` is copy, checkfree, swap_copy,
    neighbour_copy, head_copy, checkpoint, random, or seed (nothing to rebuild from: the
    swarm's initial weights)."""

    stage: int
    kind: str
    sources: tuple[Source, ...] = ()


def checkfree_plus_route(seq: int, num_block_stages: int) -> list[int]:
    """Block-stage order of microbatch ``seq``: swapped ends on odd microbatches (N >= 4)."""
    route = list(range(1, num_block_stages + 1))
    if seq % 2 == 1:
        if num_block_stages < 4:
            raise ValueError("CheckFree+ needs at least 4 block stages")
        route[0], route[1] = route[1], route[0]
        route[-1], route[-2] = route[-2], route[-1]
    return route


def swap_partner(stage: int, num_block_stages: int) -> int | None:
    """CheckFree+'s partner of a boundary block stage (1<->2, N<->N-1); None otherwise."""
    n = num_block_stages
    return {1: 2, 2: 1, n: n - 1, n - 1: n}.get(stage) if n >= 4 else None


def plan_recovery(
    stage: int,
    num_block_stages: int,
    live: Mapping[int, Sequence[PeerRecord]],
    method: str,
) -> RecoveryPlan:
    """What a node taking over ``stage`` should load, given the live replicas per stage."""
    if method not in METHODS:
        raise ValueError(f"recovery method must be one of {', '.join(METHODS)}, not {method!r}")
    if live.get(stage):
        return RecoveryPlan(stage, "copy", (Source(stage, 1.0),))
    if method in ("random", "checkpoint"):
        return RecoveryPlan(stage, method)
    if stage == 0:
        # The head stage has no block neighbours; CheckFree+ keeps copies of it on stage 1.
        holders = [r for rs in live.values() for r in rs if r.head_backup_step > 0]
        if method == "checkfree+" and holders:
            return RecoveryPlan(stage, "head_copy", (Source(min(r.stage for r in holders), 1.0),))
        return RecoveryPlan(stage, "seed")
    n = num_block_stages
    partner = swap_partner(stage, n) if method == "checkfree+" else None
    if partner is not None and live.get(partner):
        return RecoveryPlan(stage, "swap_copy", (Source(partner, 1.0),))
    below = next((s for s in range(stage - 1, 0, -1) if live.get(s)), None)
    above = next((s for s in range(stage + 1, n + 1) if live.get(s)), None)
    if below is not None and above is not None:
        w_prev = _grad_norm(live[below]) + EPSILON
        w_next = _grad_norm(live[above]) + EPSILON
        return RecoveryPlan(stage, "checkfree", (Source(below, w_prev), Source(above, w_next)))
    nearest = below if below is not None else above
    if nearest is not None:
        return RecoveryPlan(stage, "neighbour_copy", (Source(nearest, 1.0),))
    return RecoveryPlan(stage, "seed")


def _grad_norm(replicas: Sequence[PeerRecord]) -> float:
    """The stage's gradient norm: the most advanced replica's latest post-clip norm."""
    return max(replicas, key=lambda r: r.step).grad_norm


def weighted_average(
    states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]
) -> dict[str, torch.Tensor]:
    """Key-by-key weighted mean of stage states with identical keys and shapes (fp32)."""
    if not states or len(states) != len(weights):
        raise ValueError("need one weight per state")
    keys = states[0].keys()
    for s in states[1:]:
        if s.keys() != keys:
            raise ValueError("stages to average have different parameter names")
    total = float(sum(weights))
    out = {}
    for k in keys:
        acc = torch.zeros_like(states[0][k], dtype=torch.float32)
        for s, w in zip(states, weights, strict=True):
            if s[k].shape != acc.shape:
                raise ValueError(f"{k}: shapes {tuple(s[k].shape)} and {tuple(acc.shape)} differ")
            acc += (w / total) * s[k].float()
        out[k] = acc
    return out


def choose_mover(
    empty_stage: int,
    self_record: PeerRecord,
    live: Mapping[int, Sequence[PeerRecord]],
    donors: Container[int] | None = None,
    in_transit: int = 0,
) -> bool:
    """Should this node leave its stage to refill ``empty_stage``?

    Only the block stage with the most replicas gives one up, never its last; within it the
    replica with the lowest peer id goes, so every node reaches the same answer from the
    same table and only one moves (no herd). Head nodes never move: the head stage is
    refilled by joining head nodes. ``donors``: the stages that may give one (None: all);
    with neighbourhood tables, the stages that hold ``empty_stage`` and so see it empty in
    their own tables rather than in a summary any member could make up.

    ``in_transit``: block replicas joining or moving (records not ready). While one is,
    nobody moves: it may be the refill. A refiller first drains its old stage, its record
    there and not ready, so its old stage counts one replica fewer and the rule would name
    a second donor (both stages next to a killed stage 2 refilled it in logged test runs).
    """
    if in_transit:
        return False
    counts = {
        s: len(rs)
        for s, rs in live.items()
        if s not in (empty_stage, 0) and (donors is None or s in donors)
    }
    if not counts:
        return False
    mine = self_record.stage
    if counts.get(mine, 0) < 2 or counts[mine] < max(counts.values()):
        return False
    donor = min((s for s, c in counts.items() if c == counts[mine]))
    if donor != mine:
        return False  # ties between stages: the lowest-numbered one gives
    return self_record.peer_id == min(r.peer_id for r in live[mine])


def random_seed(rng: random.Random) -> int:
    """A fresh seed for random re-initialisation (the baseline CheckFree is compared with)."""
    return rng.randrange(1, 2**31)
