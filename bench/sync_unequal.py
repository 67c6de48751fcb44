"""NoLoCo between replicas of unequal speed: do they still pair, and at what cost?

The swarm, real ``node join`` processes on 127.0.0.1: one head; block stage 1 with four
replicas, two at full speed, one 2x and one 4x slower (``train.slowdown``: after each piece
of work their compute thread sleeps once or three times what it took, as a slower machine
would take longer); block stage 2 with four equal replicas, the control. The same swarm runs once per
outer schedule (``sync.schedule``):

- ``steps``: a round is a replica's outer step after every H inner steps, and only
  replicas at the same round pair (the papers' lockstep rule, and this project's before);
- ``clock``: rounds on a wall-clock grid shared by the stage (``swarm.schedule``), so a
  faster replica takes more inner steps per round and every replica meets the others, with
  every pseudo-gradient on one scale (``swarm.outer.scale_by_steps``);
- ``clock_unscaled``: the same without that scaling (``sync.scale_by_steps = false``).
- ``clock_own_lr``: the clock schedule with pooling, each replica keeping its own place in
  the learning-rate schedule (``sync.share_schedule = false``; the default averages it with
  each partner, ``swarm.outer.pair_position``).
- ``clock_decayed``: the clock schedule with a slow replica's inner momentum decayed by the
  steps it fell short of the stage's usual (``sync.decay_momentum``,
  ``swarm.outer.momentum_decay``; off by default).
- ``clock_short_warmup``: the clock schedule with a 2-step warm-up (``train.warmup_steps =
  2``; the default is 60). The fast replicas take about 100 inner steps in ten minutes, so
  the default warm-up fills the run; in a long run it is the first 2 %.
- ``clock_diloco``: DiLoCo on the clock schedule, every round a ring all-reduce of the
  stage's replicas, each keeping its own place in the schedule (the default;
  ``clock_diloco_shared``: the ring averages the places too, ``sync.diloco_share_schedule``).
  A round counts as met when it all-reduced; every round leaves the stage one copy of the
  slow weights, so there is no spread to compare, and the figure is how far apart the
  replicas' places in the schedule end.
- ``clock_cut``: the clock schedule with replicas expected to take more than twice as long
  as the best left out of each hop's draw (``train.route_cutoff = 2``,
  ``swarm.routing.cut_weights``; the default draws from every replica, as SWARM does),
  which sends the slow replicas fewer microbatches.
- ``clock_equal``: the clock schedule with no replica slowed, stage 1's four as equal as
  stage 2's. The spread ratio compares two stages at different depths of the model, so it
  need not read 1 with equal replicas in both; this is what it reads with none unequal.

For each replica: rounds paired and solo since the whole swarm was serving, inner steps and
steps per second, and its service rate (how much slower it is); for each stage: its spread,
the RMS distance of each replica's slow weights from the stage's mean (what NoLoCo's
reference logs), sampled in the middle of a round (at most one a round, at least
``--sample-s`` apart) and averaged, and the mean RMS distance to the partner at pairing (the
daemon's gauge). Each replica's own distance from its stage's mean and its inner steps are
kept per sample too (``distance_samples``, ``steps_at_samples``), to see which replicas a
rise in the spread comes from; and how many replicas the head's hop draws left out
(``head_route_left_out``, ``murmur_route_left_out_total``: none but under ``clock_cut``).
The ratio of the stages' spreads comes with a 90 % bootstrap interval over the run's rounds
(``ratio_interval``): ten rounds' ratios swing several-fold. Targets (issue 20): on the clock schedule at least 90 % of rounds paired on
every replica, the fast replicas not held to the slowest one's pace, and stage 1's spread
at most 2x stage 2's.

Writes ``bench/results/sync_unequal.json`` and ``sync_unequal.png``.
Usage: ``python -m bench.sync_unequal [--minutes 10] [--round-s 64] [--schedules clock,clock]
[--set node.device=cuda]``
(a variant named twice runs twice); ``--quick`` for the few-minute version the tests run.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench import add_output_args, add_set_arg, save
from bench.convergence_sim import distances_from_mean
from node.client import fetch_status, request_eval
from node.config import parse_sets
from node.demo import LocalSwarm, wait_ready
from node.stage.export import fetch_stage_state

VARIANTS = {
    "steps": {"sync.schedule": "steps"},
    "clock": {"sync.schedule": "clock"},
    "clock_unscaled": {"sync.schedule": "clock", "sync.scale_by_steps": "false"},
    "clock_own_lr": {"sync.schedule": "clock", "sync.share_schedule": "false"},
    "clock_decayed": {"sync.schedule": "clock", "sync.decay_momentum": "true"},
    "clock_short_warmup": {"sync.schedule": "clock", "train.warmup_steps": "2"},
    "clock_diloco": {"sync.schedule": "clock", "sync.method": "diloco"},
    "clock_diloco_shared": {
        "sync.schedule": "clock",
        "sync.method": "diloco",
        "sync.diloco_share_schedule": "true",
    },
    "clock_equal": {"sync.schedule": "clock"},
    "clock_cut": {"sync.schedule": "clock", "train.route_cutoff": "2"},
}
"""What is compared (see the module docstring): by default the H-step rule, the clock
schedule, and the clock schedule without pseudo-gradients on one scale; the rest on
request (``--schedules``)."""
EQUAL_STAGE1 = frozenset({"clock_equal"})
"""Variants whose stage 1 runs its four replicas at full speed (the names kept): the null
for the spread ratio, which compares stages at two depths of the model."""
SPEEDS = {"fast-a": 0, "fast-b": 0, "slow2": 2, "slow4": 4}
"""Stage-1 replicas: name -> how many times slower (0: full speed)."""
CONTROL = ("equal-a", "equal-b", "equal-c", "equal-d")
"""Stage-2 replicas, all at full speed."""
COMMON = {
    "node.join_wait_s": "1.0",
    "membership.ttl_s": "6",
    "train.eval_interval_s": "0",
    "train.hop_timeout_s": "10",
    "train.microbatch_deadline_s": "60",
    "swarm.num_block_stages": "2",
    "sync.method": "noloco",
    "balance.benchmark_s": "0",
}


def log(msg: str) -> None:
    print(f"[sync_unequal {time.strftime('%X')}] {msg}", file=sys.stderr, flush=True)


def settings(args: argparse.Namespace, variant: str) -> dict[str, str]:
    out = {
        **COMMON,
        **VARIANTS[variant],
        "sync.outer_steps": str(args.outer_steps),
        "train.step_samples": str(args.step_samples),
        "train.max_in_flight": str(args.max_in_flight),
        "train.window": "fixed",  # as many in flight as its simulation keeps
    }
    if args.round_s:
        out["sync.round_s"] = str(args.round_s)
    return {**out, **parse_sets(args.set)}


def slowdowns(schedule: str) -> dict[str, int]:
    """Stage 1's replicas under ``schedule``: name -> how many times slower (0: full speed);
    none slowed in the null variants."""
    return {n: 0 if schedule in EQUAL_STAGE1 else v for n, v in SPEEDS.items()}


def slow_weights(address: str, stage: int) -> torch.Tensor:
    return fetch_stage_state(address, stage).tensors["outer.phi"].clone()


def seconds_to_mid_round(period_s: float, now_s: float) -> float:
    """Seconds from ``now_s`` (wall clock) to the next middle of a round of the grid of
    ``period_s``."""
    return (period_s / 2 - now_s % period_s) % period_s


def to_mid_round(address: str, every_s: float = 0.0) -> None:
    """Sleep until the middle of a round of the grid ``address``'s stage runs on, where no
    replica's slow weights are changing: a sample taken across a boundary mixes replicas
    before their outer step with replicas after it, and reads as a spread several times the
    real one (an earlier version of this benchmark sampled at fixed intervals and was hit).
    ``every_s``: the middle of the first round that leaves at least that long since the
    last middle (one sample a round when it is shorter than a round)."""
    period = (fetch_status(address).get("sync") or {}).get("round_s")
    if not period:
        time.sleep(every_s)
        return
    if not every_s and period / 4 <= time.time() % period <= 3 * period / 4:
        return  # in the middle half already
    wait = max(0.0, every_s - period)
    time.sleep(wait + seconds_to_mid_round(period, time.time() + wait))


def snapshot(addresses: dict[str, str]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, address in addresses.items():
        st = fetch_status(address)
        sync = st.get("sync") or {}
        out[name] = {
            "step": st["step"],
            "schedule_step": st.get("schedule_step", st["step"]),
            "throughput": st["throughput"],
            "rounds": dict(sync.get("rounds", {})),
            "spread_rms_mean": sync.get("spread_rms_mean"),
            "round_s": sync.get("round_s"),
        }
    return out


OUTER_STEP = re.compile(r"noloco outer step \d+: .*; (\d+) inner steps, the stage's usual (\d+)")
"""A NoLoCo outer step's log line on the clock schedule: its inner steps and the stage's
usual number it was compared with (``node.services.sync``)."""


def steps_and_usual(log_path: Path) -> list[tuple[int, int]]:
    """Each outer step's (inner steps, the stage's usual) from a node's log, in order."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    return [(int(m[1]), int(m[2])) for m in OUTER_STEP.finditer(text)]


