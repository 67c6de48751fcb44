"""Swarm throughput with heterogeneous nodes under three placement policies.

The swarm: one head node and six block-stage nodes over 3 block stages, on 127.0.0.1. Two
nodes are fast and four are slow: every forward sleeps ``--fast-delay`` or ``--slow-delay``
seconds (as a slower machine would take longer), so the nodes' service rates differ by
about 4x whatever the shared CPU does. Three policies place the same six nodes, started in
the same order, one after another:

- ``fixed``: an even assignment an operator might write by hand, round-robin over the
  stages (``--stage 1, 2, 3, 1, 2, 3``);
- ``fewest_replicas``: ``--stage auto`` with ``balance.policy = "replicas"``;
- ``throughput``: ``--stage auto`` with the default throughput policy and rebalancing.

After ``--settle`` seconds (rebalancing time) the head's tokens are counted for
``--measure`` seconds. The ideal is the best placement of the same six nodes, found by
trying every assignment: the largest possible bottleneck (slowest block stage's total
samples/s) times the sequence length. A node's capacity for it is a benchmark of one block
stage in the benchmark's own process just before each run, slowed by the node's delay per
forward, taken as the median over the runs, so all policies share one ideal.
Each policy's ``ratio_to_ideal`` divides its measured tokens/s by that ideal. The service
rates the nodes published at the end are recorded beside it; they read lower than the
capacity (they also count recomputed stale forwards and forwards whose backward never came).

Writes ``bench/results/balance.json`` and ``balance.png``.
Usage: ``python -m bench.balance [--settle 60] [--measure 60]``; ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from node.client import fetch_status
from node.config import resolve_config
from node.demo import LocalSwarm, wait_ready
from node.stage.speed import measure_block_rate

RESULTS = Path(__file__).parent / "results"
POLICIES = ["fixed", "fewest_replicas", "throughput"]
NUM_BLOCK_STAGES = 3
COMMON = {
    "node.join_wait_s": "1.0",
    "membership.ttl_s": "4",
    "train.eval_interval_s": "0",
    "train.max_in_flight": "12",
    "train.window": "fixed",  # a steady load on the stages, as in its recorded runs
    "data.batch_size": "8",
    "data.seq_len": "64",
    "sync.method": "none",
    "balance.interval_s": "3",
    "balance.cooldown_s": "10",
    "balance.warmup_s": "10",
    "balance.benchmark_s": "0.3",
}


def best_bottleneck(rates: list[float], num_stages: int) -> float:
    """The largest slowest-stage total over every assignment of nodes to stages (none empty)."""
    best = 0.0
    for assignment in itertools.product(range(num_stages), repeat=len(rates)):
        totals = [0.0] * num_stages
        for node, stage in enumerate(assignment):
            totals[stage] += rates[node]
        best = max(best, min(totals))
    return best


def log(msg: str) -> None:
    print(f"[balance {time.strftime('%X')}] {msg}", file=sys.stderr, flush=True)


def run(
    policy: str, delays: list[float], args: argparse.Namespace, log_dir: Path
) -> dict[str, Any]:
    settings = dict(COMMON)
    settings["balance.policy"] = "replicas" if policy == "fewest_replicas" else "throughput"
    config = resolve_config(overrides=COMMON)
    bench = measure_block_rate(config, 2.0)  # this machine now, one thread like each node
    log(f"{policy}: one block stage runs {bench:.1f} samples/s here undelayed")
    s = LocalSwarm(log_dir, settings)
    try:
        head = s.start_node(0)
        wait_ready(head, 120, s)
        nodes = []
        for i, delay in enumerate(delays):
            stage: int | str = i % NUM_BLOCK_STAGES + 1 if policy == "fixed" else "auto"
            a = s.start_node(stage, extra=["--set", f"train.compute_delay_s={delay}"])
            wait_ready(a, 120, s)
            nodes.append(a)
        log(f"{policy}: swarm up; settling for {args.settle:.0f}s")
        time.sleep(args.settle)
        t0, tok0 = time.monotonic(), fetch_status(head)["tokens"]
        time.sleep(args.measure)
        t1, tok1 = time.monotonic(), fetch_status(head)["tokens"]
        batch = int(COMMON["data.batch_size"])
        placed = []
        for a, delay in zip(nodes, delays, strict=True):
            st = fetch_status(a, timeout_s=10)
            placed.append(
                {
                    "delay_s": delay,
                    "stage": st["stage"],
                    "estimate_samples_per_s": round(batch / (batch / bench + delay), 2),
                    "published_samples_per_s": round(st["throughput"], 2),
                    "moves": st["balance"]["moves"],
                }
            )
        totals = {
            str(k): round(sum(p["estimate_samples_per_s"] for p in placed if p["stage"] == k), 2)
            for k in range(1, NUM_BLOCK_STAGES + 1)
        }
        tokens_per_s = (tok1 - tok0) / (t1 - t0)
        out = {
            "tokens_per_s": round(tokens_per_s, 1),
            "stage_samples_per_s": totals,
            "nodes": placed,
        }
        log(f"{policy}: {out['tokens_per_s']} tokens/s, estimated samples/s per stage {totals}")
        return out
    finally:
        s.stop(grace_s=5)


def add_ideal(policies: dict[str, dict[str, Any]], delays: list[float]) -> float:
    """One ideal for every policy (tokens/s): the best placement of the six nodes with each
    kind's median estimated capacity over all runs. Sets ``ratio_to_ideal`` in place."""
    by_delay: dict[float, list[float]] = {}
    for run_ in policies.values():
        for n in run_["nodes"]:
            by_delay.setdefault(n["delay_s"], []).append(n["estimate_samples_per_s"])
    rates = [statistics.median(by_delay[d]) for d in delays]
    ideal = best_bottleneck(rates, NUM_BLOCK_STAGES) * int(COMMON["data.seq_len"])
    for run_ in policies.values():
        run_["ideal_tokens_per_s"] = round(ideal, 1)
        run_["ratio_to_ideal"] = round(run_["tokens_per_s"] / ideal, 3) if ideal else None
    return ideal


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["policies"])
    got = [result["policies"][n]["tokens_per_s"] for n in names]
    ideal = result["policies"][names[0]]["ideal_tokens_per_s"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    xs = list(range(len(names)))
    ax.bar(xs, got, width=0.6, color=["#999999", "#6a9fd4", "#2b6cb0"][: len(names)])
    ax.axhline(ideal, color="black", linestyle="--", linewidth=1, label="ideal placement")
    for x, n in zip(xs, names, strict=True):
        r = result["policies"][n]["ratio_to_ideal"]
        ax.text(x, got[x], f"{r:.2f} of ideal", ha="center", va="bottom")
    ax.set_xticks(xs, [n.replace("_", " ") for n in names])
    ax.set_ylabel("swarm tokens / s")
    ax.set_title("2 fast + 4 slow nodes on 3 block stages")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--settle", type=float, default=60.0, help="seconds before measuring")
    p.add_argument("--measure", type=float, default=60.0, help="seconds of measurement")
    p.add_argument("--fast-delay", type=float, default=0.1, help="fast nodes' delay per forward")
    p.add_argument("--slow-delay", type=float, default=0.55, help="slow nodes' delay per forward")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset")
    p.add_argument("--out", type=Path, default=RESULTS / "balance.json")
    p.add_argument("--quick", action="store_true", help="a short smoke run (tests)")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.settle, args.measure = 5.0, 5.0
    delays = [args.fast_delay] * 2 + [args.slow_delay] * 4
    result: dict[str, Any] = {
        "setup": {
            "block_stages": NUM_BLOCK_STAGES,
            "delays_s": delays,
            "settle_s": args.settle,
            "measure_s": args.measure,
            "settings": COMMON,
        },
        "policies": {},
    }
    with tempfile.TemporaryDirectory(prefix="murmur-balance-") as tmp:
        for policy in args.policies.split(","):
            if policy not in POLICIES:
                p.error(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
            log_dir = Path(tmp) / policy
            log_dir.mkdir()
            result["policies"][policy] = run(policy, delays, args, log_dir)
    ideal = add_ideal(result["policies"], delays)
    for name, run_ in result["policies"].items():
        log(
            f"{name}: {run_['tokens_per_s']} tokens/s = {run_['ratio_to_ideal']} of ideal {ideal:.0f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {args.out}")
    if not args.no_plot:
        plot(result, args.out.with_suffix(".png"))
        log(f"wrote {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
