"""Update staleness with microbatches in flight, and PipeDream-2BW's bound on it (issue 20).

With several microbatches in flight every microbatch that comes back may be an inner step,
so a gradient is applied up to ``in_flight - 1`` inner steps after its forward (weight
stashing keeps each backward consistent with its own forward, PipeDream, arXiv 1806.03377,
section 3.3, but not the update fresh). ``train.staleness = "2bw"`` takes an inner step
only once at least ``in_flight`` microbatches are in (PipeDream-2BW, arXiv 2006.09503), so
at most one inner step falls between a forward and its backward; its steps are coarser, the
schedules per token unchanged (``node.stage.runner``).

Owns the comparison, in the one-process emulation (``bench.convergence_sim``: the daemon's
own runners, the staleness reproduced deterministically), at equal tokens and on the live
check's configuration (NoLoCo, H = 10, 2 replicas per stage, 8 samples per microbatch):

- ``sync``: one microbatch in flight, an inner step per microbatch;
- ``stash``: ``in_flight`` microbatches in flight, an inner step per microbatch (today);
- ``2bw``: ``in_flight`` in flight, an inner step per ``in_flight`` microbatches;
- ``sync_2bw_steps``: one in flight with 2bw's coarse inner steps, the control that tells
  what 2bw costs through its larger batch per step from what it saves in staleness;
- ``2bw_lr``: 2bw with the learning rate times ``sqrt(k)`` for its ``k`` times larger batch
  per step (the square-root scaling rule for Adam, Malladi et al. 2022, arXiv 2205.10287);
- ``predict``: ``stash`` with ``train.predict_weights``: each block stage's training
  forward runs on its weights extrapolated by the last inner step's move times its measured
  delay (SpecTrain's weight prediction, ``node.stage.predict``);
- ``sync_ahead``: ``sync`` with the same extrapolation by the delay ``stash`` has
  (``train.predict_steps``, ``in_flight - 1`` microbatches in steps), the control that tells
  whether ``predict`` buys back what staleness costs or what extrapolating buys anyway.

Reports, per budget and seed, the final eval loss, the worst eval loss from the peak
learning rate on, and the largest rise of the eval loss above its best so far (the bump
the peak learning rate causes in the stale runs). Does not own the emulation or the
runner. Results: ``results/staleness.json`` and ``.png``.

Budgets: the quick one with the live check's schedule (120k tokens, ``total_steps`` 61: the
warm-up, then at once the floor, as ``bench/convergence.py --quick --check`` has it), the
same tokens with the cosine over the budget, and a longer budget (480k).

``--daemon-sizes``: the daemon's own microbatch and step sizes instead of the live check's
(16 x 128 tokens per microbatch, 32 samples per inner step: two microbatches a step, so six
in flight put a gradient at most about three inner steps late under ``stash``, and ``2bw``
steps every 96 samples, three units); ``2bw_lr`` scales by the square root of its ``k``.

Usage: ``python -m bench.staleness [--budgets 120000:61,120000,480000] [--seeds 0,1]
[--in-flight 6] [--daemon-sizes] [--name staleness]`` (about 15 minutes on two cores);
``--quick``: the seconds-long smoke run the tests use.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench import add_output_args, add_set_arg
from bench.convergence import SETTINGS
from bench.convergence_sim import Curve, simulate
from node.config import TrainConfig, parse_sets, resolve_config
from node.data.dataset import DataConfig
from node.stage.runner import staleness_units

REPLICAS = 2
"""Replicas per stage by default (``--replicas``): the live check's configuration. With two
a NoLoCo pair is the whole stage; with an odd number one replica steps alone each round."""
VARIANTS = ("sync", "stash", "2bw", "sync_2bw_steps", "2bw_lr", "predict", "sync_ahead")
STALE = frozenset({"stash", "2bw", "2bw_lr", "predict"})
"""Variants with ``in_flight`` microbatches in flight; the others keep one."""
TWO_BW = frozenset({"2bw", "sync_2bw_steps", "2bw_lr"})
"""Variants on ``train.staleness = 2bw``'s coarse steps; the others step as ``stash``."""
DAEMON_SIZES = {
    "data.batch_size": str(DataConfig.batch_size),
    "data.seq_len": str(DataConfig.seq_len),
    "train.step_samples": str(TrainConfig.step_samples),
}
"""The daemon's defaults (16 x 128 tokens a microbatch, 32 samples an inner step)."""


def log(msg: str) -> None:
    print(f"[staleness {time.strftime('%X')}] {msg}", file=sys.stderr, flush=True)


