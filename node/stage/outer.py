"""A replica's outer-optimizer state: slow weights, outer momentum, and what it offers.

NoLoCo (arXiv 2506.10911, section 3) and DiLoCo (arXiv 2311.08105) keep, beside a replica's
live ("fast") weights ``theta``, its slow weights ``phi`` from the last outer step and an
outer momentum ``m``; ``docs/algorithms.md`` sections 4 and 5 state the rules, and
``swarm.outer`` applies them. This module owns that state for one replica, on flat fp32
vectors: the contribution it offers a NoLoCo partner (its slow weights and pseudo-gradient
``theta - phi``, encoded), measuring a partner's offer against it before it is mixed in
(``swarm.screen`` judges the numbers), and applying either rule to ``theta`` in place. It
also keeps the *anchor*, this replica's weights when it last averaged with a partner, to
say how far it has moved alone since.

Does not own the module, the optimizer, or when rounds happen (``node.stage.runner``,
``node.services.sync``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from protocol.quant import decode_tensor, encode_tensor
from swarm.outer import (
    DiLoCoConfig,
    NoLoCoConfig,
    diloco_outer_step,
    noloco_outer_step,
    rms_distance,
    scale_by_steps,
)

Encoded = tuple[dict[str, torch.Tensor], dict[str, Any]]
"""Tensors as they travel in a frame, and their codec metadata."""
MAX_POSITION = 1e12
"""The largest learning-rate schedule position an offer may say (a step count: a trillion
inner steps is beyond any run); larger ones are refused as malformed."""


def is_place(value: object) -> bool:
    """Whether a peer's ``value`` is a place in the learning-rate schedule this replica may
    take: a number from 0 to ``MAX_POSITION`` (NaN and inf fall outside the range)."""
    return type(value) in (int, float) and 0 <= value <= MAX_POSITION  # type: ignore[operator]


@dataclass(frozen=True)
class Offer:
    """A partner's decoded NoLoCo offer and how far it lies from this replica."""

    phi: torch.Tensor
    delta: torch.Tensor
    distance: float
    """RMS distance between the partner's fast weights (phi + delta) and ours; NaN if its
    tensors are not finite."""
    scale: float
    """RMS of our own fast weights."""
    movement: float
    """How far we moved since we last averaged with a partner (RMS), over every solo round
    since: an honest partner apart as long (a partition, a long solo stretch) drifted about
    as far, so the screen must allow that much."""
    steps: int = -1
    """Inner steps the partner took in this round (-1: not said)."""
    ref_steps: float = 0.0
    """The partner's estimate of the stage's usual inner steps per round (0: none)."""
    position: float = -1.0
    """The partner's position in the learning-rate schedule (-1: not said;
    ``swarm.outer.pair_position``)."""


