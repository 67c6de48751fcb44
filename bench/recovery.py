"""Failure injection on a real swarm: CheckFree, CheckFree+, checkpoint-restart, random.

The swarm: a head node and ``--stages`` block stages (default 4) of one replica each (tiny
model of that many blocks, one per stage; CheckFree+ needs at least 4), one ``node join``
process each on 127.0.0.1.
As in CheckFree's simulator, each block stage fails independently with probability ``p``
per training step (the whole stage at once: its replica is killed with SIGKILL); the
failure schedule is drawn once from ``--seed`` and replayed, by head step, for every
method. After each failure a new volunteer (``node join --stage auto``) arrives as soon as
the dead peer has expired from the peer tables, takes the empty stage and rebuilds it with
the method under test. The head evaluates on the held-out split every ``--eval-s`` seconds.

The failure rate is given per hour as in the paper (``--per-hour 10``: 10 % of stages fail
per hour) and mapped to a probability per step with the CheckFree paper's reference
point (its simulator fails a stage with probability 0.002 per iteration for 10 %/hour), or directly with ``--p``.

Writes ``bench/results/recovery.json`` (eval loss against wall-clock seconds and against
steps, time to reach ``--target`` loss, the failures injected) and ``recovery.png``;
``--name`` changes the file names, so runs at several rates can sit side by side, and
``--summary`` draws their times to target in one figure (``recovery-summary.json``/``.png``).
``--append`` adds methods run later to a file (same rate, seed, depth and length).
Usage: ``python -m bench.recovery [--minutes 3] [--per-hour 10] [--stages 4] [--target 2.5]``.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench import add_set_arg
from node.client import fetch_status
from node.config import parse_sets
from node.demo import LocalSwarm, wait_ready

RESULTS = Path(__file__).parent / "results"
P_PER_PERCENT_HOUR = 0.002 / 10
"""The paper's reference point: 0.002 per iteration is 10 % of stages failing per hour."""
METHODS = ["checkfree", "checkfree+", "checkpoint", "random"]
COMMON = {
    "node.join_wait_s": "1.0",
    "membership.ttl_s": "3",
    "train.hop_timeout_s": "3",
    "train.microbatch_deadline_s": "8",
    "sync.method": "none",
    "recovery.refill_wait_s": "60",
    "recovery.checkpoint_every": "50",
}


def failure_schedule(
    p: float, max_steps: int, num_block_stages: int, seed: int
) -> list[tuple[int, int]]:
    """``(step, stage)`` of every failure: each stage fails with probability ``p`` per step."""
    rng = random.Random(seed)
    events = []
    for step in range(1, max_steps):
        for stage in range(1, num_block_stages + 1):
            if rng.random() < p:
                events.append((step, stage))
    return events


