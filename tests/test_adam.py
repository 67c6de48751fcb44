"""The inner Adam (``node.stage.adam``) against ``torch.optim.Adam`` and a hand-worked step."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from node.stage.adam import Adam


def _pair(seed: int) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    return ours, theirs


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.95)])
def test_the_same_bits_as_torch_over_steps_with_a_changing_rate(betas: tuple[float, float]) -> None:
    """Twenty steps, random gradients (one parameter without one at some steps), the rate
    set through ``param_groups`` before each step as the runner does: every parameter and
    both moments equal torch's exactly."""
    ours, theirs = _pair(1)
    mine = Adam(ours, lr=1e-3, betas=betas, eps=1e-8)
    ref = torch.optim.Adam(theirs, lr=1e-3, betas=betas, eps=1e-8)
    gen = torch.Generator().manual_seed(2)
    for step in range(20):
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            if i == 2 and step % 3 == 0:
                continue  # no gradient: neither steps this parameter
            g = torch.randn(a.shape, generator=gen) * 10.0 ** (step % 4 - 2)
            a.grad, b.grad = g.clone(), g.clone()
        lr = 1e-3 * (1 + math.cos(step / 5))
        mine.param_groups[0]["lr"] = ref.param_groups[0]["lr"] = lr
        mine.step()
        ref.step()
        mine.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(mine.state[a][key], ref.state[b][key]), key
    assert all(p.grad is None for p in ours)


def test_one_step_by_hand() -> None:
    """Step 1 from zero moments: m = 0.1 g, v = 0.001 g^2; bias-corrected they are g and
    g^2, so p moves by lr * g / (|g| + eps): -lr sign(g) to within eps."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    p.grad = torch.tensor([4.0, -0.5, 0.0])
    opt = Adam([p], lr=0.1, betas=(0.9, 0.999), eps=1e-8)
    opt.step()
    expected = [1.0 - 0.1 * 4.0 / (4.0 + 1e-8), -2.0 + 0.1 * 0.5 / (0.5 + 1e-8), 0.5]
    assert p.detach().tolist() == pytest.approx(expected, abs=1e-7)
    state = opt.state[p]
    assert state["step"].item() == 1.0
    assert state["exp_avg"].tolist() == pytest.approx([0.4, -0.05, 0.0])
    assert state["exp_avg_sq"].tolist() == pytest.approx([0.016, 0.00025, 0.0])


def test_zero_grad_keeps_or_forgets_and_bad_settings_are_refused() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    opt = Adam([p], lr=0.1, betas=(0.9, 0.999), eps=1e-8)
    p.grad = torch.ones(2)
    opt.zero_grad(set_to_none=False)
    assert p.grad is not None and torch.equal(p.grad, torch.zeros(2))
    opt.zero_grad()
    assert p.grad is None
    for lr, betas in ((-1.0, (0.9, 0.999)), (0.1, (1.0, 0.999)), (float("nan"), (0.9, 0.9))):
        with pytest.raises(ValueError, match="out of range"):
            Adam([p], lr=lr, betas=betas, eps=1e-8)


def test_a_runner_trains_without_importing_the_compiler() -> None:
    """The reason for this class: a daemon's optimizer steps never import ``torch._dynamo``
    (822 modules, about 2 s of CPU at every node's start)."""
    code = (
        "import sys, torch\n"
        "from node.stage.adam import Adam\n"
        "m = torch.nn.Linear(4, 4)\n"
        "opt = Adam(m.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8)\n"
        "m(torch.randn(2, 4)).sum().backward()\n"
        "torch.nn.utils.clip_grad_norm_(list(m.parameters()), 1.0)\n"
        "opt.step(); opt.zero_grad()\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