class OuterState:
    """Slow weights ``phi``, outer momentum ``m`` and the anchor of one replica."""

    def __init__(self, theta: torch.Tensor) -> None:
        """A replica starting from the fast weights ``theta``: ``phi = theta``, ``m = 0``."""
        self.phi = theta.detach().clone()
        self.m = torch.zeros_like(self.phi)
        self.anchor = self.phi.clone()

    def load(self, phi: torch.Tensor, m: torch.Tensor, theta: torch.Tensor) -> None:
        """Take a copied replica's slow weights and momentum (its fast weights ``theta``)."""
        device = self.phi.device
        self.phi = phi.to(device, torch.float32).clone()
        self.m = m.to(device, torch.float32).clone()
        self.anchor = theta.detach().clone()

    def contribution(
        self,
        theta: torch.Tensor,
        codec: str,
        poison: str = "",
        steps: int = -1,
        ref_steps: float = 0.0,
        position: float = -1.0,
    ) -> Encoded:
        """This replica's NoLoCo offer: its slow weights and pseudo-gradient, encoded.

        The tensors are new ones, never views of ``phi``: a reply is written to the wire
        after its handler returned, while this replica may already be applying its own outer
        step to ``phi`` in place (the partner would then receive updated weights; fp32
        encoding does not copy). ``poison``: ``sync.debug_poison``, fault injection.
        ``steps``, ``ref_steps``: the inner steps this replica took in the round and its
        estimate of the stage's usual number (``swarm.outer.scale_by_steps``); ``position``:
        its place in the learning-rate schedule (``swarm.outer.pair_position``, -1: not
        said)."""
        phi, delta = self.phi.clone(), theta - self.phi
        if poison:  # what a hostile partner sends
            phi, delta = _poisoned(phi, poison), _poisoned(delta, poison)
        phi_t, phi_meta = encode_tensor(phi, codec, name="phi")
        d_t, d_meta = encode_tensor(delta, codec, name="delta")
        meta = {
            "phi": phi_meta,
            "delta": d_meta,
            "steps": steps,
            "ref_steps": ref_steps,
            "position": position,
        }
        return {**phi_t, **d_t}, meta

    def measure(self, offer: Encoded, theta: torch.Tensor) -> Offer:
        """A partner's offer, decoded and measured against this replica (not applied).

        ``ValueError`` (``ProtocolError`` included) when it is malformed or does not fit.
        """
        tensors, meta = offer
        if not isinstance(meta.get("phi"), dict) or not isinstance(meta.get("delta"), dict):
            raise ValueError("offer lacks phi or delta metadata")
        phi_j = decode_tensor(tensors, meta["phi"]).to(self.phi.device)
        d_j = decode_tensor(tensors, meta["delta"]).to(self.phi.device)
        if phi_j.shape != self.phi.shape or d_j.shape != self.phi.shape:
            raise ValueError(
                f"partner sent {tuple(phi_j.shape)} weights, this stage has {tuple(self.phi.shape)}"
            )
        finite = bool(torch.isfinite(phi_j).all() and torch.isfinite(d_j).all())
        # the partner's fast weights against ours: a poisoned phi or delta both show here
        distance = rms_distance(phi_j + d_j, theta) if finite else math.nan
        scale = rms_distance(theta, torch.zeros_like(theta))
        steps, ref_steps = meta.get("steps", -1), meta.get("ref_steps", 0.0)
        if type(steps) is not int or not -1 <= steps <= 10**9:
            raise ValueError(f"offer's steps {steps!r} is not a count")
        if type(ref_steps) not in (int, float) or not 0 <= ref_steps <= 1e9:
            raise ValueError(f"offer's ref_steps {ref_steps!r} is not a count")
        position = meta.get("position", -1.0)
        # -1: not said; otherwise a step count (finite: the range excludes NaN and inf)
        if position != -1 and not is_place(position):
            raise ValueError(f"offer's position {position!r} is not a step count")
        movement = rms_distance(theta, self.anchor)
        return Offer(
            phi_j, d_j, distance, scale, movement, steps, float(ref_steps), float(position)
        )

    def apply_noloco(
        self,
        theta: torch.Tensor,
        offer: Offer | None,
        config: NoLoCoConfig,
        steps: int = -1,
        ref_steps: float = 0.0,
    ) -> float | None:
        """NoLoCo's outer step on ``theta`` in place, with a screened offer or solo; returns
        the RMS spread between our slow weights and the partner's (None when solo).

        With ``steps`` and ``ref_steps`` known on both sides (ours and the offer's), both
        pseudo-gradients are scaled by ``swarm.outer.scale_by_steps`` of the members' mean
        steps and mean ``ref_steps``; otherwise the published rule applies as it is."""
        partners, spread, own_scale = [], None, 1.0
        if offer is None:
            if steps >= 0 and ref_steps > 0:
                own_scale = scale_by_steps(steps, ref_steps, config.max_step_scale)
        else:
            spread = rms_distance(self.phi, offer.phi)
            delta = offer.delta
            if min(steps, offer.steps) >= 0 and min(ref_steps, offer.ref_steps) > 0:
                ref = (ref_steps + offer.ref_steps) / 2
                own_scale = scale_by_steps((steps + offer.steps) / 2, ref, config.max_step_scale)
                delta = delta * own_scale
            partners.append((delta, offer.phi))
        noloco_outer_step(theta, self.phi, self.m, partners, config, own_scale)
        if offer is not None:
            self.anchor = theta.clone()
        return spread

    def delta(self, theta: torch.Tensor) -> torch.Tensor:
        """DiLoCo's outer gradient ``phi - theta``."""
        return self.phi - theta

    def apply_diloco(
        self, theta: torch.Tensor, delta_mean: torch.Tensor, config: DiLoCoConfig
    ) -> None:
        """DiLoCo's Nesterov outer step on ``theta`` in place with the mean outer gradient."""
        diloco_outer_step(theta, self.phi, self.m, delta_mean.to(self.phi.device), config)


def _poisoned(t: torch.Tensor, spec: str) -> torch.Tensor:
    """``t`` as ``sync.debug_poison`` corrupts it: all NaN ("nan") or times K ("scale:K")."""
    if spec == "nan":
        return torch.full_like(t, math.nan)
    kind, _, factor = spec.partition(":")
    return t * float(factor) if kind == "scale" else t
