"""Replicas of one stage on different kinds of machine: a GPU replica beside a CPU one.

Volunteers' machines differ in kind as well as speed: one replica of a stage computes on a
GPU (``node.device=cuda``; ``train.compute_dtype`` as on every node) while its partner
computes on a CPU, so the two take their inner steps at very different rates and round
differently. Nothing in NoLoCo's rule cares where a tensor lives, but the code that moves
activations, gradients and gossip contributions between processes does: every tensor
arrives on the CPU and must reach the stage's device, and every outgoing one must leave it.

The swarms, real ``node join`` processes on 127.0.0.1: one head and ``--block-stages`` block
stages of ``--replicas`` replicas each (``a``, ``b``, ...), run one after the other in one
run (``--arms``):

- ``cpu``: every node on the CPU;
- ``cuda``: every node on the GPU;
- ``mixed``: the head on the GPU and, in every block stage, the replicas alternating between
  the two, ``a`` on the GPU, ``b`` on the CPU, ``c`` on the GPU;
- ``slowed``: ``mixed``'s shape with no GPU: every node on the CPU, and the replicas
  ``mixed`` puts there ``--slowdown`` times slower (``train.slowdown``: the compute thread
  sleeps that many times what each piece of work took, less one).

Each trains ``--budget-s`` seconds of the head's training time with NoLoCo on the clock
schedule (``sync.round_s``). Reported per arm: the head's eval loss at the start and the
end, its tokens/s, its in-flight window at the end and the replicas its hops left out
(``train.route_cutoff``: how many draws, and those left out at the end); per replica, its
device, rounds (paired, solo) and inner steps; per block stage, the RMS distance of each
replica's slow weights from the stage's mean, sampled in the middle of a round at the end;
and every node's error lines and exit code. With two replicas a pair is the whole stage and
NoLoCo leaves both with the same slow weights, so the distance says something from three on
(the default). The check: a ``mixed`` arm that learns as the others do, pairs in its rounds
as ``cuda`` does and keeps its replicas as close, with no error line. Writes
``bench/results/<--name>.json`` (``devices``); there is no figure.

Usage: ``python -m bench.devices [--arms cpu cuda mixed slowed] [--budget-s 150]
[--replicas 3] [--slowdown 16] [--set SECTION.FIELD=VALUE]`` (``cuda`` and ``mixed`` need a
CUDA GPU; the default arms are those three).
"""

from __future__ import annotations

import argparse
import re
import string
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import add_output_args, add_set_arg, save
from bench.convergence_sim import distances_from_mean
from bench.sync_unequal import slow_weights, to_mid_round
from node.client import fetch_status
from node.config import parse_sets
from node.demo import LocalSwarm, train_for, wait_ready

ARMS = ("cpu", "cuda", "mixed", "slowed")
ERROR_LINE = re.compile(r"^(\d\d:\d\d:\d\d E |Traceback)")
"""An error line of a node's log (``node.logs``' format) or the start of a traceback."""


def log(msg: str) -> None:
    print(f"[devices {time.strftime('%X')}] {msg}", file=sys.stderr, flush=True)


def devices(arm: str, block_stages: int, replicas: int) -> dict[str, str]:
    """Each node's device under ``arm``: ``head``, and ``s<stage><a|b|c...>`` for the
    replicas; under ``mixed`` they alternate, ``a`` on the GPU, ``b`` on the CPU, ..."""
    out = {"head": "cuda" if arm in ("cuda", "mixed") else "cpu"}
    for s in range(1, block_stages + 1):
        for letter in string.ascii_lowercase[:replicas]:
            name = f"s{s}{letter}"
            gpu = arm == "cuda" or (arm == "mixed" and not slowed(name))
            out[name] = "cuda" if gpu else "cpu"
    return out


def stage_of(name: str) -> int:
    """The stage of node ``name`` of ``devices``: 0 for the head, else the number after
    ``s``."""
    return 0 if name == "head" else int(name[1:-1])


def slowed(name: str) -> bool:
    """Whether replica ``name`` is one that ``mixed`` puts on the CPU (``b``, ``d``, ...)
    and ``slowed`` slows."""
    return name != "head" and string.ascii_lowercase.index(name[-1]) % 2 == 1


