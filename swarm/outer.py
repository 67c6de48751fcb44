"""Outer optimizer steps: NoLoCo's pairwise rule and DiLoCo's Nesterov step.

Pure maths on flat fp32 tensors, usable from any training loop (the NoLoCo authors note
the optimizer can be reused in other protocols). Nothing here talks to peers: the caller
brings the other group members' contributions.

**NoLoCo** (Kolehmainen et al., 2025, arXiv 2506.10911, section 3; ``docs/algorithms.md`` section 4).
Replica ``i`` keeps fast weights ``theta``, slow weights ``phi`` and outer momentum ``m``.
Every ``H`` inner steps it forms a group ``G`` with one random partner and, with
``d_k = theta_k - phi_k``::

    g_bar   = mean_k d_k
    phi_bar = mean_k phi_k
    m      <- alpha * m + beta * g_bar + gamma * (phi_bar - phi_i)
    phi    <- phi + m
    theta  <- phi

Defaults from the reference code: ``alpha = 0.5``, ``beta = gamma = 0.7``. A solo step
(``G = {i}``, no partner) is the same rule without the pull term. The published rule never
touches the inner Adam state. Our departures for replicas of unequal speed
(``scale_by_steps``, ``pair_position``, ``momentum_decay``) leave equal replicas on the
published rule; the last decays a slow replica's inner momentum.

**DiLoCo** (Douillard et al., 2023, arXiv 2311.08105, algorithm 1). All replicas average
the outer gradient ``delta = phi - theta``; the slow weights take one SGD step with
Nesterov momentum (lr 0.7, momentum 0.9)::

    buf   <- mu * buf + delta_mean
    phi   <- phi - lr * (delta_mean + mu * buf)
    theta <- phi
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_STEP_SCALE = 4.0
"""The most ``scale_by_steps`` enlarges a pseudo-gradient by default
(``sync.max_step_scale``): a replica that took few inner steps in a round has a noisy one,
and scaling amplifies that noise. In one process, with the slow replicas at one or two
steps a round, a bound of 1 (never enlarge) spread the unequal stage further (2.91 times
the equal one against 2.02, three seeds) and 2 no less (2.09; ``bench/README.md``)."""


@dataclass(frozen=True)
class NoLoCoConfig:
    alpha: float = 0.5
    """Outer momentum decay."""
    beta: float = 0.7
    """Weight of the group's mean pseudo-gradient."""
    gamma: float = 0.7
    """Weight of the pull towards the group's mean slow weights."""
    max_step_scale: float = MAX_STEP_SCALE
    """Our departure's bound, not the published rule's: the most ``scale_by_steps``
    enlarges a group's pseudo-gradient."""


@dataclass(frozen=True)
class DiLoCoConfig:
    lr: float = 0.7
    """Outer learning rate."""
    momentum: float = 0.9
    """Nesterov momentum of the outer SGD."""


def noloco_outer_step(
    theta: torch.Tensor,
    phi: torch.Tensor,
    momentum: torch.Tensor,
    partners: Sequence[tuple[torch.Tensor, torch.Tensor]],
    config: NoLoCoConfig = NoLoCoConfig(),  # noqa: B008 - frozen, immutable default
    own_scale: float = 1.0,
) -> None:
    """Apply NoLoCo's outer step in place on ``theta``, ``phi`` and ``momentum``.

    ``partners`` holds ``(d_j, phi_j)`` of the other members of the group, with
    ``d_j = theta_j - phi_j``; empty for a solo step. ``own_scale`` multiplies this
    replica's own ``theta - phi`` in the mean (1: the published rule; see
    ``scale_by_steps``, whose factor the caller applies to the partners' ``d_j`` too).
    """
    size = 1 + len(partners)
    g_bar = (theta - phi) * own_scale
    phi_bar = phi.clone()
    for d_j, phi_j in partners:
        g_bar += d_j
        phi_bar += phi_j
    g_bar /= size
    phi_bar /= size
    momentum.mul_(config.alpha).add_(g_bar, alpha=config.beta)
    momentum.add_(phi_bar - phi, alpha=config.gamma)
    phi.add_(momentum)
    theta.copy_(phi)


