"""Convergence of the synchronisation methods on a real local swarm, side by side.

Every run is the same swarm (2 head nodes with fixed data shards, 2 block stages with 2
replicas each: 6 ``node join`` processes on 127.0.0.1), the same model, seed and token
budget; only ``sync.method`` (and, for ``noloco_int8``, ``sync.codec``) changes. At every
tenth of the budget the first head node evaluates on the shared held-out split, and the
benchmark records the RMS distance between the two replicas of block stage 1, both of
their live weights (``theta``) and, for NoLoCo, of partners' slow weights at exchange time.

Writes ``bench/results/convergence.json`` and ``convergence.png``.
Usage: ``python -m bench.convergence [--tokens N] [--methods noloco,diloco,...]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from node.client import fetch_status, request_eval
from node.demo import LocalSwarm, wait_ready
from node.stage.export import fetch_stage_state
from swarm.outer import rms_distance

RESULTS = Path(__file__).parent / "results"
METHODS = {
    "noloco": {"sync.method": "noloco"},
    "diloco": {"sync.method": "diloco"},
    "allreduce": {"sync.method": "allreduce"},
    "none": {"sync.method": "none"},
    "noloco_int8": {"sync.method": "noloco", "sync.codec": "int8"},
}
COMMON = {
    "swarm.num_block_stages": "2",
    "node.join_wait_s": "1.0",
    "train.eval_interval_s": "0",
    "train.max_in_flight": "4",
    "sync.outer_steps": "10",
}


def live_weights(address: str, stage: int) -> torch.Tensor:
    state = fetch_stage_state(address, stage)
    params = [
        v.float().flatten() for k, v in sorted(state.tensors.items()) if k.startswith("param.")
    ]
    return torch.cat(params)


def run(name: str, settings: dict[str, str], tokens: int, log_dir: Path) -> dict[str, Any]:
    swarm = LocalSwarm(log_dir / name, {**COMMON, **settings})
    swarm.log_dir.mkdir(parents=True)
    t0 = time.monotonic()
    try:
        heads = [swarm.start_node(0, extra=["--set", f"data.shard={i}"]) for i in range(2)]
        blocks = [swarm.start_node(stage) for stage in (1, 1, 2, 2)]
        for a in heads + blocks:
            wait_ready(a, 120, swarm)
        out: dict[str, Any] = {"tokens": [], "eval_loss": [], "wall_s": [], "theta_spread": []}

        def checkpoint(done: int) -> None:
            out["tokens"].append(done)
            out["eval_loss"].append(request_eval(heads[0]))
            out["wall_s"].append(round(time.monotonic() - t0, 1))
            out["theta_spread"].append(
                rms_distance(live_weights(blocks[0], 1), live_weights(blocks[1], 1))
            )
            print(
                f"  {name}: {done:>8} tokens  eval {out['eval_loss'][-1]:.3f}  "
                f"theta spread {out['theta_spread'][-1]:.2e}",
                flush=True,
            )

        checkpoint(0)
        for milestone in range(tokens // 10, tokens + 1, tokens // 10):
            while (done := sum(fetch_status(h)["tokens"] for h in heads)) < milestone:
                if swarm.dead():
                    raise RuntimeError(f"{name}: node(s) died: {swarm.dead()}")
                time.sleep(1.0)
            checkpoint(done)
        syncs = [fetch_status(b)["sync"] for b in blocks[:2]]
        out["partner_spread"] = sorted(
            (r, d) for s in syncs for r, d in s.get("spread_history", [])
        )
        out["rounds"] = [s["rounds"] for s in syncs]
        out["sync_seconds_mean"] = sum(s["seconds_sum"] for s in syncs) / max(
            1, sum(s["seconds_count"] for s in syncs)
        )
        out["sync_bytes_sent"] = sum(s["bytes_sent"] for s in syncs)
        return out
    finally:
        swarm.stop(grace_s=10)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in result["methods"].items():
        ax1.plot([t / 1e6 for t in r["tokens"]], r["eval_loss"], "-o", ms=3, label=name)
        ax2.semilogy(
            [t / 1e6 for t in r["tokens"][1:]],
            [max(s, 1e-9) for s in r["theta_spread"][1:]],
            "-o",
            ms=3,
            label=name,
        )
    ax1.set_xlabel("tokens (millions)")
    ax1.set_ylabel("eval loss (held-out, nats/byte)")
    ax1.set_title("Convergence at equal token budget")
    ax1.grid(alpha=0.3)
    ax1.legend()
    ax2.set_xlabel("tokens (millions)")
    ax2.set_ylabel("RMS distance, 2 replicas of stage 1 (0 drawn at 1e-9)")
    ax2.set_title("Replica spread (live weights)")
    ax2.grid(alpha=0.3, which="both")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=1_000_000,
        help="token budget per method (both heads together)",
    )
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="comma-separated subset of " + ",".join(METHODS),
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON in --out")
    args = p.parse_args()
    if args.replot:
        plot(json.loads((args.out / "convergence.json").read_text()), args.out / "convergence.png")
        return
    log_dir = Path(tempfile.mkdtemp(prefix="murmuration-convergence-"))
    print(f"logs in {log_dir}")
    result: dict[str, Any] = {"tokens_budget": args.tokens, "settings": COMMON, "methods": {}}
    for name in args.methods.split(","):
        print(f"{name}:", flush=True)
        result["methods"][name] = run(name, METHODS[name], args.tokens, log_dir)
    final = {n: r["eval_loss"][-1] for n, r in result["methods"].items()}
    if "allreduce" in final and "noloco" in final:
        result["noloco_vs_allreduce"] = final["noloco"] / final["allreduce"] - 1
    if "diloco" in final and "noloco" in final:
        result["noloco_vs_diloco"] = final["noloco"] / final["diloco"] - 1
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "convergence.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "convergence.png")
    print("final eval loss: " + ", ".join(f"{n} {v:.3f}" for n, v in final.items()))


if __name__ == "__main__":
    main()
