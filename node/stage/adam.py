"""The inner optimizer: Adam (Kingma & Ba, "Adam: A Method for Stochastic Optimization",
ICLR 2015, arXiv 1412.6980, Algorithm 1), with ``eps`` added to the bias-corrected root of
the second moment as PyTorch places it.

Per parameter, at step t with gradient g::

    m <- beta1 m + (1 - beta1) g            (first moment; torch's lerp)
    v <- beta2 v + (1 - beta2) g*g          (second moment)
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

The same operations in the same order as ``torch.optim.Adam``'s loop on CPU (no weight
decay, no amsgrad), so the two agree to the last bit (``tests/test_adam.py``), and the same
state layout (``state[p]`` holds ``step``, ``exp_avg``, ``exp_avg_sq``), so snapshots and
state transfer read it as they read torch's.

Why not ``torch.optim.Adam``: a torch optimizer's constructor, ``step`` and ``zero_grad``
each import ``torch._dynamo`` on first use (``torch._disable_dynamo``, and ``step``'s
``_use_grad_for_differentiable``). That import is 822 modules, about 1.8 s of CPU, in every
daemon, on the compute thread (holding the GIL while the event loop answers its first pings),
at the moment a swarm's nodes start together: a 4-node swarm on two cores was ready in
11.0 s with it and 8.6 s without (medians of three, ``bench.ab``; ``bench/README.md``). A
volunteer's node has no use for the compiler; this class is what remains of Adam without it.

Owns the moments and the step count of each parameter. Does not own the learning-rate
schedule, clipping, or when a step is taken (``node.stage.runner``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.autograd.profiler import record_function


class Adam:
    """Adam over one group of parameters; ``param_groups[0]["lr"]`` is read at each step."""

    def __init__(
        self, params: Iterable[torch.Tensor], lr: float, betas: tuple[float, float], eps: float
    ) -> None:
        if not (lr >= 0.0 and eps >= 0.0 and all(0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"Adam: lr {lr}, betas {betas}, eps {eps} out of range")
        self.param_groups: list[dict[str, Any]] = [
            {"params": list(params), "lr": lr, "betas": tuple(betas), "eps": eps}
        ]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self._pre_hooks: list[Callable[[Adam], None]] = []

    def register_step_pre_hook(self, hook: Callable[[Adam], None]) -> None:
        """Call ``hook(self)`` before each step (the tests count steps with it)."""
        self._pre_hooks.append(hook)

    @torch.no_grad()
    def step(self) -> None:
        """One Adam step on every parameter that has a gradient (annotated as torch's, for
        ``node.stage.opprofile``)."""
        for hook in self._pre_hooks:
            hook(self)
        group = self.param_groups[0]
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        with record_function("Optimizer.step#Adam.step"):
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state.get(p)
                if not state:
                    state = self.state[p] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    }
                state["step"] += 1
                t = state["step"].item()
                grad, m, v = p.grad, state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step_size = lr / (1 - beta1**t)
                denom = (v.sqrt() / (1 - beta2**t) ** 0.5).add_(eps)
                p.addcdiv_(m, denom, value=-step_size)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients (``set_to_none``, as torch's default) or zero them."""
        with record_function("Optimizer.zero_grad#Adam.zero_grad"):
            for p in self.param_groups[0]["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()