def run(schedule: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    swarm = LocalSwarm(log_dir, settings(args, schedule))
    try:
        head = swarm.start_node(0)
        wait_ready(head, 120, swarm)
        slowdown = slowdowns(schedule)
        stage1 = {}
        for name, slower in slowdown.items():
            extra = ["--set", f"train.slowdown={slower}"] if slower else []
            stage1[name] = swarm.start_node(1, extra=extra)
        stage2 = {name: swarm.start_node(2) for name in CONTROL}
        everyone = {**stage1, **stage2}
        for address in everyone.values():
            wait_ready(address, 120, swarm)
        log(f"{schedule}: all {len(everyone) + 1} nodes serving; {args.minutes:g} min")
        t0 = time.monotonic()
        start = snapshot(everyone)
        samples: dict[str, list[float]] = {"1": [], "2": []}
        sampled_s: list[float] = []  # seconds since t0 of each stage-1 sample
        # per replica and sample: its distance from the stage mean, and its inner steps then
        distances: dict[str, list[float]] = {n: [] for n in everyone}
        steps_at: dict[str, list[int]] = {n: [] for n in everyone}
        while time.monotonic() - t0 < args.minutes * 60:
            to_mid_round(stage1["fast-a"], args.sample_s)
            if swarm.dead():
                raise RuntimeError(f"nodes died: {swarm.dead()}; logs in {log_dir}")
            sampled_s.append(round(time.monotonic() - t0, 1))
            for stage, names in (("1", stage1), ("2", stage2)):
                to_mid_round(next(iter(names.values())))  # stage 2 may run another grid
                each = distances_from_mean([slow_weights(everyone[n], int(stage)) for n in names])
                samples[stage].append(statistics.mean(each))
                for name, distance in zip(names, each, strict=True):
                    distances[name].append(distance)
                    steps_at[name].append(fetch_status(everyone[name])["step"])
        end = snapshot(everyone)
        wall_s = time.monotonic() - t0
        eval_loss = request_eval(head)
        # train.route_cutoff (clock_cut): stage-1 replicas the head's draws left out
        left_out = fetch_status(head)["counters"].get("route_left_out", 0)
    finally:
        swarm.stop()
    replicas = {}
    for name in everyone:
        rounds = {
            k: end[name]["rounds"].get(k, 0) - start[name]["rounds"].get(k, 0)
            for k in set(end[name]["rounds"]) | set(start[name]["rounds"])
        }
        total = sum(rounds.values())
        steps = end[name]["step"] - start[name]["step"]
        stage_no = 1 if name in stage1 else 2
        replicas[name] = {
            "stage": stage_no,
            "slower": slowdown.get(name, 0),
            "rounds": rounds,
            # met a partner: paired (NoLoCo) or all-reduced (DiLoCo)
            "paired_share": (rounds.get("paired", 0) + rounds.get("allreduced", 0)) / total
            if total
            else 0.0,
            "inner_steps": steps,
            "schedule_step": end[name]["schedule_step"],
            "steps_per_s": steps / wall_s,
            "service_rate": end[name]["throughput"],
            "partner_distance_mean": end[name]["spread_rms_mean"],
            "round_s": end[name]["round_s"],
            "distance_samples": distances[name],
            "steps_at_samples": steps_at[name],
            # per outer step: (its inner steps, the stage's usual it was compared with);
            # equal replicas should read about 1 (swarm.outer.scale_by_steps)
            "steps_and_usual": steps_and_usual(swarm.log_path(everyone[name])),
        }
    stages = {}
    for stage_no, members in ((1, list(stage1)), (2, list(stage2))):
        means = [d for n in members if (d := replicas[n]["partner_distance_mean"])]
        stages[str(stage_no)] = {
            "spread": statistics.mean(samples[str(stage_no)]),
            "spread_samples": samples[str(stage_no)],
            "partner_distance_mean": statistics.mean(means) if means else None,
            "min_paired_share": min(replicas[n]["paired_share"] for n in members),
            "schedule_place_range": max(replicas[n]["schedule_step"] for n in members)
            - min(replicas[n]["schedule_step"] for n in members),
            # the stage's usual steps over a replica's own, per outer step past its first:
            # the factor its displacement was scaled by when above 1 (at most 4)
            "usual_over_steps": sorted(
                usual / steps
                for n in members
                for steps, usual in replicas[n]["steps_and_usual"][1:]
                if steps
            ),
        }
    fast = statistics.mean(replicas[n]["steps_per_s"] for n in ("fast-a", "fast-b"))
    result = {
        "schedule": schedule,
        "wall_s": round(wall_s, 1),
        "sampled_s": sampled_s,
        "eval_loss": eval_loss,
        "head_route_left_out": left_out,
        "replicas": replicas,
        "stages": stages,
        "fast_over_slowest_steps": fast / max(1e-9, replicas["slow4"]["steps_per_s"]),
        "speed_ratios": {
            n: replicas["fast-a"]["service_rate"] / max(1e-9, replicas[n]["service_rate"])
            for n in SPEEDS
        },
    }
    s1, s2 = stages["1"], stages["2"]
    # DiLoCo: one copy of the slow weights per stage after every round, no spread
    result["spread_ratio_to_equal"] = s1["spread"] / s2["spread"] if s2["spread"] else None
    # the second half alone: past the first rounds, where the equal stage's spread is
    # still tiny and the ratio reads high (bench/sync_unequal_sim.py)
    half = len(s1["spread_samples"]) // 2
    if half and s2["spread"]:
        late = [statistics.mean(s["spread_samples"][half:]) for s in (s1, s2)]
        result["spread_ratio_second_half"] = late[0] / late[1]
        result["spread_ratio_interval"] = ratio_interval(
            s1["spread_samples"], s2["spread_samples"], random.Random(0)
        )
    log(
        f"{schedule}: min paired share stage 1 {s1['min_paired_share']:.2f}, "
        f"stage 2 {s2['min_paired_share']:.2f}; spread ratio "
        f"{result.get('spread_ratio_to_equal') or math.nan:.2f} (90 % interval "
        f"{' to '.join(f'{x:.2f}' for x in result.get('spread_ratio_interval', [math.nan] * 2))}"
        "; second half "
        f"{result.get('spread_ratio_second_half', math.nan):.2f}); fast/slow4 steps "
        f"{result['fast_over_slowest_steps']:.1f}; stage 1 places {s1['schedule_place_range']:.1f} "
        "steps apart; equal stage's usual/own steps per round: "
        + ", ".join(f"{x:.2f}" for x in quantiles(s2["usual_over_steps"]))
        + " (10th, 50th, 90th percentile)"
    )
    return result


def quantiles(xs: list[float]) -> list[float]:
    """The 10th, 50th and 90th percentiles of ``xs`` (nan when fewer than two)."""
    if len(xs) < 2:
        return [math.nan] * 3
    deciles = statistics.quantiles(xs, n=10)
    return [deciles[0], statistics.median(xs), deciles[-1]]


def ratio_interval(
    unequal: list[float], equal: list[float], rng: random.Random, draws: int = 2000
) -> tuple[float, float]:
    """A 90 % bootstrap interval for the ratio of two stages' mean spreads: the samples
    (one a round, both stages taken together) drawn again with replacement ``draws``
    times, and the 5th and 95th percentiles of the ratios of the drawn means. A run holds
    about ten rounds, whose ratios swing several-fold, so its one figure says less than it
    seems; this says how much less."""
    pairs = list(zip(unequal, equal, strict=True))
    ratios = []
    for _ in range(draws):
        drawn = rng.choices(pairs, k=len(pairs))
        den = sum(b for _, b in drawn)
        if den > 0:
            ratios.append(sum(a for a, _ in drawn) / den)
    if not ratios:
        return math.nan, math.nan
    ratios.sort()
    return ratios[int(0.05 * (len(ratios) - 1))], ratios[int(0.95 * (len(ratios) - 1))]


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    names = list(SPEEDS) + list(CONTROL)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    width = 0.8 / len(runs)
    for i, run_ in enumerate(runs):
        xs = [j + i * width for j in range(len(names))]
        axes[0].bar(
            xs, [run_["replicas"][n]["paired_share"] for n in names], width, label=run_["schedule"]
        )
        axes[1].bar(
            xs, [run_["replicas"][n]["steps_per_s"] for n in names], width, label=run_["schedule"]
        )
    titles = ((axes[0], "share of rounds met (paired or all-reduced)"), (axes[1], "steps/s"))
    for ax, title in titles:
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))])
        ax.set_xticklabels(names, rotation=30, fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8, loc="lower left" if ax is axes[0] else "best")
    axes[0].axhline(0.9, color="grey", lw=0.8, ls="--")
    for i, run_ in enumerate(runs):
        for stage, style in (("1", "-"), ("2", ":")):
            samples = run_["stages"][stage]["spread_samples"]
            # when each was taken (older results: one every sample_s, which mid-round
            # sampling only approximates)
            at_s = run_.get("sampled_s") or [
                (k + 1) * result["settings"]["sample_s"] for k in range(len(samples))
            ]
            minutes = [t / 60 for t in at_s]
            unequal = stage == "1" and run_["schedule"] not in EQUAL_STAGE1
            label = f"{run_['schedule']}, stage {stage}" + (" (unequal)" if unequal else "")
            axes[2].semilogy(
                minutes, [max(s, 1e-6) for s in samples], style, color=f"C{i}", label=label
            )
    axes[2].set_title("spread: RMS of slow weights from the stage mean")
    axes[2].set_xlabel("minutes")
    axes[2].legend(fontsize=7)
    fig.suptitle(
        "Stage 1: two fast, one 2x and one 4x slower (clock_equal: none slowed); stage 2: four"
        f" equal; {result['settings']['max_in_flight']} microbatches in flight a head"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="measured minutes per schedule")
    p.add_argument(
        "--schedules", default="steps,clock,clock_unscaled", help="variants: " + ",".join(VARIANTS)
    )
    p.add_argument("--outer-steps", type=int, default=10, help="H (default 10)")
    p.add_argument("--step-samples", type=int, default=256, help="samples per inner step")
    p.add_argument("--round-s", type=float, default=64.0, help="clock period (0: derived)")
    p.add_argument("--max-in-flight", type=int, default=8)
    p.add_argument("--sample-s", type=float, default=60.0, help="seconds between spread samples")
    p.add_argument("--quick", action="store_true", help="a few minutes, small H: the test's")
    add_set_arg(p, "a setting for every node over the benchmark's (e.g. node.device=cuda)")
    add_output_args(p, "sync_unequal")
    p.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON in --out")
    args = p.parse_args(argv)
    if args.quick:
        args.minutes, args.outer_steps, args.step_samples, args.round_s = 3.0, 4, 16, 0.0
        args.sample_s = 15.0
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    name = args.name or ("sync_unequal-quick" if args.quick else "sync_unequal")
    if args.replot:
        result: dict[str, Any] = json.loads((args.out / f"{name}.json").read_text())
        plot(result, args.out / f"{name}.png")
        return result
    runs: list[dict[str, Any]] = []
    result = {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "runs": runs}
    result["settings"]["out"] = str(args.out)
    with tempfile.TemporaryDirectory(prefix="sync-unequal-") as tmp:
        # a variant may be named more than once (repeated runs of it, side by side), and
        # each finished run is written at once, so a later failure loses only its own
        for i, schedule in enumerate(args.schedules.split(",")):
            log_dir = Path(tmp) / f"{i}-{schedule}"
            log_dir.mkdir()
            runs.append(run(schedule, args, log_dir))
            save(result, args.out, name, None)
    save(result, args.out, name, None if args.no_plot else plot)
    return result


if __name__ == "__main__":
    main()