def run(
    method: str, schedule: list[tuple[int, int]], args: argparse.Namespace, log_dir: Path
) -> dict[str, Any]:
    settings = {
        **COMMON,
        "swarm.num_block_stages": str(args.stages),
        "model.num_blocks": str(args.stages),
        "recovery.method": method,
        "recovery.checkpoint_dir": str(log_dir / f"{method}-ckpt"),
        "train.eval_interval_s": str(args.eval_s),
        **parse_sets(args.set),
    }
    swarm = LocalSwarm(log_dir / method, settings)
    swarm.log_dir.mkdir(parents=True)
    by_stage: dict[int, str] = {}
    try:
        head = swarm.start_node(0)
        for stage in range(1, args.stages + 1):
            by_stage[stage] = swarm.start_node(stage)
        for a in [head, *by_stage.values()]:
            wait_ready(a, 120, swarm)
        t0 = time.monotonic()
        pending = list(schedule)
        injected: list[dict[str, Any]] = []
        while time.monotonic() - t0 < args.minutes * 60:
            step = fetch_status(head)["step"]
            while pending and pending[0][0] <= step:
                at, stage = pending.pop(0)
                port = by_stage[stage].rsplit(":", 1)[1]
                entry = next(e for e in swarm.procs if e[0].endswith(port))
                entry[1].send_signal(signal.SIGKILL)
                entry[1].wait()
                entry[2].close()
                swarm.procs.remove(entry)
                injected.append(
                    {"step": step, "stage": stage, "wall_s": round(time.monotonic() - t0, 1)}
                )
                print(f"  {method}: step {step}: stage {stage} fails", flush=True)
                time.sleep(float(COMMON["membership.ttl_s"]) + 1.5)  # the dead peer expires
                by_stage[stage] = swarm.start_node("auto")
            time.sleep(0.5)
        st = fetch_status(head)
        evals = st["evals"]
        recoveries: dict[str, int] = {}
        for address in by_stage.values():
            try:
                for kind, n in fetch_status(address, timeout_s=3)["recovery"]["recoveries"].items():
                    recoveries[kind] = recoveries.get(kind, 0) + n
            except ValueError:
                pass
        return {
            "wall_s": [e["elapsed_s"] for e in evals],
            "steps": [e["step"] for e in evals],
            "eval_loss": [e["loss"] for e in evals],
            "failures": injected,
            "recoveries": recoveries,
            "time_to_target_s": next(
                (e["elapsed_s"] for e in evals if e["loss"] <= args.target), None
            ),
            "steps_to_target": next((e["step"] for e in evals if e["loss"] <= args.target), None),
            "final_eval_loss": evals[-1]["loss"] if evals else None,
        }
    finally:
        swarm.stop(grace_s=10)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in result["methods"].items():
        (line,) = ax1.plot(r["wall_s"], r["eval_loss"], "-o", ms=3, label=name)
        ax2.plot(r["steps"], r["eval_loss"], "-o", ms=3, label=name, color=line.get_color())
        for f in r["failures"]:
            ax1.axvline(f["wall_s"], color=line.get_color(), alpha=0.25, lw=1)
    for ax, xlabel in ((ax1, "wall-clock seconds (faint lines: failures)"), (ax2, "head steps")):
        ax.axhline(result["target_loss"], color="gray", ls="--", lw=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("eval loss (held-out)")
        ax.grid(alpha=0.3)
        ax.legend()
    ax1.set_title(f"Stage failures p={result['p_per_stage_step']} per stage per step")
    ax2.set_title("Against steps")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def time_to(curve: dict[str, Any], target: float) -> float | None:
    """Seconds until the first evaluation at or below ``target`` (None: never reached)."""
    return next(
        (w for w, loss in zip(curve["wall_s"], curve["eval_loss"], strict=True) if loss <= target),
        None,
    )


def by_rate(table: dict[str, Any], targets: list[float]) -> dict[str, Any]:
    """The runs of ``summarize``'s table grouped by failure rate (one per seed): per method,
    the mean final eval loss, the mean time to each target (None unless every seed reached
    it) and in how many seeds the method reached each target before random
    re-initialisation did (a target random never reached counts as reached later)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for run_ in table.values():
        key = f"{run_['per_hour']:g}"
        if run_["stages"] != 4:
            key += f" ({run_['stages']} stages)"
        groups.setdefault(key, []).append(run_)
    out: dict[str, Any] = {}
    for rate, runs in groups.items():
        methods: dict[str, Any] = {}
        for method in runs[0]["methods"]:
            if not all(method in r["methods"] for r in runs):
                continue  # compared only where every seed ran it
            rows = [r["methods"][method] for r in runs]
            finals = [row["final_eval_loss"] for row in rows]
            times = {str(t): [row["time_to_target_s"][str(t)] for row in rows] for t in targets}
            entry: dict[str, Any] = {
                "final_eval_loss": finals,
                "final_eval_loss_mean": round(statistics.fmean(finals), 4),
                "time_to_target_s": times,
                "time_to_target_s_mean": {
                    t: None if None in v else round(statistics.fmean(v), 1)
                    for t, v in times.items()
                },
            }
            if method != "random" and all("random" in r["methods"] for r in runs):
                entry["before_random"] = {
                    str(t): sum(
                        _sooner(r["methods"][method], r["methods"]["random"], str(t)) for r in runs
                    )
                    for t in targets
                }
            methods[method] = entry
        out[rate] = {"seeds": [r["seed"] for r in runs], "methods": methods}
    return out


def _sooner(a: dict[str, Any], b: dict[str, Any], target: str) -> bool:
    """Whether summary row ``a`` reached ``target`` strictly before row ``b`` did."""
    ta, tb = a["time_to_target_s"][target], b["time_to_target_s"][target]
    return ta is not None and (tb is None or ta < tb)


def summarize(names: list[str], out: Path, targets: list[float]) -> None:
    """Time to each of ``targets`` and final eval loss of every method in each named run.

    Several targets, because one run per rate is noisy and one target could be chosen to
    suit a method; the speed-up is checkpoint-restart's time over the method's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads((out / f"{n}.json").read_text()) for n in names]
    table: dict[str, Any] = {}
    for name, r in zip(names, runs, strict=True):
        methods: dict[str, Any] = {}
        for k, m in r["methods"].items():
            times = {str(t): time_to(m, t) for t in targets}
            checkpoint = r["methods"].get("checkpoint")  # runs may leave a method out
            base = {str(t): checkpoint and time_to(checkpoint, t) for t in targets}
            methods[k] = {
                "time_to_target_s": times,
                "speedup_vs_checkpoint": {
                    t: round(b / v, 2) if (b := base[t]) and v else None for t, v in times.items()
                },
                "final_eval_loss": m["final_eval_loss"],
                "final_step": m["steps"][-1] if m["steps"] else 0,
            }
        table[name] = {
            "per_hour": r.get("per_hour", round(r["p_per_stage_step"] / P_PER_PERCENT_HOUR, 2)),
            "seed": r["seed"],
            "stages": r.get("stages", 4),
            "minutes": r["minutes"],
            "failures": max(len(m["failures"]) for m in r["methods"].values()),
            "methods": methods,
        }
    summary = {"runs": table, "by_rate": by_rate(table, targets)}
    (out / "recovery-summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    method_names = list(dict.fromkeys(k for r in runs for k in r["methods"]))
    width = 0.8 / len(method_names)
    rates = Counter((t["per_hour"], t["stages"]) for t in table.values())
    labels = [
        f"{t['per_hour']:g} %/h"
        + ("" if t["stages"] == 4 else f" {t['stages']}st")
        + (f" s{t['seed']}" if rates[t["per_hour"], t["stages"]] > 1 else "")
        + f"\n{t['failures']} failures"
        for t in table.values()
    ]
    # one row of panels for a few runs; two rows, each panel wide enough to label every
    # run, for more
    npanels = len(targets) + 1
    rows = 1 if len(names) <= 5 else 2
    cols = -(-npanels // rows)
    panel_w = max(4.2, 0.95 * len(names))
    fig, grid = plt.subplots(rows, cols, figsize=(panel_w * cols, 4.4 * rows), squeeze=False)
    axes = list(grid.flat)
    for spare in axes[npanels:]:
        spare.remove()
    axes = axes[:npanels]
    panels = [(str(t), f"seconds to eval loss {t:g}") for t in targets] + [("final", "")]
    for ax, (key, title) in zip(axes, panels, strict=True):
        for i, method in enumerate(method_names):
            ran = [(j, t) for j, t in enumerate(table.values()) if method in t["methods"]]
            xs = [j + (i - (len(method_names) - 1) / 2) * width for j, _ in ran]
            if key == "final":
                ys = [t["methods"][method]["final_eval_loss"] for _, t in ran]
                ax.bar(xs, ys, width, label=method)
                continue
            got = [t["methods"][method]["time_to_target_s"][key] for _, t in ran]
            full = [t["minutes"] * 60 for _, t in ran]
            bars = ax.bar(xs, [g or f for g, f in zip(got, full, strict=True)], width, label=method)
            for bar, g in zip(bars, got, strict=True):
                if g is None:  # not reached within the run: drawn at the run's length, hatched
                    bar.set_hatch("//")
                    bar.set_alpha(0.4)
        ax.set_xticks(range(len(names)), labels, fontsize=8)
        ax.set_title(title or "final eval loss (after the run)")
        ax.grid(alpha=0.3, axis="y")
    lo = min(m["final_eval_loss"] for t in table.values() for m in t["methods"].values())
    axes[-1].set_ylim(bottom=lo * 0.9)
    axes[0].set_ylabel("seconds (hatched: not reached)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "recovery-summary.png", dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=3.0, help="training time per method")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--per-hour", type=float, help="stage failures in %% per hour (default 10)")
    rate.add_argument("--p", type=float, help="failure probability per stage per step")
    p.add_argument("--target", type=float, default=2.5, help="target eval loss")
    p.add_argument("--eval-s", type=float, default=10.0, help="seconds between evaluations")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--stages", type=int, default=4, help="block stages, one block and one replica each (>= 4)"
    )
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--name", default="recovery", help="results file names: NAME.json, NAME.png")
    p.add_argument(
        "--append",
        action="store_true",
        help="add these methods to NAME.json (same rate, seed, stages and minutes) and redraw",
    )
    p.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON in --out")
    p.add_argument(
        "--summary", nargs="+", metavar="NAME", help="compare the named runs in one figure"
    )
    p.add_argument("--targets", default="2.5,2.3,2.2", help="eval losses the summary times")
    add_set_arg(p, "a setting of every node, e.g. recovery.lr_boost_steps=100 (repeatable)")
    args = p.parse_args()
    if args.p is None:
        args.p = (10.0 if args.per_hour is None else args.per_hour) * P_PER_PERCENT_HOUR
    json_path, png_path = args.out / f"{args.name}.json", args.out / f"{args.name}.png"
    if args.summary:
        summarize(args.summary, args.out, [float(t) for t in args.targets.split(",")])
        return
    result: dict[str, Any]
    if args.replot:  # redraw, with the time to reach --target recomputed from the stored curves
        result = json.loads(json_path.read_text())
        result["target_loss"] = args.target
        for r in result["methods"].values():
            hit = [
                (w, s)
                for w, s, loss in zip(r["wall_s"], r["steps"], r["eval_loss"], strict=True)
                if loss <= args.target
            ]
            r["time_to_target_s"], r["steps_to_target"] = hit[0] if hit else (None, None)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        plot(result, png_path)
        return
    if args.stages < 4:
        p.error("--stages must be at least 4: CheckFree+ swaps stages 1-2 and N-1-N")
    schedule = failure_schedule(args.p, 5000, args.stages, args.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="murmuration-recovery-"))
    print(f"logs in {log_dir}; first failures (step, stage): {schedule[:6]}")
    result = {
        "target_loss": args.target,
        "p_per_stage_step": args.p,
        "per_hour": round(args.p / P_PER_PERCENT_HOUR, 2),
        "minutes": args.minutes,
        "seed": args.seed,
        "stages": args.stages,
        "settings": {
            **COMMON,
            "swarm.num_block_stages": str(args.stages),
            "model.num_blocks": str(args.stages),
            **parse_sets(args.set),
        },
        "methods": {},
    }
    if args.append and json_path.exists():
        merge_runs(json.loads(json_path.read_text()), result)  # refuse now, not after the runs
    for method in args.methods.split(","):
        print(f"{method}:", flush=True)
        result["methods"][method] = run(method, schedule, args, log_dir)
        r = result["methods"][method]
        print(
            f"  {method}: final {r['final_eval_loss']}, to target {r['time_to_target_s']}s, {r['recoveries']}",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    if args.append and json_path.exists():
        result = merge_runs(json.loads(json_path.read_text()), result)
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, png_path)


RUN_KEYS = ("p_per_stage_step", "minutes", "seed", "stages", "settings")
"""What must match for two runs' methods to sit in one file: the failure schedule (rate,
seed, depth), the length of the run and the swarm's settings."""


def merge_runs(earlier: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """``earlier`` with ``later``'s methods added (``--append``; a method in both takes
    ``later``'s run). ValueError if the two were not run alike (``RUN_KEYS``)."""
    earlier = {"stages": 4, **earlier}  # files from before --stages were 4-stage runs
    differ = [k for k in RUN_KEYS if earlier.get(k) != later.get(k)]
    if differ:
        raise ValueError(
            "cannot append a run that differs in "
            + ", ".join(f"{k} ({earlier.get(k)!r} vs {later.get(k)!r})" for k in differ)
        )
    return {**earlier, "methods": {**earlier["methods"], **later["methods"]}}


if __name__ == "__main__":
    main()
