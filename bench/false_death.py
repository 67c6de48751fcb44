"""A slow uplink is not a dead peer: false losses on a thin uplink, and how soon a real loss
is seen, this checkout's code against an older one's, side by side in one run.

A node whose hop to a peer fails stops counting that peer as a live replica of its stage
(``node.services.recovery``): the peer is probably dead and not yet expired from the peer
table, and CheckFree's refill starts from that moment. But the hop of a node behind a thin
uplink fails in its own upload queue while the receiver is fine. Since ``c2e8219`` a failed
peer is counted out only if it has not spoken to us since, nor in the last two heartbeats
(``swarm.routing.Router.unresponsive``).

- **False losses.** A public head and a NATed block node (``bench.uplink_live.natted_swarm``:
  real ``node join`` processes, the block node behind a ``--mbit`` Mbit/s router uplink with
  a 1 s queue). For each in-flight window (``fixed``: six always in flight, whose hops
  miss their deadline; ``adaptive``: the default), ``--measure-s`` seconds from the moment
  the block node serves: its failed hops (``send_failed_timeout``) and how often it logged
  the head's stage as having no live replica, though the head never stopped sending it
  work.
- **Detection.** A head and two block stages of one replica each on loopback. Once the
  head has completed a few microbatches, stage 2's process is killed (``SIGKILL``: its
  port refuses connections) or frozen (``SIGSTOP``: connections are taken and never
  answered, as from a host that vanished); the seconds until stage 1's node counts stage 2
  empty (``node status``: ``recovery.empty_stages``).

The older commit is checked out as a git worktree (``bench.ab.this_and``); its nodes run
with that directory as their working directory. Writes ``bench/results/false_death.json``.

Usage: ``python -m bench.false_death OLD_COMMIT [--mbit 2] [--measure-s 120]`` (as root).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.ab import inside, this_and
from node.client import fetch_status
from node.demo import LocalSwarm, wait_ready

RESULTS = Path(__file__).parent / "results"
EMPTY_LINE = re.compile(r"has no live replica(?! yet)")
"""A stage counted lost (not one yet to be served)."""


def say(text: str) -> None:
    print(f"[false_death {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def thin(window: str, mbit: float, measure_s: float, logs: Path) -> dict[str, Any]:
    """The NATed block node's failed hops and logged losses over ``measure_s`` seconds."""
    from bench.uplink_live import natted_swarm
    from tests.test_nat import status_of

    with natted_swarm(mbit, logs, head_settings=(f"train.window={window}",)) as (public, natted):
        time.sleep(measure_s)
        counters = status_of(natted)["counters"]
        completed = status_of(public)["counters"].get("microbatches_completed", 0)
    text = (logs / "natted.log").read_text(errors="replace")
    return {
        "window": window,
        "measure_s": measure_s,
        "hops_timed_out": counters.get("send_failed_timeout", 0),
        "hops_failed": sum(v for k, v in counters.items() if k.startswith("send_failed_")),
        "stage_lost_logged": len(EMPTY_LINE.findall(text)),
        "completed": completed,
    }


def detection(how: str, logs: Path, timeout_s: float = 90.0) -> dict[str, Any]:
    """Seconds from stage 2's replica being killed or frozen (``how``) to stage 1's node
    counting stage 2 empty."""
    settings = {
        "swarm.num_block_stages": "2",
        "model.num_blocks": "2",
        "node.join_wait_s": "1.0",
        "train.eval_interval_s": "0",
        "sync.method": "none",
        "recovery.refill_wait_s": "600",  # nobody moves: only the detection is timed
    }
    swarm = LocalSwarm(logs, settings)
    logs.mkdir(parents=True, exist_ok=True)
    try:
        head = swarm.start_node(0)
        one = swarm.start_node(1)
        two = swarm.start_node(2)
        for address in (head, one, two):
            wait_ready(address, 120, swarm)
        deadline = time.monotonic() + 120
        while fetch_status(head)["counters"].get("microbatches_completed", 0) < 3:
            if time.monotonic() > deadline:
                raise RuntimeError("the swarm completed no microbatches in 120 s")
            time.sleep(0.5)
        _, proc, _ = swarm.procs[2]
        proc.send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        seen_s = None
        while (elapsed := time.monotonic() - t0) < timeout_s:
            if 2 in fetch_status(one, timeout_s=5)["recovery"]["empty_stages"]:
                seen_s = elapsed
                break
            time.sleep(0.2)
        if how == "freeze":
            proc.send_signal(signal.SIGKILL)
        return {"how": how, "seen_empty_s": None if seen_s is None else round(seen_s, 1)}
    finally:
        swarm.stop()


def summarise(out: dict[str, Any], code: str) -> dict[str, Any]:
    """One code's false losses logged per window (over the rounds) and median seconds to
    see a killed or frozen replica's stage empty (None: never seen)."""
    summary: dict[str, Any] = {}
    for window in ("fixed", "adaptive"):
        runs = [r for r in out["thin"] if (r["code"], r["window"]) == (code, window)]
        summary[f"stage_lost_logged_{window}"] = sum(r["stage_lost_logged"] for r in runs)
    for how in ("kill", "freeze"):
        seen = [
            r["seen_empty_s"]
            for r in out["detection"]
            if (r["code"], r["how"]) == (code, how) and r["seen_empty_s"] is not None
        ]
        summary[f"seen_empty_s_{how}_median"] = statistics.median(seen) if seen else None
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", help="the older commit (checked out as a git worktree)")
    ap.add_argument("--mbit", type=float, default=2.0)
    ap.add_argument("--measure-s", type=float, default=120.0)
    ap.add_argument("--thin-rounds", type=int, default=1, help="0: keep the recorded runs")
    ap.add_argument("--detect-rounds", type=int, default=3, help="0: keep the recorded runs")
    args = ap.parse_args()
    with this_and(args.old) as (old, new):
        compare(args, {"old": old, "new": new})


def compare(args: argparse.Namespace, trees: dict[str, tuple[str, Path | None]]) -> None:
    """Every part for the old and the new code (``{label: (commit, checkout)}``, as
    ``bench.ab.this_and`` gives them) in turn."""
    path = RESULTS / "false_death.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    out: dict[str, Any] = {
        "commits": {label: rev for label, (rev, _) in trees.items()},
        "mbit": args.mbit,
        "thin": [] if args.thin_rounds else previous.get("thin", []),
        "detection": [] if args.detect_rounds else previous.get("detection", []),
    }
    with tempfile.TemporaryDirectory(prefix="false-death-") as tmp:
        for rnd in range(args.thin_rounds):
            for window in ("fixed", "adaptive"):
                for label, (_, tree) in trees.items():
                    say(f"{label}: {window} window behind {args.mbit:g} Mbit/s")
                    logs = Path(tmp) / f"thin-{rnd}-{window}-{label}"
                    with inside(tree):
                        run = thin(window, args.mbit, args.measure_s, logs)
                    run.update(code=label, round=rnd)
                    out["thin"].append(run)
                    say(f"  {run}")
        for rnd in range(args.detect_rounds):
            for how in ("kill", "freeze"):
                for label, (_, tree) in trees.items():
                    say(f"{label}: stage 2 {how}")
                    with inside(tree):
                        run = detection(how, Path(tmp) / f"detect-{rnd}-{how}-{label}")
                    run.update(code=label, round=rnd)
                    out["detection"].append(run)
                    say(f"  {run}")
    out["summary"] = {label: summarise(out, label) for label in trees}
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    say(f"wrote {path}: {out['summary']}")


if __name__ == "__main__":
    main()
