"""Where subnormal floats appear in training, and what flushing them buys at a trained state.

``bench/denormal.py`` showed the demo's step rate falling by a third over four minutes with
``node.flush_denormal`` off and not with it on. This finds where the subnormals are. The
swarm is the one-process emulation (``bench/convergence_sim.py``: the daemon's runners and
model code), by default in ``make demo``'s shape (a head and three block stages, one replica
each, the daemon's defaults, six microbatches in flight per head). It trains with the flush
off, timing every ``--every`` global steps, then:

1. **Census**: a few more global steps (and as many again as are in flight, so that their
   backwards run too) with hooks that count the subnormal values (nonzero,
   below fp32's smallest normal, about 1.2e-38) in every leaf module's output, in the
   gradients at every leaf module's output and input, in every parameter's gradient, and
   inside attention: for the census steps ``scaled_dot_product_attention`` is computed
   written out (the same maths: scores, causal mask, softmax, weighted sum), so its softmax
   probabilities and their gradient are seen too. Then the parameters and Adam's moments.
2. **Flush, off against on, at the trained state**: the same further global steps timed
   with the flag off and on, alternating in short blocks (the machine is noisy), from the
   same weights. Their ratio is what the flush buys at that state.

Writes ``bench/results/subnormals.json``.
Usage: ``python -m bench.subnormals [--steps 1600] [--set section.field=value ...]``;
``--quick`` for the tests' seconds-long version.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from bench import add_output_args, add_set_arg, save
from bench.convergence_sim import SimulatedSwarm
from node.config import parse_sets, resolve_config

TINY = torch.finfo(torch.float32).tiny
"""fp32's smallest normal value: nonzero values below it are subnormal."""


def log(msg: str) -> None:
    print(f"[subnormals {time.strftime('%X')}] {msg}", file=sys.stderr, flush=True)


def subnormal_count(t: Any) -> tuple[int, int]:
    """Subnormal values in ``t`` and its size (0, 0 for anything but a float tensor)."""
    if not isinstance(t, Tensor) or not t.is_floating_point() or t.numel() == 0:
        return 0, 0
    t = t.detach().float()
    return int(((t != 0) & (t.abs() < TINY)).sum()), t.numel()


class Census:
    """Subnormal values and sizes seen, by place (``"s1 fwd Linear"`` and the like)."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])

    def add(self, place: str, value: Any) -> None:
        for t in value if isinstance(value, tuple | list) else (value,):
            found, size = subnormal_count(t)
            if size:
                self.counts[place][0] += found
                self.counts[place][1] += size

    def table(self) -> dict[str, dict[str, float]]:
        return {
            place: {"subnormal": found, "values": size, "share": found / size}
            for place, (found, size) in sorted(self.counts.items())
        }


def written_out_attention(census: Census, place: str) -> Callable[..., Tensor]:
    """``F.scaled_dot_product_attention`` as its formula, counting subnormals in the softmax
    probabilities and their gradient (the fused kernel hides both)."""

    def attend(
        q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False
    ) -> Tensor:
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        if is_causal:
            n, m = scores.shape[-2:]
            attn_mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        probs = scores.softmax(-1)
        census.add(f"{place} attention probabilities", probs)
        if probs.requires_grad:
            probs.register_hook(lambda g: census.add(f"{place} attention probabilities grad", g))
        return probs @ v

    return attend


def _grads_hook(census: Census, place: str) -> Callable[..., None]:
    def hook(module: Any, grad_input: Any, grad_output: Any) -> None:
        census.add(f"{place} output grad", grad_output)
        census.add(f"{place} input grad", grad_input)

    return hook


@contextlib.contextmanager
def watched(swarm: SimulatedSwarm, census: Census) -> Iterator[None]:
    """Hooks on every runner's modules and parameters, and attention written out."""
    handles: list[Any] = []
    for stage, row in enumerate(swarm.runners):
        for runner in row:
            for module in runner.module.modules():
                if any(True for _ in module.children()):
                    continue
                place = f"s{stage} {type(module).__name__}"
                handles.append(
                    module.register_forward_hook(
                        lambda m, i, o, p=place: census.add(f"{p} output", o)
                    )
                )
                handles.append(module.register_full_backward_hook(_grads_hook(census, place)))
            for name, param in runner.module.named_parameters():
                place = f"s{stage} grad {name.rsplit('.', 2)[-2] if '.' in name else name}"
                handles.append(param.register_hook(lambda g, p=place: census.add(p, g)))
    fused = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = written_out_attention(census, "blocks")  # type: ignore[assignment]
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Full backward hook is firing")  # a block's input
            yield
    finally:
        F.scaled_dot_product_attention = fused
        for h in handles:
            h.remove()


