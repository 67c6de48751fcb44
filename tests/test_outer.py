"""NoLoCo and DiLoCo outer steps against hand-computed values."""

from dataclasses import replace

import pytest
import torch

from swarm.outer import (
    DiLoCoConfig,
    NoLoCoConfig,
    diloco_outer_step,
    noloco_outer_step,
    rms_distance,
)


def t(*v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def test_noloco_pair_by_hand() -> None:
    # i: theta 3, phi 1, m 0.2 ; j: theta 2, phi 2, m 0   (alpha .5, beta = gamma = .7)
    # g_bar = (2 + 0)/2 = 1 ; phi_bar = 1.5
    # m_i = .5*.2 + .7*1 + .7*(1.5 - 1) = 1.15 ; phi_i = 2.15
    # m_j = 0 + .7*1 + .7*(1.5 - 2) = .35 ; phi_j = 2.35
    ti, pi, mi = t(3.0, -1.0), t(1.0, 0.0), t(0.2, 0.0)
    tj, pj, mj = t(2.0, 1.0), t(2.0, 0.0), t(0.0, 0.0)
    di, dj = ti - pi, tj - pj
    pi0, pj0 = pi.clone(), pj.clone()
    noloco_outer_step(ti, pi, mi, [(dj, pj0)])
    noloco_outer_step(tj, pj, mj, [(di, pi0)])
    # second coordinate: d_i = -1, d_j = 1, phis 0: g_bar 0, pull 0 -> nothing moves
    assert mi.tolist() == pytest.approx([1.15, 0.0])
    assert pi.tolist() == pytest.approx([2.15, 0.0])
    assert ti.tolist() == pytest.approx([2.15, 0.0])
    assert mj.tolist() == pytest.approx([0.35, 0.0])
    assert pj.tolist() == pytest.approx([2.35, 0.0])


def test_noloco_solo_has_no_pull_term() -> None:
    theta, phi, m = t(3.0), t(1.0), t(0.2)
    noloco_outer_step(theta, phi, m, [])
    # m = .5*.2 + .7*2 = 1.5 ; phi = 2.5
    assert (m.item(), phi.item(), theta.item()) == pytest.approx((1.5, 2.5, 2.5))


def test_noloco_pull_brings_slow_weights_together() -> None:
    a_phi, b_phi = t(0.0), t(1.0)
    a_theta, b_theta = a_phi.clone(), b_phi.clone()  # no inner progress: only the pull acts
    a_m, b_m = t(0.0), t(0.0)
    before = rms_distance(a_phi, b_phi)
    a0, b0 = a_phi.clone(), b_phi.clone()
    noloco_outer_step(a_theta, a_phi, a_m, [(t(0.0), b0)])
    noloco_outer_step(b_theta, b_phi, b_m, [(t(0.0), a0)])
    assert rms_distance(a_phi, b_phi) == pytest.approx(0.3 * before)  # 1 - 2*gamma/2


def test_noloco_custom_constants() -> None:
    theta, phi, m = t(1.0), t(0.0), t(1.0)
    noloco_outer_step(theta, phi, m, [], NoLoCoConfig(alpha=0.0, beta=1.0, gamma=0.0))
    assert phi.item() == pytest.approx(1.0)  # plain averaging step: phi <- theta


def test_diloco_by_hand() -> None:
    # buf = .9*.1 + .4 = .49 ; update = .4 + .9*.49 = .841 ; phi = 1 - .7*.841 = .4113
    theta, phi, buf = t(0.5), t(1.0), t(0.1)
    diloco_outer_step(theta, phi, buf, t(0.4))
    assert buf.item() == pytest.approx(0.49)
    assert phi.item() == pytest.approx(0.4113)
    assert theta.item() == pytest.approx(0.4113)


def test_diloco_with_zero_momentum_is_averaging_at_lr_one() -> None:
    theta, phi, buf = t(0.5), t(1.0), t(0.0)
    diloco_outer_step(theta, phi, buf, t(0.5), DiLoCoConfig(lr=1.0, momentum=0.0))
    assert phi.item() == pytest.approx(0.5)


def simulate_spread(gamma: float, num_replicas: int, num_rounds: int, seed: int = 0) -> list[float]:
    """Replicas with noisy pseudo-gradients, random pairs each round: RMS spread around the mean."""
    import random

    gen, rng, dim = torch.Generator().manual_seed(seed), random.Random(seed), 500
    phi = [torch.zeros(dim) for _ in range(num_replicas)]
    m = [torch.zeros(dim) for _ in range(num_replicas)]
    config = NoLoCoConfig(gamma=gamma)
    spreads = []
    for _ in range(num_rounds):
        drift = 0.01 * torch.randn(dim, generator=gen)
        theta = [p + drift + 0.01 * torch.randn(dim, generator=gen) for p in phi]
        offers = [(t - p, p.clone()) for t, p in zip(theta, phi, strict=True)]
        order = list(range(num_replicas))
        rng.shuffle(order)
        for a, b in zip(order[::2], order[1::2], strict=False):
            noloco_outer_step(theta[a], phi[a], m[a], [offers[b]], config)
            noloco_outer_step(theta[b], phi[b], m[b], [offers[a]], config)
        mean = torch.stack(phi).mean(0)
        spreads.append(float(torch.sqrt(torch.stack([(p - mean) ** 2 for p in phi]).mean())))
    return spreads


def test_pull_term_bounds_the_spread_of_randomly_paired_replicas() -> None:
    with_pull = simulate_spread(0.7, num_replicas=4, num_rounds=40)
    without = simulate_spread(0.0, num_replicas=4, num_rounds=40)
    assert max(with_pull[20:]) < 0.5 * min(without[20:])  # bounded vs a random walk
    assert without[-1] > 2 * without[5]  # without the pull, replicas keep drifting apart


def test_two_replicas_that_always_pair_stay_identical() -> None:
    assert max(simulate_spread(0.7, num_replicas=2, num_rounds=10)) == 0.0


def test_scale_by_steps_by_hand() -> None:
    from swarm.outer import MAX_STEP_SCALE, scale_by_steps

    assert scale_by_steps(8, 4.0) == 0.5
    assert scale_by_steps(2, 4.0) == 2.0
    assert scale_by_steps(1, 40.0) == MAX_STEP_SCALE  # a 1-step displacement is too noisy
    assert scale_by_steps(0, 4.0) == 0.0  # nothing to contribute
    assert scale_by_steps(5, 0.0) == 1.0  # no reference: the published rule
    assert scale_by_steps(1, 40.0, cap=2.0) == 2.0  # sync.max_step_scale
    assert scale_by_steps(8, 4.0, cap=1.0) == 0.5  # a bound on enlarging, not on shrinking


def test_momentum_decay_by_hand() -> None:
    """Adam's first moment decays by beta1 per inner step a replica fell short of the stage's
    usual in a round, as if it had taken them with a zero gradient."""
    from swarm.outer import momentum_decay

    assert momentum_decay(2, 5.0, 0.9) == pytest.approx(0.9**3)  # 3 steps short
    assert momentum_decay(3, 4.5, 0.9) == pytest.approx(0.9**1.5)  # a usual count need not be whole
    assert momentum_decay(0, 4.0, 0.5) == 0.5**4  # no step at all: four missed
    assert momentum_decay(5, 5.0, 0.9) == 1.0  # the usual pace: the published rule
    assert momentum_decay(12, 5.0, 0.9) == 1.0  # faster replicas are not touched
    assert momentum_decay(2, 0.0, 0.9) == 1.0  # no usual count (the steps schedule)


def test_noloco_with_unequal_steps_by_hand() -> None:
    # i: theta 3, phi 1 (d 2 over 8 steps); j: d 1 over 2 steps, phi 2; both say 4 usual
    # pooled: 3 of displacement over 10 steps, 0.3 a step, times 4: g_bar 1.2; phi_bar 1.5
    # m_i = .7 * 1.2 + .7 * (1.5 - 1) = 1.19; phi_i = 2.19
    from node.stage.outer import Offer, OuterState

    state = OuterState(t(1.0))
    theta = t(3.0)
    offer = Offer(
        phi=t(2.0), delta=t(1.0), distance=0.0, scale=1.0, movement=0.0, steps=2, ref_steps=4.0
    )
    state.apply_noloco(theta, offer, NoLoCoConfig(), steps=8, ref_steps=4.0)
    assert state.m.tolist() == pytest.approx([1.19])
    assert state.phi.tolist() == pytest.approx([2.19]) and theta.tolist() == pytest.approx([2.19])
    # the pair's mean steps are 5 against 40 usual: 8x, bounded by sync.max_step_scale (2):
    # g_bar = 2 * 3 / 2 = 3; m = .7 * 3 + .7 * .5 = 2.45; phi 3.45
    capped, theta = OuterState(t(1.0)), t(3.0)
    far = replace(offer, ref_steps=40.0)
    capped.apply_noloco(theta, far, NoLoCoConfig(max_step_scale=2.0), steps=8, ref_steps=40.0)
    assert capped.phi.tolist() == pytest.approx([3.45])
    # equal steps: exactly the published rule
    plain, scaled = OuterState(t(1.0)), OuterState(t(1.0))
    a, b = t(3.0), t(3.0)
    same = Offer(
        phi=t(2.0), delta=t(1.0), distance=0.0, scale=1.0, movement=0.0, steps=5, ref_steps=5.0
    )
    plain.apply_noloco(a, same, NoLoCoConfig())
    scaled.apply_noloco(b, same, NoLoCoConfig(), steps=5, ref_steps=5.0)
    assert a.tolist() == b.tolist()


def test_shared_position_by_hand() -> None:
    from swarm.outer import pair_position, shared_position

    assert shared_position(10.0, 30.0) == 30.0  # a ring's mean place, taken as it is
    assert shared_position(100.0, 250.0, limit=400.0) == 250.0  # within half the limit
    assert shared_position(100.0, 1e12, limit=400.0) == 300.0  # beyond it: half the limit
    assert shared_position(100.0, -1e12, limit=400.0) == -100.0
    # a pair's mean is the ring's rule at N = 2: the partner brought within the limit first
    for own, partner in ((100.0, 1e12), (100.0, 0.0), (100.0, 130.0), (7.0, 7.0)):
        clamped = min(max(partner, own - 40.0), own + 40.0)
        assert pair_position(own, partner, limit=40.0) == (own + clamped) / 2


def test_pair_position_by_hand() -> None:
    from swarm.outer import pair_position

    assert pair_position(10.0, 30.0) == pair_position(30.0, 10.0) == 20.0  # both members agree
    assert pair_position(7.0, 7.0) == 7.0  # equal replicas: the published rule, nothing moves
    # gossip averaging keeps the stage's mean place: 4 replicas at 0, 8, 16, 40 (mean 16)
    places = [0.0, 8.0, 16.0, 40.0]
    for i, j in ((0, 3), (1, 2), (0, 1), (2, 3)):
        places[i] = places[j] = pair_position(places[i], places[j])
    assert sum(places) / 4 == 16.0 and max(places) - min(places) < 40.0 / 2
    # a partner's place is first brought within the limit of ours: a lie moves us by half it
    assert pair_position(100.0, 1e12, limit=400.0) == 300.0
    assert pair_position(100.0, 0.0, limit=40.0) == 80.0
    assert pair_position(100.0, 130.0, limit=40.0) == 115.0  # within it: the mean