def run(arm: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    settings = {
        "node.join_wait_s": "1.0",
        "train.eval_interval_s": "30",
        "swarm.num_block_stages": str(args.block_stages),
        "sync.method": "noloco",
        "sync.round_s": str(args.round_s),
        **parse_sets(args.set),
    }
    log_dir.mkdir(parents=True)
    swarm = LocalSwarm(log_dir, settings)
    placed = devices(arm, args.block_stages, args.replicas)
    addresses: dict[str, str] = {}
    try:
        for name, device in placed.items():
            extra = ["--device", device]
            if arm == "slowed" and slowed(name):
                extra += ["--set", f"train.slowdown={args.slowdown}"]
            addresses[name] = swarm.start_node(stage_of(name), extra=extra)
        for address in addresses.values():
            wait_ready(address, 180, swarm)
        log(f"{arm}: {len(addresses)} nodes serving ({placed}); {args.budget_s:g} s")
        summary = train_for(addresses["head"], swarm, args.budget_s, lambda *a, **k: None)
        replicas: dict[str, Any] = {}
        for name, address in addresses.items():
            st = fetch_status(address)
            replicas[name] = {
                "device": placed[name],
                "slowdown": args.slowdown if arm == "slowed" and slowed(name) else 1.0,
                "stage": st.get("stage"),
                "step": st["step"],
                "rounds": dict((st.get("sync") or {}).get("rounds", {})),
            }
            if name == "head":  # how many it kept in flight at the end (bench.routing_window)
                replicas[name]["window"] = st.get("window")
                # train.route_cutoff: replicas its hops' draws left out, and those left out now
                replicas[name]["route_left_out"] = st["counters"].get("route_left_out", 0)
                named = {a: n for n, a in addresses.items()}
                replicas[name]["left_out_now"] = sorted(
                    named.get(p["address"], p["address"])
                    for stage in st["peers"].values()
                    for p in stage
                    if p.get("left_out")
                )
        stages: dict[str, Any] = {}
        for s in range(1, args.block_stages + 1):
            members = [a for n, a in addresses.items() if n != "head" and stage_of(n) == s]
            to_mid_round(members[0])
            stages[str(s)] = distances_from_mean([slow_weights(a, s) for a in members])
    finally:
        codes = swarm.stop()
    for name, address in addresses.items():
        text = swarm.log_path(address).read_text(errors="replace")
        errors = [line for line in text.splitlines() if ERROR_LINE.match(line)]
        replicas[name]["error_lines"] = errors[:20]
    result = {
        "arm": arm,
        "initial_eval_loss": summary["initial_eval_loss"],
        "final_eval_loss": summary["final_eval_loss"],
        "tokens": summary["tokens"],
        "tokens_per_s": summary["tokens_per_s"],
        "replicas": replicas,
        "distances_from_stage_mean": stages,
        "exit_codes": codes,
    }
    log(
        f"{arm}: eval {result['initial_eval_loss']:.3f} -> {result['final_eval_loss']:.3f}, "
        f"{result['tokens_per_s']:.0f} tokens/s; rounds "
        + ", ".join(
            f"{n} {r['device']} {r['rounds']} {r['step']} steps" for n, r in replicas.items()
        )
        + f"; distances {stages}; error lines "
        + str(sum(len(r["error_lines"]) for r in replicas.values()))
    )
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--arms", nargs="+", choices=ARMS, default=["cpu", "cuda", "mixed"])
    p.add_argument("--budget-s", type=float, default=150.0, help="head's training seconds an arm")
    p.add_argument("--block-stages", type=int, default=2)
    p.add_argument(
        "--replicas",
        type=int,
        default=3,
        help="replicas of each block stage (a pair is the "
        "whole stage with 2, and NoLoCo leaves the two with one copy of the slow weights)",
    )
    p.add_argument("--round-s", type=float, default=20.0, help="sync.round_s (the clock grid)")
    p.add_argument("--slowdown", type=float, default=16.0, help="how much slower under slowed")
    add_set_arg(p, "a setting for every node (train.window=fixed, say)")
    add_output_args(p, "devices")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="murmuration-devices-"))
    result: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()}, "runs": {}}
    for arm in args.arms:  # saved after each arm, so a run cut short keeps what it measured
        result["runs"][arm] = run(arm, args, log_dir / arm)
        save(result, args.out, args.name or "devices", None)
    return result


if __name__ == "__main__":
    main()
