"""Training stability: the loss-spike guard, the thermometers and the recovery learning rate."""

import math

import pytest
import torch

from node.stage.model import _max_causal_logit
from node.stage.runner import LOGITS_EVERY, StageRunner
from node.stage.spikes import SpikeGuard
from tests.test_runner import runner


def test_spike_guard_by_hand() -> None:
    g = SpikeGuard(multiple=2.0, warmup=2, decay=0.5)
    assert not g.is_spike(4.0)  # warming up: average 4
    assert not g.is_spike(100.0)  # still warming up: average 0.5 * 4 + 0.5 * 100 = 52
    assert g.average == pytest.approx(52.0)
    assert g.is_spike(105.0)  # 105 > 2 * 52: refused, the average stays
    assert g.average == pytest.approx(52.0) and g.num_spikes == 1
    assert not g.is_spike(100.0)  # 100 <= 104: accepted, average 76
    assert g.average == pytest.approx(76.0)
    assert g.is_spike(math.nan) and g.is_spike(math.inf) and g.num_spikes == 3
    off = SpikeGuard(multiple=0.0, warmup=0)
    assert not off.is_spike(1.0) and not off.is_spike(1e9) and off.is_spike(-math.inf)


def head_runner(**train: str) -> StageRunner:
    return runner(0, **train)


def test_a_non_finite_loss_reaches_no_parameter_of_the_head() -> None:
    r = head_runner()
    h = torch.full((2, 8, 128), math.nan)
    labels = torch.zeros(2, 8, dtype=torch.long)
    loss, grad = r.head_loss(h, labels, train=True)
    assert math.isnan(loss) and grad is None
    assert all(p.grad is None for p in r.module.parameters())
    loss, grad = r.head_loss(torch.randn(2, 8, 128), labels, train=True)
    assert math.isfinite(loss) and grad is not None  # the next clean one trains


def test_a_loss_spike_is_not_trained_on() -> None:
    r = head_runner(spike_loss_multiple="1.5")
    r.loss_guard.warmup = 3
    h = torch.randn(2, 8, 128)
    with torch.no_grad():
        r.module.lm_head.weight.mul_(50)  # a confident model: right labels cost little
        logits = r.module.logits(h)
    right, wrong = logits.argmax(-1), logits.argmin(-1)
    for _ in range(3):
        _, grad = r.head_loss(h, right, train=True)
        assert grad is not None
    r.optimizer.zero_grad(set_to_none=True)
    loss, grad = r.head_loss(h, wrong, train=True)  # a bad batch: a far larger loss
    assert grad is None and loss > 1.5 * r.loss_guard.average
    assert all(p.grad is None for p in r.module.parameters())


def test_a_gradient_spike_skips_the_inner_step_and_the_preclip_norm_shows_it() -> None:
    r = runner(1, step_samples="2", spike_grad_multiple="10")
    r.grad_guard.warmup = 3
    x = torch.randn(2, 8, 128)
    for i in range(3):
        r.block_forward(f"m{i}", x, train=True)
        r.block_backward(f"m{i}", torch.randn(2, 8, 128))
    assert r.step == 3 and r.thermo.grad_norm_preclip == pytest.approx(r.grad_guard.average, rel=2)
    before = {k: v.clone() for k, v in r.module.state_dict().items()}
    r.block_forward("big", x, train=True)
    r.block_backward("big", 1e6 * torch.randn(2, 8, 128))
    assert r.step == 3 and r.grad_guard.num_spikes == 1  # skipped
    assert r.thermo.grad_norm_preclip > 1e3  # a runaway the clipped norm could never show
    assert r.thermo.grad_norm <= 1.0
    after = r.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # no parameter moved
    r.block_forward("next", x, train=True)
    r.block_backward("next", torch.randn(2, 8, 128))
    assert r.step == 4  # and training goes on


def test_attention_logit_thermometer_matches_a_direct_computation() -> None:
    r = runner(1)
    x = torch.randn(1, 8, 128)
    r.block_forward("a", x, train=True)  # the first training forward is sampled
    assert set(r.thermo.attn_logit_max) == {0, 1}  # stage 1 of 3 holds blocks 0 and 1
    block = r.module.blocks[0]
    with torch.no_grad():
        h = block.attn_norm(x)
        attn = block.attn
        shape = (1, 8, attn.num_heads, attn.head_dim)
        q = attn.wq(h).view(shape).transpose(1, 2)
        k = attn.wk(h).view(shape).transpose(1, 2)
        cos, sin = r.module.rotary(8, x.device)
        from node.stage.model import _apply_rotary

        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(attn.head_dim)
        want = max(float(scores[..., i, : i + 1].max()) for i in range(8))
    assert r.thermo.attn_logit_max[0] == pytest.approx(want, rel=1e-5)
    assert _max_causal_logit(q, k) == pytest.approx(want, rel=1e-5)
    for i in range(LOGITS_EVERY - 1):  # not sampled again until LOGITS_EVERY forwards
        r.block_forward(f"b{i}", x * 2, train=True)
    assert r.thermo.attn_logit_max[0] == pytest.approx(want, rel=1e-5)
    assert not any(b.attn.observe for b in r.module.blocks)


@pytest.mark.parametrize("boost_steps", [0, 3])
def test_recovery_lr_boost_lasts_as_configured_and_travels_with_the_state(boost_steps: int) -> None:
    from node.config import resolve_config

    overrides = {"train.step_samples": "2", "recovery.lr_boost_steps": str(boost_steps)}
    r = StageRunner(resolve_config(None, {}, overrides), 1)
    r._build()
    r.adopt_weights(r.params(), 1.1)
    x = torch.randn(2, 8, 128)
    scales = []
    for i in range(5):
        scales.append(r.current_lr_scale())
        r.block_forward(f"m{i}", x, train=True)
        r.block_backward(f"m{i}", torch.randn(2, 8, 128))
    if boost_steps:
        assert scales == [1.1, 1.1, 1.1, 1.0, 1.0]
    else:
        assert scales == [1.1] * 5  # for good, as CheckFree's reference code
    copy = StageRunner(r.config, 1)
    copy._build()
    copy.load(*r.snapshot())  # a replica that copies the rebuilt one
    assert (copy.lr_scale, copy.lr_scale_until) == (r.lr_scale, r.lr_scale_until)
    assert copy.current_lr_scale() == r.current_lr_scale()


def test_a_lasting_jump_is_a_new_level_not_a_run_of_spikes() -> None:
    """A stage lost and rebuilt makes the loss jump for good: after ``patience`` spikes in a
    row the guard takes the new level (else training would stop for good)."""
    g = SpikeGuard(multiple=1.5, warmup=3, patience=4)
    for _ in range(3):
        assert not g.is_spike(2.0)
    assert [g.is_spike(4.5) for _ in range(4)] == [True, True, True, False]
    assert g.average == pytest.approx(4.5) and g.num_rebaselines == 1
    assert not g.is_spike(4.4)  # training goes on from the new level,
    assert g.num_accepted == 2  # warming up again from it
    assert g.is_spike(math.nan)  # NaN is never a new level
