"""Convergence of the synchronisation methods, in a study that can tell them apart.

NoLoCo against DiLoCo, data parallel (``allreduce``) and independent replicas (``none``),
with ``--replicas`` (4) replicas of every stage so that a random pair is not the whole stage
(with two, NoLoCo's pull term is zero and it is just another outer optimizer), NoLoCo's
default H = 50, the same tokens and the same global batch per optimizer step for every
method, and several seeds. So many runs of so many tokens need the fast path: the whole
swarm in one process (``bench/convergence_sim.py``: the daemon's own stage runners and outer
steps, without sockets). Its figures stand for the live swarm because of the check below.

The study counts only if independent replicas end clearly worse than data parallel (at least
``--min-gap``, 3 %): otherwise the budget is too short for drift to matter and lengthening it
is the answer. Targets, as the NoLoCo paper reports: NoLoCo within 2 % of data parallel, and
no worse than DiLoCo.

**Check against the live swarm** (``--check``): the same configuration at small N, as real
``node join`` processes on 127.0.0.1 (2 head nodes with data shards 0 and 1, 2 block stages
with 2 replicas each, ``--check-in-flight`` microbatches in flight per head: the daemon's
default), against the simulation of 2 replicas per stage with the same seed, evaluated at the
live swarm's token counts; the noise it is judged by is how far two simulated seeds differ.

Writes ``bench/results/convergence.json`` (``replicas_per_stage``; ``methods``: per method
``final_eval_loss_mean``, per seed, and the curves; ``live_check``) and ``convergence.png``.
Usage: ``python -m bench.convergence [--tokens N] [--seeds 0,1,2] [--replicas 4]
[--check] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bench import add_set_arg
from bench.convergence_sim import Curve, simulate
from node.client import fetch_status, request_eval
from node.config import TrainConfig, parse_sets, resolve_config
from node.demo import LocalSwarm, wait_ready
from node.stage.export import fetch_stage_state

RESULTS = Path(__file__).parent / "results"
METHODS = ("noloco", "diloco", "allreduce", "none")
SETTINGS = {
    "swarm.num_block_stages": "2",
    "sync.outer_steps": "50",
    "sync.schedule": "steps",
    "data.batch_size": "8",
    "data.seq_len": "64",
    "train.step_samples": "8",
    "train.eval_batches": "8",
    "train.warmup_steps": "60",
}
"""One microbatch of 8 x 64 tokens per inner step: many inner steps per token, so that a
budget of a few million tokens holds dozens of outer rounds at H = 50."""


def log(msg: str) -> None:
    print(f"[convergence {time.strftime('%X')}] {msg}", file=sys.stderr, flush=True)


def study_settings(args: argparse.Namespace, method: str) -> dict[str, str]:
    tokens_per_step = int(SETTINGS["data.batch_size"]) * int(SETTINGS["data.seq_len"])
    steps = args.tokens // (tokens_per_step * args.replicas)
    return {
        **SETTINGS,
        "swarm.model": args.model,
        "sync.method": method,
        "sync.outer_steps": str(args.outer_steps),
        "train.total_steps": str(max(steps, int(SETTINGS["train.warmup_steps"]) + 1)),
        "node.threads": str(args.threads),
        **args.sets,
    }


def run_study(args: argparse.Namespace) -> dict[str, Any]:
    methods: dict[str, Any] = {}
    for method in args.methods.split(","):
        config = resolve_config(overrides=study_settings(args, method))
        curves = []
        for seed in args.seeds:
            log(
                f"{method}, seed {seed}: {args.replicas} replicas per stage, {args.tokens:,} tokens"
            )
            curve = simulate(config, args.replicas, seed, args.tokens, progress=_progress)
            curves.append(curve)
        finals = [c.eval_loss[-1] for c in curves]
        methods[method] = {
            "final_eval_loss_mean": statistics.mean(finals),
            "final_eval_loss": finals,
            "final_spread_mean": statistics.mean(c.spread[-1] for c in curves),
            "outer_rounds": curves[0].outer_rounds,
            "inner_steps": curves[0].inner_steps,
            "curves": [asdict(c) for c in curves],
        }
    return methods


def _progress(p: dict[str, Any]) -> None:
    log(
        f"  {p['method']} seed {p['seed']}: {p['tokens']:>10,} tokens  eval {p['eval_loss']:.4f}"
        f"  spread {p['spread']:.2e}"
    )


def verdict(methods: dict[str, Any], min_gap: float) -> dict[str, Any]:
    final = {m: r["final_eval_loss_mean"] for m, r in methods.items()}
    out: dict[str, Any] = {}
    if {"none", "allreduce"} <= final.keys():
        out["none_vs_allreduce"] = final["none"] / final["allreduce"] - 1
        out["study_counts"] = out["none_vs_allreduce"] >= min_gap
    if {"noloco", "allreduce"} <= final.keys():
        out["noloco_vs_allreduce"] = final["noloco"] / final["allreduce"] - 1
        out["noloco_within_2pct_of_allreduce"] = abs(out["noloco_vs_allreduce"]) <= 0.02
    if {"noloco", "diloco"} <= final.keys():
        out["noloco_vs_diloco"] = final["noloco"] / final["diloco"] - 1
        out["noloco_no_worse_than_diloco"] = out["noloco_vs_diloco"] <= 0
    return out


# ---- the check against the live swarm ---------------------------------------------------


def live_weights(address: str, stage: int) -> torch.Tensor:
    state = fetch_stage_state(address, stage)
    params = [
        v.float().flatten() for k, v in sorted(state.tensors.items()) if k.startswith("param.")
    ]
    return torch.cat(params)


def run_live(
    settings: dict[str, str], milestones: list[int], log_dir: Path
) -> tuple[Curve, list[dict[str, int]]]:
    """The configuration as real processes: 2 heads (shards 0 and 1 of 2), 2 block stages x 2
    replicas; the first head evaluates once past each milestone of tokens (both heads
    together). The swarm trains on while it evaluates (about one milestone's worth of tokens
    at the quick budget), so a point's tokens are the mean of the counts before and after
    its evaluation, and the simulation is evaluated at those counts (``run_check``). Also
    returns each block replica's inner steps and outer rounds by outcome (paired, solo, ...)."""
    swarm = LocalSwarm(
        log_dir,
        {
            **settings,
            "data.num_shards": "2",
            "node.join_wait_s": "1.0",
            "train.eval_interval_s": "0",
            "node.threads": "1",
            # the layout stays 2 + 2: no node refills a stage that is empty only because
            # its replicas are still starting
            "recovery.refill_wait_s": "120",
        },
    )
    curve = Curve(settings["sync.method"], int(settings["swarm.seed"]), 2)
    t0 = time.monotonic()
    try:
        heads = [swarm.start_node(0, extra=["--set", f"data.shard={i}"]) for i in range(2)]
        blocks = [swarm.start_node(stage) for stage in (1, 1, 2, 2)]
        for address in heads + blocks:
            wait_ready(address, 120, swarm)
        for milestone in milestones:
            while (done := sum(fetch_status(h)["tokens"] for h in heads)) < milestone:
                if swarm.dead():
                    raise RuntimeError(f"live check: node(s) died: {swarm.dead()}")
                time.sleep(0.2)
            curve.eval_loss.append(request_eval(heads[0]))
            after = sum(fetch_status(h)["tokens"] for h in heads)
            curve.tokens.append((done + after) // 2)
            done = curve.tokens[-1]
            spreads = []
            for stage, pair in ((1, blocks[0:2]), (2, blocks[2:4])):
                a, b = (live_weights(x, stage) for x in pair)
                mean = (a + b) / 2
                spreads.append(float(torch.sqrt((((a - mean) ** 2 + (b - mean) ** 2) / 2).mean())))
            curve.spread.append(statistics.mean(spreads))
            curve.wall_s.append(round(time.monotonic() - t0, 1))
            log(f"  live: {done:>9,} tokens  eval {curve.eval_loss[-1]:.4f}")
        statuses = [fetch_status(address) for address in blocks]
        curve.outer_rounds = statuses[0]["sync"]["outer_steps"]
        curve.inner_steps = statuses[0]["step"]
        rounds = [{"inner_steps": st["step"], **st["sync"].get("rounds", {})} for st in statuses]
        log(f"  live: block replicas' rounds {rounds}")
    finally:
        swarm.stop(grace_s=10)
    return curve, rounds


def run_check(args: argparse.Namespace) -> dict[str, Any]:
    method = "noloco"
    settings = {**study_settings(args, method), "swarm.seed": str(args.seeds[0])}
    settings["sync.outer_steps"] = str(args.check_outer_steps)
    settings["train.max_in_flight"] = str(args.check_in_flight)
    settings["train.window"] = "fixed"  # the simulation keeps exactly that many in flight
    config = resolve_config(overrides=settings)
    num_evals = 10
    milestones = [0, *(args.check_tokens * (i + 1) // num_evals for i in range(num_evals))]
    log(f"live check: real processes, train.max_in_flight={settings['train.max_in_flight']}")
    with tempfile.TemporaryDirectory(prefix="convergence-live-") as tmp:
        live, rounds = run_live(settings, milestones, Path(tmp))
    log(
        f"live check: simulation at the live tokens, 2 replicas per stage, seeds "
        f"{args.seeds[0]} and {args.seeds[0] + 1}"
    )
    sims = [
        simulate(config, 2, s, live.tokens[-1], progress=_progress, milestones=live.tokens)
        for s in (args.seeds[0], args.seeds[0] + 1)
    ]
    stale = None
    if args.check_in_flight > 1:  # the simulation with the live pipeline's staleness
        log(f"live check: simulation with {args.check_in_flight} microbatches in flight per head")
        stale = simulate(
            config,
            2,
            args.seeds[0],
            live.tokens[-1],
            progress=_progress,
            milestones=live.tokens,
            in_flight=args.check_in_flight,
        )

    def gaps(a: Curve, b: Curve) -> list[float]:
        return [abs(x / y - 1) for x, y in zip(a.eval_loss[1:], b.eval_loss[1:], strict=False)]

    live_gap, noise = gaps(live, sims[0]), gaps(sims[1], sims[0])
    return {
        "method": method,
        "outer_steps": args.check_outer_steps,
        "tokens": args.check_tokens,
        "max_in_flight": args.check_in_flight,
        "simulated": asdict(sims[0]),
        "simulated_other_seed": asdict(sims[1]),
        "simulated_in_flight": asdict(stale) if stale else None,
        "live": asdict(live),
        "live_rounds": rounds,
        "live_vs_sim_max_gap": max(live_gap),
        "live_vs_sim_final_gap": live_gap[-1],
        "seed_noise_max_gap": max(noise),
        "seed_noise_final_gap": noise[-1],
        "live_vs_stale_sim_final_gap": gaps(live, stale)[-1] if stale else None,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if result.get("live_check") else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    for method, r in result["methods"].items():
        for i, c in enumerate(r["curves"]):
            kw = {"label": method} if i == 0 else {}
            color = f"C{list(result['methods']).index(method)}"
            axes[0].plot([t / 1e6 for t in c["tokens"]], c["eval_loss"], color=color, lw=1, **kw)
            axes[1].semilogy(
                [t / 1e6 for t in c["tokens"][1:]],
                [max(s, 1e-9) for s in c["spread"][1:]],
                color=color,
                lw=1,
                **kw,
            )
    axes[0].set_title(f"eval loss, {result['replicas_per_stage']} replicas per stage")
    axes[0].set_ylim(top=min(6.0, axes[0].get_ylim()[1]))
    axes[1].set_title("replica spread (RMS from the stage mean, live weights)")
    for ax in axes[:2]:
        ax.set_xlabel("tokens (millions)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    check = result.get("live_check")
    if check:
        keys = ("simulated", "simulated_other_seed", "simulated_in_flight", "live")
        for key, style in zip(keys, ("-", ":", "-.", "--"), strict=True):
            c = check.get(key)
            if not c:
                continue
            axes[2].plot([t / 1e6 for t in c["tokens"]], c["eval_loss"], style, label=key)
        axes[2].set_title("live swarm against the simulation (NoLoCo, 2 per stage)")
        axes[2].set_xlabel("tokens (millions)")
        axes[2].grid(alpha=0.3)
        axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8_000_000, help="tokens per run (all heads)")
    p.add_argument("--replicas", type=int, default=4, help="replicas of every stage")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--model", default="tiny", help="model preset")
    p.add_argument("--outer-steps", type=int, default=50, help="H (NoLoCo's default: 50)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the simulation")
    add_set_arg(
        p, "a setting over the study's (as node join's --set), for a diagnostic run", "sets"
    )
    p.add_argument("--min-gap", type=float, default=0.03, help="independent vs DP gap needed")
    p.add_argument("--check", action="store_true", help="also the check against the live swarm")
    p.add_argument("--check-only", action="store_true", help="only the live check")
    p.add_argument("--check-tokens", type=int, default=1_000_000)
    p.add_argument("--check-outer-steps", type=int, default=10)
    p.add_argument(
        "--check-in-flight",
        type=int,
        default=TrainConfig.max_in_flight,
        help="microbatches each live head keeps in flight (the daemon's default)",
    )
    p.add_argument("--quick", action="store_true", help="seconds: the smoke run the tests use")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--replot", action="store_true")
    args = p.parse_args(argv)
    args.seeds = [int(s) for s in str(args.seeds).split(",")]
    args.sets = parse_sets(args.sets)
    if args.quick:
        args.tokens, args.replicas, args.seeds, args.outer_steps = 60_000, 4, [0], 5
        args.threads = 1  # a test shares the machine: two threads there only spin
        args.check_tokens = 40_000
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    name = "convergence-quick" if args.quick else "convergence"
    result: dict[str, Any]
    if args.replot:
        result = json.loads((args.out / f"{name}.json").read_text())
        plot(result, args.out / f"{name}.png")
        return result
    result = {
        "replicas_per_stage": args.replicas,
        "tokens": args.tokens,
        "seeds": args.seeds,
        "settings": study_settings(args, "<method>"),
        "methods": {},
    }
    if not args.check_only:
        result["methods"] = run_study(args)
        result.update(verdict(result["methods"], args.min_gap))
    if args.check or args.check_only:
        result["live_check"] = run_check(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    if result["methods"]:
        plot(result, args.out / f"{name}.png")
    summary = {m: round(r["final_eval_loss_mean"], 4) for m, r in result["methods"].items()}
    log(f"final eval loss (mean over seeds): {summary}; {verdict(result['methods'], args.min_gap)}")
    return result


if __name__ == "__main__":
    main()