def tokens_per_step(s: dict[str, str], replicas: int = REPLICAS) -> int:
    """Tokens of one inner step (one unit of ``step_samples``) on all of a stage's replicas."""
    return int(s["train.step_samples"]) * int(s["data.seq_len"]) * replicas


def settings(
    tokens: int,
    total_steps: int,
    staleness: str,
    outer_steps: int,
    extra: dict[str, str] | None = None,
    replicas: int = REPLICAS,
) -> dict[str, str]:
    """The live check's settings, with ``extra`` over them (``DAEMON_SIZES``, ``--set``);
    ``total_steps`` 0: the cosine spans the budget, as in the study (the live check's own,
    61, is the warm-up and then at once the floor)."""
    base = {**SETTINGS, **(extra or {})}
    warmup = int(base["train.warmup_steps"])
    total_steps = total_steps or max(tokens // tokens_per_step(base, replicas), warmup + 1)
    return {
        **base,
        "swarm.model": "tiny",
        "sync.method": "noloco",
        "sync.outer_steps": str(outer_steps),
        "train.total_steps": str(total_steps),
        "train.staleness": staleness,
        "node.threads": "1",
    }


def units_per_2bw_step(s: dict[str, str], in_flight: int) -> int:
    """Units of ``step_samples`` in one 2bw inner step with ``in_flight`` in flight."""
    two_bw = {**s, "train.staleness": "2bw", "train.max_in_flight": str(in_flight)}
    return staleness_units(resolve_config(overrides=two_bw))


def stash_delay(s: dict[str, str], in_flight: int) -> float:
    """Inner steps a gradient lands after its forward under ``stash`` with ``in_flight`` in
    flight: the ``in_flight - 1`` microbatches between, in steps of ``step_samples``."""
    per_step = int(s["train.step_samples"]) / int(s["data.batch_size"])
    return (in_flight - 1) / per_step


def peak_tokens(s: dict[str, str], replicas: int = REPLICAS) -> int:
    """Tokens (all heads) at the end of the warm-up: the peak learning rate."""
    return int(s["train.warmup_steps"]) * tokens_per_step(s, replicas)


def run(
    variant: str,
    tokens: int,
    total_steps: int,
    seed: int,
    in_flight: int,
    outer_steps: int,
    extra: dict[str, str] | None = None,
    num_evals: int = 20,
    replicas: int = REPLICAS,
) -> Curve:
    staleness = "2bw" if variant in TWO_BW else "stash"
    s = settings(tokens, total_steps, staleness, outer_steps, extra, replicas)
    if variant in ("predict", "sync_ahead"):
        s["train.predict_weights"] = "true"
    if variant == "sync_ahead":
        s["train.predict_steps"] = str(stash_delay(s, in_flight))
    if variant == "2bw_lr":  # Adam's square-root rule for a batch k times larger
        s["train.lr"] = str(TrainConfig.lr * math.sqrt(units_per_2bw_step(s, in_flight)))
    flight = in_flight if variant in STALE else 1
    window = in_flight if variant == "sync_2bw_steps" else 0
    config = resolve_config(overrides=s)
    milestones = [0, *(tokens * (i + 1) // num_evals for i in range(num_evals))]
    t0 = time.monotonic()
    curve = simulate(
        config, replicas, seed, tokens, milestones=milestones, in_flight=flight, window=window
    )
    log(
        f"{tokens:>9,} tokens (T {s['train.total_steps']}) seed {seed} {variant:>14}: "
        f"final {curve.eval_loss[-1]:.3f}, worst from the peak "
        f"{worst_after(curve, peak_tokens(s, replicas)):.3f}, "
        f"largest rise {largest_rise(curve):.3f}, {curve.inner_steps} step units "
        f"({time.monotonic() - t0:.0f} s)"
    )
    return curve


def largest_rise(curve: Curve) -> float:
    """The largest rise of the eval loss above its lowest value so far (0: never rose)."""
    best, rise = math.inf, 0.0
    for loss in curve.eval_loss:
        rise, best = max(rise, loss - best), min(best, loss)
    return rise


def worst_after(curve: Curve, tokens: int) -> float:
    """The highest eval loss at ``tokens`` or later (the last point's when none is)."""
    after = [x for t, x in zip(curve.tokens, curve.eval_loss, strict=True) if t >= tokens]
    return max(after, default=curve.eval_loss[-1])


def summarise(runs: dict[str, dict[str, Any]], peak: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for variant, by_seed in runs.items():
        finals = [c["eval_loss"][-1] for c in by_seed.values()]
        curves = [Curve(**c) for c in by_seed.values()]
        worsts = [worst_after(c, peak) for c in curves]
        rises = [largest_rise(c) for c in curves]
        out[variant] = {
            "final_eval_loss": dict(zip(by_seed, finals, strict=True)),
            "final_eval_loss_mean": sum(finals) / len(finals),
            "worst_eval_loss_from_peak_lr": dict(zip(by_seed, worsts, strict=True)),
            "worst_eval_loss_from_peak_lr_mean": sum(worsts) / len(worsts),
            "largest_rise": dict(zip(by_seed, rises, strict=True)),
        }
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = result["budgets"]
    fig, axes = plt.subplots(1, len(budgets), figsize=(6 * len(budgets), 4.5), squeeze=False)
    styles = {
        "sync": "-",
        "stash": "--",
        "2bw": "-.",
        "sync_2bw_steps": ":",
        "2bw_lr": "-",
        "predict": (0, (5, 1, 1, 1)),
        "sync_ahead": (0, (1, 1)),
    }
    for ax, (name, b) in zip(axes[0], budgets.items(), strict=True):
        for i, variant in enumerate(VARIANTS):
            for j, c in enumerate(b["runs"].get(variant, {}).values()):
                kw = {"label": variant} if j == 0 else {}
                ax.plot(
                    [t / 1e3 for t in c["tokens"]],
                    c["eval_loss"],
                    linestyle=styles[variant],
                    color=f"C{i}",
                    lw=1,
                    **kw,
                )
        ax.axvline(b["peak_lr_tokens"] / 1e3, color="grey", lw=0.5)
        ax.set_title(f"{name}, {result['in_flight']} in flight (emulated)", fontsize=9)
        ax.set_xlabel("tokens (thousands); grey: peak learning rate")
        ax.set_ylabel("eval loss")
        ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--budgets",
        default="120000:61,120000,480000",
        help="comma-separated TOKENS[:TOTAL_STEPS] (no total: the cosine spans the budget)",
    )
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--in-flight", type=int, default=6, help="microbatches in flight per head")
    p.add_argument("--outer-steps", type=int, default=10, help="H (the live check's)")
    p.add_argument(
        "--replicas",
        type=int,
        default=REPLICAS,
        help="replicas per stage (odd: one steps alone each round)",
    )
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument(
        "--daemon-sizes",
        action="store_true",
        help="the daemon's microbatch (16 x 128 tokens) and step (32 samples) sizes",
    )
    add_set_arg(p, "a setting for every variant's runners (repeatable)")
    add_output_args(p, "staleness")
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 20k tokens, seed 0, 3 in flight"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.budgets, args.seeds, args.in_flight = "20000", "0", 3
    args.budgets = [
        (int(t), int(total or 0))
        for t, _, total in (b.partition(":") for b in args.budgets.split(","))
    ]
    args.seeds = [int(s) for s in str(args.seeds).split(",")]
    args.variants = str(args.variants).split(",")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    sets = parse_sets(args.set)
    extra = {**(DAEMON_SIZES if args.daemon_sizes else {}), **sets}
    num_evals = 4 if args.quick else 20
    stem = args.name or "staleness"  # may hold a dot (b1_0.5): no with_suffix
    result: dict[str, Any] = {
        "in_flight": args.in_flight,
        "sizes": "daemon" if args.daemon_sizes else "live check",
        "sets": sets,
        "replicas_per_stage": args.replicas,
        "outer_steps": args.outer_steps,
        "seeds": args.seeds,
        "budgets": {},
    }
    for tokens, total_steps in args.budgets:
        s = settings(tokens, total_steps, "<variant>", args.outer_steps, extra, args.replicas)
        runs: dict[str, dict[str, Any]] = {}
        for variant in args.variants:
            runs[variant] = {
                str(seed): asdict(
                    run(
                        variant,
                        tokens,
                        total_steps,
                        seed,
                        args.in_flight,
                        args.outer_steps,
                        extra,
                        num_evals,
                        args.replicas,
                    )
                )
                for seed in args.seeds
            }
        name = f"{tokens:,} tokens, total_steps {s['train.total_steps']}"
        result["budgets"][name] = {
            "tokens": tokens,
            "settings": s,
            "units_per_2bw_step": units_per_2bw_step(s, args.in_flight),
            "stash_delay_steps": stash_delay(s, args.in_flight),
            "peak_lr_tokens": peak_tokens(s, args.replicas),
            "summary": summarise(runs, peak_tokens(s, args.replicas)),
            "runs": runs,
        }
        args.out.mkdir(parents=True, exist_ok=True)  # written after each budget
        (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
        if not args.no_plot:
            plot(result, args.out / f"{stem}.png")
    return result


if __name__ == "__main__":
    main()