def state_census(swarm: SimulatedSwarm) -> dict[str, dict[str, float]]:
    """Subnormals in the parameters and in Adam's moments, by stage."""
    census = Census()
    for stage, row in enumerate(swarm.runners):
        for runner in row:
            for param in runner.module.parameters():
                census.add(f"s{stage} parameters", param)
                state = runner.optimizer.state.get(param, {})
                for key in ("exp_avg", "exp_avg_sq"):
                    census.add(f"s{stage} adam {key}", state.get(key))
    return census.table()


def timed(swarm: SimulatedSwarm, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        swarm.global_step()
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = {
        "swarm.num_block_stages": str(args.block_stages),
        "node.threads": str(args.threads),
        "node.flush_denormal": "false",
        **args.sets,
    }
    swarm = SimulatedSwarm(resolve_config(overrides=settings), args.replicas, 0, args.in_flight)
    torch.set_flush_denormal(False)
    log(f"training {args.steps} global steps with the flush off")
    per_block: list[float] = []
    for done in range(0, args.steps, args.every):
        per_block.append(timed(swarm, min(args.every, args.steps - done)))
        log(f"{done + args.every} steps, {per_block[-1]:.1f} s for the last {args.every}")
    census = Census()
    with watched(swarm, census):  # and the steps whose backwards finish them
        for _ in range(args.census_steps + args.in_flight):
            swarm.global_step()
    log("census done; timing the flush off and on at this state")
    off: list[float] = []
    on: list[float] = []
    try:
        for _ in range(args.ab_repeats):
            for flag, times in ((False, off), (True, on)):
                torch.set_flush_denormal(flag)
                times.append(timed(swarm, args.ab_steps))
    finally:
        torch.set_flush_denormal(False)
    return {
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "config": settings,
        "eval_loss": swarm.evaluate(),
        "seconds_per_block": per_block,
        "census": census.table(),
        "state": state_census(swarm),
        "flush_off_s": off,
        "flush_on_s": on,
        "off_over_on": statistics.median(off) / statistics.median(on),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1600, help="global steps trained first")
    p.add_argument("--every", type=int, default=100, help="global steps per timed block")
    p.add_argument("--census-steps", type=int, default=4, help="global steps with hooks")
    p.add_argument("--ab-steps", type=int, default=20, help="global steps per timed A/B block")
    p.add_argument("--ab-repeats", type=int, default=3, help="A/B blocks of each")
    p.add_argument("--block-stages", type=int, default=3)
    p.add_argument("--replicas", type=int, default=1, help="replicas per stage")
    p.add_argument("--in-flight", type=int, default=6, help="microbatches in flight per head")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    add_set_arg(p, "a setting over the benchmark's", "sets")
    p.add_argument("--quick", action="store_true", help="seconds: the tests' version")
    add_output_args(p, "subnormals")
    args = p.parse_args(argv)
    args.sets = parse_sets(args.sets)
    if args.quick:
        args.steps, args.every, args.census_steps, args.ab_steps, args.ab_repeats = 4, 2, 1, 1, 1
        args.block_stages, args.in_flight = 1, 1
        args.sets = {"data.batch_size": "2", "data.seq_len": "16", **args.sets}
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = run(args)
    found = {p: c for p, c in {**result["census"], **result["state"]}.items() if c["subnormal"]}
    for place, c in sorted(found.items(), key=lambda pc: -pc[1]["subnormal"]):
        log(f"{place}: {c['subnormal']:,} of {c['values']:,} ({c['share']:.2e})")
    log(f"flush off over on at this state: {result['off_over_on']:.2f}x the time")
    save(result, args.out, args.name or ("subnormals-quick" if args.quick else "subnormals"), None)
    return result


if __name__ == "__main__":
    main()
