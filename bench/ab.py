"""Two commits side by side: hop latency and pipeline efficiency, for changes that must not
cost speed (a restructuring, say).

Checks both commits out as git worktrees in a temporary directory and runs, in each, in
turns (before, after, before, after, ...: the machine drifts, so the sides interleave):

- hop latency: 3 runs of 1000 hops of a 16 KiB activation against a bare aiohttp echo
  (``bench.perf_wire.measure_latency``), median p50 ratio;
- pipeline efficiency: the local swarm (head + 3 block stages) for 40 s against one process
  training the same model (``bench.perf_pipeline.measure_pipeline``, no profilers);
- start-up: seconds from launching a local swarm (head + 3 block stages, started together)
  to every node ready, and to every stage past its second inner step (``STARTUP``, written
  here with only what both commits have, so that an old commit measures the same way).

Writes ``bench/results/ab.json``. Usage: ``python -m bench.ab BEFORE [AFTER] [--rounds 2]``
(AFTER defaults to HEAD).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent

MEASURE = """
import json, statistics, sys
from bench.perf_pipeline import measure_pipeline
from bench.perf_wire import measure_latency
runs = [measure_latency(1000) for _ in range(3)]
p = measure_pipeline(40.0, 10.0, [1, 2], profile=False, short=False, torch_profile_s=0.0)
print(json.dumps({
    "hop_p50_ratio": statistics.median(r["hop_p50_ratio_to_echo"] for r in runs),
    "hop_p50_ms": statistics.median(r["hop"]["p50_ms"] for r in runs),
    "pipeline_efficiency": p["pipeline_efficiency"],
    "pipeline_cpu_efficiency": p["pipeline_cpu_efficiency"],
    "swarm_tokens_per_s": p["swarm"]["tokens_per_s"],
    "swarm_cpu_ms_per_1k_tokens": p["swarm"]["cpu_ms_per_1k_tokens"],
}))
"""

STARTUP = """
import json, sys, tempfile, time
from pathlib import Path
from node.client import fetch_status
from node.demo import LocalSwarm, wait_ready
settings = {"node.join_wait_s": "1.0", "train.eval_interval_s": "0", "swarm.num_block_stages": "3"}
with tempfile.TemporaryDirectory() as d:
    swarm = LocalSwarm(Path(d), settings)
    swarm.log_dir.mkdir(exist_ok=True)
    try:
        t0 = time.monotonic()
        head = swarm.start_node(0)
        for stage in (1, 2, 3):
            swarm.start_node(stage)
        for address in swarm.addresses:
            wait_ready(address, 120, swarm)
        ready_s = time.monotonic() - t0
        deadline = t0 + 180
        while True:
            stages = fetch_status(head)["stages"]
            if min(stages.get(str(s), {}).get("step", 0) for s in range(4)) >= 2:
                break
            if time.monotonic() > deadline:
                sys.exit("no stage past step 2 within 180 s")
            time.sleep(0.2)
        step2_s = time.monotonic() - t0
    finally:
        swarm.stop(grace_s=5)
print(json.dumps({"startup_ready_s": ready_s, "startup_step2_s": step2_s}))
"""


def short_rev(rev: str = "HEAD") -> str:
    """``rev`` as a short commit id (of this checkout's repository); ``HEAD`` with a ``+``
    when the node's code (``node/``, ``swarm/``, ``protocol/``) has uncommitted changes, so
    that a run of them is not taken for the commit's."""
    short = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    if rev == "HEAD":
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "node", "swarm", "protocol"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        short += "+" if changed else ""
    return short


@contextmanager
def worktrees(revs: dict[str, str]) -> Iterator[dict[str, tuple[str, Path]]]:
    """Each revision checked out as a git worktree in a temporary directory, by name:
    ``{name: (short commit id, path)}``; removed on exit."""
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:
        trees = {name: (short_rev(rev), Path(tmp) / name) for name, rev in revs.items()}
        for rev, tree in trees.values():
            subprocess.run(
                ["git", "worktree", "add", "--detach", "-q", str(tree), rev], cwd=ROOT, check=True
            )
        try:
            yield trees
        finally:
            for _, tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)


@contextmanager
def this_and(against: str | None) -> Iterator[list[tuple[str, Path | None]]]:
    """The checkouts a side-by-side run compares: ``against`` checked out as a worktree,
    first, when given, then this one; ``(short commit id, tree)`` pairs, the tree None for
    this checkout. Run each one's nodes ``inside`` its tree."""
    if against is None:
        yield [(short_rev(), None)]
        return
    with worktrees({"old": against}) as trees:
        yield [trees["old"], (short_rev(), None)]


def inside(tree: Path | None) -> AbstractContextManager[object]:
    """Where nodes started now run ``tree``'s code (``python -m node`` imports from the
    working directory); None: this checkout's."""
    return contextlib.chdir(tree) if tree is not None else contextlib.nullcontext()


def measure(tree: Path) -> dict[str, Any]:
    """One measurement of the checkout at ``tree`` (its own node/, swarm/, protocol/): the
    start-up, then hop latency and the pipeline."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    result: dict[str, Any] = {}
    for script in (STARTUP, MEASURE):
        out = subprocess.run(
            [sys.executable, "-c", script],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=1200,
        )
        result.update(json.loads(out.stdout.strip().splitlines()[-1]))
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("before")
    p.add_argument("after", nargs="?", default="HEAD")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    sides: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    with worktrees({side: getattr(args, side) for side in sides}) as trees:
        for i in range(args.rounds):
            for side, (rev, tree) in trees.items():
                print(f"[ab] round {i + 1}: {side} ({rev})", file=sys.stderr, flush=True)
                sides[side].append(measure(tree))
    result: dict[str, Any] = {"commits": {s: trees[s][0] for s in sides}, "runs": sides}
    result["medians"] = {
        side: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for side, runs in sides.items()
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "ab.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["medians"], indent=2))
    return result


if __name__ == "__main__":
    main()
