"""Subnormal floats on the CPU: the demo's step rate with ``node.flush_denormal`` off and on.

Values below about 1e-38 (fp32's subnormals) take most x86 CPUs many times longer to
compute with than normal ones, and a model in training makes more of them as it goes. The
daemon flushes them to zero on its compute thread (``node.flush_denormal``, on by
default). Here the same local swarm as ``make demo`` (real ``node join`` processes: a head
and three block stages, one replica each) trains twice, once with the flush off and once
on, alternating when repeated; each run's steps over time come from the demo's progress
lines (every 5 s). Figures per run: the steps per second of its first and last minute,
and the last minute's over the first; across runs, the last minute's rate with the flush
on over off, and each run's final eval loss (the flush changes no value that training
reads, so they should agree within the run-to-run noise).

Writes ``bench/results/denormal.json`` and ``denormal.png``.
Usage: ``python -m bench.denormal [--budget-s 240] [--repeats 1]``; ``--quick`` for the
short version the tests run.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import add_output_args, save

PROGRESS = re.compile(r"^\[\s*(\d+)s\] step\s+(\d+)", re.MULTILINE)
"""A demo progress line: seconds since training began, and the head's inner steps."""


def log(msg: str) -> None:
    print(f"[denormal {time.strftime('%X')}] {msg}", file=sys.stderr, flush=True)


def rate(progress: Sequence[Sequence[int]], start_s: float, end_s: float) -> float | None:
    """Steps per second between the progress lines nearest ``start_s`` and ``end_s``."""
    inside = [(t, s) for t, s in progress if start_s <= t <= end_s]
    if len(inside) < 2 or inside[-1][0] == inside[0][0]:
        return None
    (t0, s0), (t1, s1) = inside[0], inside[-1]
    return (s1 - s0) / (t1 - t0)


def run_demo(flush: bool, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="denormal-") as logs:
        cmd = [sys.executable, "-m", "node", "demo", "--json", "--logs", logs]
        cmd += ["--budget-s", str(args.budget_s), "--block-stages", str(args.block_stages)]
        cmd += ["--set", f"node.flush_denormal={str(flush).lower()}"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.budget_s + 300)
    if done.returncode != 0:
        raise RuntimeError(f"demo exited {done.returncode}: {done.stderr[-2000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    # lists, not tuples: the result reads back from its JSON the same
    progress = [[int(t), int(s)] for t, s in PROGRESS.findall(done.stdout + done.stderr)]
    end = progress[-1][0] if progress else 0
    window = min(60.0, end / 2)
    first, last = rate(progress, 0, window), rate(progress, end - window, end)
    out = {
        "flush_denormal": flush,
        "final_eval_loss": summary["final_eval_loss"],
        "initial_eval_loss": summary["initial_eval_loss"],
        "tokens": summary["tokens"],
        "tokens_per_s": summary["tokens_per_s"],
        "progress": progress,
        "window_s": window,
        "steps_per_s_first": first,
        "steps_per_s_last": last,
        "last_over_first": last / first if first and last else None,
    }
    log(
        f"flush {'on' if flush else 'off'}: {first or 0:.2f} steps/s in the first "
        f"{window:.0f} s, {last or 0:.2f} in the last (x{out['last_over_first'] or 0:.2f}); "
        f"{summary['tokens_per_s']:.0f} tokens/s; eval loss {summary['final_eval_loss']:.3f}"
    )
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    labelled: set[bool] = set()
    for run_ in result["runs"]:
        flush, pts = run_["flush_denormal"], run_["progress"]
        # steps per second over 30 s spans of the progress lines (every 5 s)
        spans = list(zip(pts, pts[6:], strict=False))
        xs = [t1 for (_, _), (t1, _) in spans]
        ys = [(s1 - s0) / (t1 - t0) for (t0, s0), (t1, s1) in spans]
        label = None if flush in labelled else f"flush {'on' if flush else 'off'}"
        labelled.add(flush)
        ax.plot(xs, ys, color="C0" if flush else "C3", label=label)
    ax.set_xlabel("seconds of training")
    ax.set_ylabel("head's inner steps per second (30 s spans)")
    ax.set_ylim(bottom=0)
    ax.set_title("make demo's swarm: subnormal floats flushed to zero on the compute thread or not")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean figures per setting, and the last minute's rate with the flush on over off."""
    out: dict[str, Any] = {}
    for flush in (False, True):
        mine = [r for r in runs if r["flush_denormal"] is flush]
        last = [r["steps_per_s_last"] for r in mine if r["steps_per_s_last"]]
        out["on" if flush else "off"] = {
            "steps_per_s_last_mean": sum(last) / len(last) if last else None,
            "final_eval_loss_mean": sum(r["final_eval_loss"] for r in mine) / len(mine),
            "tokens_per_s_mean": sum(r["tokens_per_s"] for r in mine) / len(mine),
        }
    on, off = out["on"]["steps_per_s_last_mean"], out["off"]["steps_per_s_last_mean"]
    out["last_rate_on_over_off"] = on / off if on and off else None
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget-s", type=float, default=240.0, help="training seconds per run")
    p.add_argument("--block-stages", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1, help="pairs of runs (off, on), alternating")
    p.add_argument("--quick", action="store_true", help="two short runs of two nodes: the test's")
    add_output_args(p, "denormal")
    args = p.parse_args(argv)
    if args.quick:
        args.budget_s, args.block_stages, args.repeats = 15.0, 1, 1
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    name = args.name or ("denormal-quick" if args.quick else "denormal")
    runs: list[dict[str, Any]] = []
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    result: dict[str, Any] = {"settings": settings, "runs": runs}
    for _ in range(args.repeats):
        for flush in (False, True):
            runs.append(run_demo(flush, args))
            save(result, args.out, name, None)
    result["summary"] = summarise(runs)
    ratio = result["summary"]["last_rate_on_over_off"]
    log(f"last minute's steps/s, flush on over off: {ratio or 0:.2f}")
    save(result, args.out, name, None if args.no_plot else plot)
    return result


if __name__ == "__main__":
    main()
