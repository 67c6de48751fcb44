"""What a relay costs: one swarm's tokens/s with its block stage served directly and through
a relay, side by side in one run.

The swarm is a head and one block stage (``swarm.num_block_stages = 1``, the tiny model) of
real ``node join`` processes on 127.0.0.1. Three ways to reach the block node:

- ``direct``: the head dials it;
- ``via_head``: the block node cannot be dialled (it announces ``127.0.0.9`` while listening
  on ``127.0.0.1`` only, and ``net.force_relay``), and the head is its relay: a hop is one
  WebSocket message (a public head and a NATed block node, the common case);
- ``via_relay``: the same node, relayed by a third node that serves no stage
  (``--stage relay``; the head relays for nobody): a hop is an HTTP request to the relay and
  a WebSocket message on from there, two network hops each way.

With ``--latency-ms`` every node delays what it sends by that much (``net.inject_latency_s``,
one way), so a relay's second hop costs what it would on a WAN.

Each variant runs ``--rounds`` times, alternating (the machine is noisy: ratios to
``direct`` in the same round are what count). Per run: the head's tokens/s over
``--seconds`` after a warm-up; the CPU seconds per microbatch of each process (from
``/proc``); the relay's frame bytes per microbatch (its ``node status``). Writes
``bench/results/relay.json`` and ``relay.png``.

Usage: ``python -m bench.relay [--rounds 3] [--seconds 30] [--latency-ms 0] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from node.client import fetch_status
from node.demo import LocalSwarm, wait_ready

RESULTS = Path(__file__).parent / "results"
VARIANTS = ("direct", "via_head", "via_relay")
SETTINGS = {
    "node.join_wait_s": "1.0",
    "train.eval_interval_s": "0",
    "data.shard": "0",
    "swarm.num_block_stages": "1",
    "balance.benchmark_s": "0",
}
UNDIALLABLE = ["--announce", "127.0.0.9", "--set", "net.force_relay=true"]
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def say(text: str) -> None:
    print(f"[relay {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def relaying(address: str) -> bool:
    """Whether the relay-only node at ``address`` is up and offering its slots."""
    try:
        return bool(fetch_status(address)["relay"]["capacity"] > 0)
    except ValueError:  # not listening yet
        return False


def start(variant: str, log_dir: Path, latency_ms: float) -> tuple[LocalSwarm, dict[str, str]]:
    """The swarm of ``variant``; returns it and its nodes' addresses by role."""
    settings = dict(SETTINGS)
    if latency_ms:
        settings["net.inject_latency_s"] = str(latency_ms / 1e3)
    swarm = LocalSwarm(log_dir / variant, settings)
    (log_dir / variant).mkdir(parents=True, exist_ok=True)
    nodes = {}
    head_extra = ["--set", "net.relay_capacity=0"] if variant == "via_relay" else []
    nodes["head"] = swarm.start_node(0, extra=head_extra)
    wait_ready(nodes["head"], 120.0, swarm)
    if variant == "via_relay":
        nodes["relay"] = swarm.start_node("relay")
        deadline = time.monotonic() + 60
        while not relaying(nodes["relay"]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the relay does not relay; logs in {swarm.log_dir}")
            time.sleep(0.3)
    extra = [] if variant == "direct" else UNDIALLABLE
    nodes["block"] = swarm.start_node(1, extra=[*extra, "--set", "net.relays=1"])
    wait_ready(nodes["block"], 120.0, swarm)
    return swarm, nodes


def measure(variant: str, seconds: float, warmup_s: float, latency_ms: float) -> dict[str, Any]:
    log_dir = Path(tempfile.mkdtemp(prefix="murmuration-relay-"))
    swarm, nodes = start(variant, log_dir, latency_ms)
    try:
        head = nodes["head"]
        relay = nodes.get("relay", head if variant == "via_head" else None)
        deadline = time.monotonic() + warmup_s + 120
        while fetch_status(head).get("train_s", 0.0) < warmup_s:
            if swarm.dead() or time.monotonic() > deadline:
                raise RuntimeError(f"{variant}: the swarm is not training; logs in {log_dir}")
            time.sleep(0.3)
        pids = {
            role: next(p.pid for name, p, _ in swarm.procs if name.endswith(a.rsplit(":")[1]))
            for role, a in nodes.items()
        }
        st0 = fetch_status(head)
        relay0 = fetch_status(relay)["relay"] if relay else None
        cpu0 = {role: cpu_s(pid) for role, pid in pids.items()}
        t0 = time.monotonic()
        time.sleep(seconds)
        elapsed = time.monotonic() - t0
        st1 = fetch_status(head)
        relay1 = fetch_status(relay)["relay"] if relay else None
        cpu1 = {role: cpu_s(pid) for role, pid in pids.items()}
        done = st1["counters"].get("microbatches_completed", 0) - st0["counters"].get(
            "microbatches_completed", 0
        )
        out: dict[str, Any] = {
            "variant": variant,
            "tokens_per_s": (st1["tokens"] - st0["tokens"]) / elapsed,
            "microbatches": done,
            "cpu_ms_per_microbatch": {
                role: 1e3 * (cpu1[role] - cpu0[role]) / max(1, done) for role in pids
            },
        }
        if relay0 is not None and relay1 is not None:
            moved = {
                d: relay1["bytes"].get(d, 0) - relay0["bytes"].get(d, 0)
                for d in ("to_node", "from_node")
            }
            out["relay_kb_per_microbatch"] = {d: n / 1e3 / max(1, done) for d, n in moved.items()}
            out["relay_requests"] = relay1["requests"]
        block = fetch_status(nodes["block"])
        out["block_reachability"] = block["reachability"]["state"]
        return out
    finally:
        swarm.stop(grace_s=5.0)


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant: median tokens/s and its ratio to ``direct`` in the same round."""
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["variant"]] = r
    out: dict[str, Any] = {}
    for v in VARIANTS:
        mine = [r for r in runs if r["variant"] == v]
        if not mine:
            continue
        ratios = [
            rnd[v]["tokens_per_s"] / rnd["direct"]["tokens_per_s"]
            for rnd in by_round.values()
            if v in rnd and "direct" in rnd and rnd["direct"]["tokens_per_s"] > 0
        ]
        out[v] = {
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in mine),
            "ratio_to_direct_median": statistics.median(ratios) if ratios else None,
            "ratios_to_direct": ratios,
            "cpu_ms_per_microbatch_median": {
                role: statistics.median(r["cpu_ms_per_microbatch"][role] for r in mine)
                for role in mine[0]["cpu_ms_per_microbatch"]
            },
        }
        if "relay_kb_per_microbatch" in mine[0]:
            out[v]["relay_kb_per_microbatch_median"] = {
                d: statistics.median(r["relay_kb_per_microbatch"][d] for r in mine)
                for d in ("to_node", "from_node")
            }
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    variants = [v for v in VARIANTS if v in summary]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for v in variants:
        xs = [r["tokens_per_s"] for r in result["runs"] if r["variant"] == v]
        ax1.scatter([v] * len(xs), xs, color="grey", s=12, zorder=3)
    ax1.bar(variants, [summary[v]["tokens_per_s_median"] for v in variants], color="#4a7ab5")
    ax1.set_ylabel("tokens/s (head)")
    ax1.set_title(f"throughput, {result['latency_ms']:g} ms one-way latency")
    roles = ["head", "block", "relay"]
    width = 0.25
    for k, role in enumerate(roles):
        ys = [summary[v]["cpu_ms_per_microbatch_median"].get(role, 0.0) for v in variants]
        ax2.bar([i + (k - 1) * width for i in range(len(variants))], ys, width, label=role)
    ax2.set_xticks(range(len(variants)), variants)
    ax2.set_ylabel("CPU ms per microbatch")
    ax2.set_title("CPU per microbatch, by process")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=30.0, help="measured window per run")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of training first")
    p.add_argument("--latency-ms", type=float, default=0.0, help="one-way delay on every send")
    p.add_argument("--quick", action="store_true", help="the smoke run the tests use")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--name", default="")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds, args.warmup = 1, 6.0, 3.0
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    runs = []
    for rnd in range(args.rounds):
        order = VARIANTS if rnd % 2 == 0 else tuple(reversed(VARIANTS))
        for variant in order:
            say(f"round {rnd + 1}/{args.rounds}: {variant}")
            run = measure(variant, args.seconds, args.warmup, args.latency_ms)
            run["round"] = rnd
            say(
                f"  {run['tokens_per_s']:.0f} tokens/s, {run['microbatches']} microbatches, "
                f"CPU ms/mb { ({k: round(v, 1) for k, v in run['cpu_ms_per_microbatch'].items()}) }"
            )
            runs.append(run)
    result = {
        "rounds": args.rounds,
        "seconds": args.seconds,
        "latency_ms": args.latency_ms,
        "cpus": os.cpu_count(),
        "runs": runs,
        "summary": summarise(runs),
    }
    name = args.name or ("relay-quick" if args.quick else "relay")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    if not args.quick:
        plot(result, args.out / f"{name}.png")
    for v, s in result["summary"].items():
        say(f"{v}: {s['tokens_per_s_median']:.0f} tokens/s, x{s['ratio_to_direct_median']:.2f}")
    return result


if __name__ == "__main__":
    main()