def scale_by_steps(steps: float, ref_steps: float, cap: float = MAX_STEP_SCALE) -> float:
    """The factor that expresses a group's mean pseudo-gradient, over ``steps`` inner steps
    per member on average, as one over ``ref_steps``: ``ref_steps / steps``, at most
    ``cap`` (0 for no steps: there is no displacement to contribute).

    Our departure from NoLoCo for replicas of unequal speed (``docs/algorithms.md`` section
    4): on a shared clock a fast replica takes more inner steps per round than a slow one,
    so pairs of fast replicas would move their slow weights much further than pairs of slow
    ones, and the stage's replicas would spread apart between pairings. With this factor the
    group's ``g_bar`` is its total displacement per inner step (the members' displacements
    pooled, so a member's share grows with the steps behind it, as FedAvg weights clients by
    their data) times the stage's usual steps per round: every pair moves its slow weights
    on the same scale. For equal replicas ``steps == ref_steps`` and the factor is 1: the
    published rule."""
    if steps <= 0 or ref_steps <= 0:
        return 0.0 if steps <= 0 else 1.0
    return min(cap, ref_steps / steps)


def momentum_decay(steps: float, ref_steps: float, beta1: float) -> float:
    """The factor on a replica's inner Adam first moment at an outer step on the clock:
    ``beta1`` to the power of the inner steps it fell short of the stage's usual number
    this round (1 when it took as many or more, or when ``ref_steps`` is unknown), as if it
    had taken the missing steps with a zero gradient.

    Our fourth departure for replicas of unequal speed (``docs/algorithms.md`` section 4;
    the papers never touch the inner optimizer's state). Adam's first moment averages the
    last ``1 / (1 - beta1)`` steps' gradients (10 at 0.9). A replica 4x slower than the
    stage's usual takes those steps over four rounds' time, during which its pairings have
    moved its slow weights several times: its momentum keeps pushing along gradients taken
    at weights it no longer holds, in a direction its partners do not share, and the stage
    spreads apart. Decayed by the steps it missed, its momentum remembers the same span of
    wall-clock time as its partners'. Replicas at or above the usual pace are untouched, so
    equal replicas keep the published rule up to the noise in their step counts."""
    if ref_steps <= 0 or steps >= ref_steps:
        return 1.0
    return float(beta1 ** (ref_steps - max(0.0, steps)))


def pair_position(own: float, partner: float, limit: float = math.inf) -> float:
    """A paired replica's new position in the inner learning-rate schedule: the mean of the
    two members' positions (inner steps, in units of ``step_samples`` samples).

    Our third departure for replicas of unequal speed (``docs/algorithms.md`` section 4). The
    papers' replicas all take ``H`` inner steps per round, so their step counts, and with
    them the warm-up and cosine schedule, stay equal. On a shared clock a replica 4x slower
    than its partners takes a quarter of their steps; keyed on its own count it would still
    be warming up (a fraction of the peak rate per step) when the others have decayed, so
    its steps move its weights far less than theirs, ``scale_by_steps`` (which pools
    displacements *per step*) would misread it, and the stage spreads apart. The position
    is averaged with each partner, as the slow weights are: with equal replicas both
    positions are the same and nothing changes; otherwise every replica's position tends to
    the stage's mean steps per replica, which advances by the stage's usual steps per round,
    the pace at which pooling moves the slow weights. Both members compute the same value
    from the positions they offered.

    ``limit``: the partner's position is first brought within ``limit`` of ours, so a
    partner that lies about its place moves this replica's schedule by at most ``limit / 2``
    a round (honest places differ by a few rounds' steps; a lie of step 10**12 would
    otherwise end a victim's warm-up and decay in one round)."""
    return shared_position(own, (own + partner) / 2, limit)


def shared_position(own: float, mean: float, limit: float = math.inf) -> float:
    """A replica's new place in the learning-rate schedule from the mean place of the
    replicas it synchronised with: ``mean`` itself (so every member takes the same place),
    unless it lies more than ``limit / 2`` from ``own``, when the replica moves ``limit / 2``
    towards it. A NoLoCo pair's mean is ``pair_position``; a DiLoCo ring's is the members'
    mean, which the ring sums beside the pseudo-gradients (``swarm.allreduce``): the same
    departure, for the same reason, as the pair's. With ``N`` members one that lies can move
    the mean by any amount, hence the bound here, after averaging, not before."""
    half = limit / 2
    if abs(mean - own) <= half:
        return mean
    return own + half if mean > own else own - half


def diloco_outer_step(
    theta: torch.Tensor,
    phi: torch.Tensor,
    buffer: torch.Tensor,
    delta_mean: torch.Tensor,
    config: DiLoCoConfig = DiLoCoConfig(),  # noqa: B008 - frozen, immutable default
) -> None:
    """Apply DiLoCo's Nesterov outer step in place; ``delta_mean`` is the mean of ``phi - theta``."""
    buffer.mul_(config.momentum).add_(delta_mean)
    phi.sub_(delta_mean + config.momentum * buffer, alpha=config.lr)
    theta.copy_(phi)


def rms_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Root-mean-square distance between two flat tensors (the replica-spread gauge)."""
    return float(torch.sqrt(torch.mean((a - b) ** 2)))
