"""Replicas of unequal speed in one process: what each part of the clock schedule's rule buys.

``bench/sync_unequal.py`` runs real processes, but a ten-minute run holds only about ten
rounds of four replicas, and its spread ratio moved from 1.3 to 2.4 between runs of the same
code: too few rounds and pairings to tell the variants of the rule apart. This runs the same
shape of swarm in one process, deterministically, on the daemon's own runners and outer
steps (``bench/convergence_sim.py``), so that many rounds and seeds fit:

- block stage 1: four replicas, two at full speed, one 2x and one 4x slower (each
  microbatch goes to a replica drawn in proportion to its speed, as routing by throughput
  shares the work, so a fast replica takes about four times the slowest one's inner steps);
- block stage 2: four equal replicas, the control;
- NoLoCo rounds on the clock: every ``--round`` global steps for everyone, paired at random,
  with the stage's usual steps per round derived as the daemon derives it.

Variants (``sync.*`` settings): ``shared`` (the default rule: pseudo-gradients pooled per
inner step and the place in the learning-rate schedule averaged with the partner),
``own_lr`` (pooled, each replica on its own schedule), ``unpooled`` (the schedule shared,
pseudo-gradients as they are), ``published`` (the published rule on the clock: neither),
``decayed`` (the default with a slow replica's inner momentum decayed by the steps it fell
short, ``sync.decay_momentum``), ``usual_place`` (the default with each place set at an
outer step by the stage's usual steps, not the replica's own, ``sync.place_by_usual_steps``),
``cap2`` and ``cap1`` (the default with a pair's pseudo-gradient enlarged at most 2x, or
never, for the steps it fell short: ``sync.max_step_scale``, 4 by default), ``across``
(the default rule, each pair one of the two faster replicas and one of the two slower ones,
at random, so no round pairs the fast together) and ``equal`` (the default rule with stage
1's four replicas at full speed: the spread ratio compares stages at two depths of the
model, so this is what it reads with no unequal replica at all).
For each: the spread of the slow weights (RMS distance of each replica from its stage's
mean) after every round, stage 1 against stage 2, and the final eval loss; same seeds, same
data and same routes for every variant. With NoLoCo also, per round and stage, the *pair
gap*: half the RMS difference between the two pairs' mean moves of their slow weights, over
the pairs' mean move (a live run showed each stage's replicas sitting in two groups, those
of its last pairs), and for stage 1 whether the round split it fast-with-fast and
slow-with-slow; the summary has each round's gap over the seeds (``gap_by_round``). And
per round and stage, the share of the spread that lies along the stage's mean move of its
slow weights that round, with each stage-1 replica's lead along it (``progress_split``):
whether the unequal stage spreads by some replicas getting ahead on the common path, or
across it.

Writes ``bench/results/sync_unequal_sim.json`` and ``.png``.
Usage: ``python -m bench.sync_unequal_sim [--rounds 30] [--seeds 0,1,2] [--in-flight 8]``
(``--in-flight``: the live pipeline's staleness, emulated); ``--quick`` for the seconds-long
smoke run the tests use.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench import save
from bench.convergence_sim import SimulatedSwarm
from node.config import resolve_config
from swarm.outer import rms_distance

RESULTS = Path(__file__).parent / "results"
SPEEDS = [1.0, 1.0, 0.5, 0.25]
"""Stage 1's replicas: relative speeds (two fast, one 2x and one 4x slower)."""
VARIANTS = {
    "shared": {},
    "own_lr": {"sync.share_schedule": "false"},
    "unpooled": {"sync.scale_by_steps": "false"},
    "published": {"sync.share_schedule": "false", "sync.scale_by_steps": "false"},
    "decayed": {"sync.decay_momentum": "true"},
    "usual_place": {"sync.place_by_usual_steps": "true"},
    "cap2": {"sync.max_step_scale": "2"},
    "cap1": {"sync.max_step_scale": "1"},
    "across": {},
    "equal": {},
}
ACROSS = frozenset({"across"})
"""Variants whose pairs each join one of stage 1's two faster replicas to one of its two
slower ones (``SimulatedSwarm.across``): no round pairs the fast two together."""
EQUAL_STAGE1 = frozenset({"equal"})
"""Variants whose stage 1 runs four full-speed replicas, the default rule: the null for the
spread ratio, which compares two stages at different depths of the model and so need not
read 1 even when both stages' replicas are equal."""
SETTINGS = {
    "swarm.num_block_stages": "2",
    "sync.method": "noloco",
    "sync.outer_steps": "10",
    "data.batch_size": "8",
    "data.seq_len": "64",
    "train.eval_batches": "8",
}
"""Microbatches of 8 x 64 tokens, H = 10. With one microbatch per inner step
(``--step-samples 8``) and 8 global steps a round, a fast replica takes about 12 inner steps
a round and the 4x slower one about 3, as in the live benchmark; ``--step-samples 32`` with
``--round 33`` keeps those counts with steps four times larger."""


def log(msg: str) -> None:
    print(f"[sync_unequal_sim {time.strftime('%X')}] {msg}", file=sys.stderr, flush=True)


def run(variant: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    extra = {"node.threads": str(args.threads), "train.step_samples": str(args.step_samples)}
    if args.total_steps:
        extra["train.total_steps"] = str(args.total_steps)
        extra["train.warmup_steps"] = str(args.warmup_steps)
    extra["sync.method"] = args.method
    if args.method == "diloco":  # the variant's choice of schedule, by DiLoCo's own switch
        extra["sync.diloco_share_schedule"] = VARIANTS[variant].get("sync.share_schedule", "true")
    config = resolve_config(overrides={**SETTINGS, **VARIANTS[variant], **extra})
    # the null routes stage 1 as stage 2 is routed (a permutation a step), so that the
    # stages differ only in depth; with all four equally fast, no round splits the stage
    speeds = {} if variant in EQUAL_STAGE1 else {1: SPEEDS}
    fast = frozenset(i for i, v in enumerate(SPEEDS) if v == max(SPEEDS)) if speeds else None
    swarm = SimulatedSwarm(
        config,
        4,
        seed,
        speeds=speeds,
        clock_every=args.round,
        in_flight=args.in_flight,
        across=variant in ACROSS,
    )
    spreads: dict[str, list[float]] = {"1": [], "2": []}
    gaps: dict[str, list[float]] = {"1": [], "2": []}
    along: dict[str, list[float]] = {"1": [], "2": []}  # share of the spread along the move
    leads: list[list[float]] = []  # stage 1's replicas' leads along it, round by round
    split: list[bool] = []  # stage 1's round paired the fast two and the slow two
    t0 = time.monotonic()
    for _ in range(args.rounds):
        before = {s: [r.phi.clone() for r in swarm.runners[int(s)]] for s in spreads}
        swarm.last_pairs.clear()  # a stage whose round did not come due leaves none
        for _ in range(args.round):
            swarm.global_step()
        for stage in spreads:
            spreads[stage].append(swarm.slow_spread(int(stage)))
            phis = [r.phi for r in swarm.runners[int(stage)]]
            moves = [p - b for p, b in zip(phis, before[stage], strict=True)]
            share, lead = progress_split(phis, moves)
            along[stage].append(share)
            if stage == "1":
                leads.append(lead)
            pairs = swarm.last_pairs.get(int(stage))
            if args.method == "noloco" and pairs and len(pairs) == 2:
                gaps[stage].append(pair_gap(moves, pairs))
                if stage == "1":
                    split.append(fast in {frozenset(p) for p in pairs})
    eval_loss = swarm.evaluate()
    mean = {stage: statistics.mean(values) for stage, values in spreads.items()}
    steps = {stage: [r.step for r in swarm.runners[stage]] for stage in (1, 2)}
    places = {stage: [r.schedule_step for r in swarm.runners[stage]] for stage in (1, 2)}
    out = {
        "variant": variant,
        "seed": seed,
        "spread": spreads,
        "spread_mean": mean,
        "spread_ratio": mean["1"] / mean["2"] if mean["2"] > 0 else None,
        "eval_loss": eval_loss,
        "inner_steps": {str(k): v for k, v in steps.items()},
        "schedule_places": {str(k): v for k, v in places.items()},
        "usual_steps": {str(k): v for k, v in swarm.ref_steps.items()},
        "pair_gap": gaps,
        "along_share": along,
        "stage1_lead": leads,
        "stage1_split": split,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    log(
        f"{variant}, seed {seed}: spread ratio {out['spread_ratio'] or 0:.2f} (stage 1 "
        f"{mean['1']:.2e}, stage 2 {mean['2']:.2e}), eval {eval_loss:.4f}, stage-1 steps "
        f"{steps[1]}, places {[round(p) for p in places[1]]}, {out['wall_s']:.0f} s"
    )
    return out


def pair_gap(moves: list[torch.Tensor], pairs: list[tuple[int, int]]) -> float:
    """How differently a round's two pairs moved their slow weights: half the RMS difference
    of the pairs' mean moves, over the mean RMS of those moves (0: the pairs moved alike)."""
    (a, b), (c, d) = pairs
    first, second = (moves[a] + moves[b]) / 2, (moves[c] + moves[d]) / 2
    size = (float(first.square().mean().sqrt()) + float(second.square().mean().sqrt())) / 2
    return rms_distance(first, second) / 2 / size if size > 0 else 0.0


def progress_split(
    phis: list[torch.Tensor], moves: list[torch.Tensor]
) -> tuple[float, list[float]]:
    """How much of a stage's spread lies along the round's mean move of its slow weights,
    and each replica's lead along it. Returns the share of the replicas' squared distances
    from their mean that lies along the mean move (0 to 1; a deviation in a random
    direction has about one over the number of weights), and each replica's distance ahead
    of the mean along the move, in rounds' moves (a replica that moved twice the mean, its
    partners not at all, leads by 1.5 after one round)."""
    move = torch.stack(moves).mean(0)
    length = float(move.norm())
    centre = torch.stack(phis).mean(0)
    devs = [p - centre for p in phis]
    total = sum(float(d.square().sum()) for d in devs)
    if length == 0 or total == 0:
        return 0.0, [0.0] * len(phis)
    unit = move / length
    on = [float(d @ unit) for d in devs]
    return sum(x * x for x in on) / total, [x / length for x in on]


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary = {}
    for variant in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == variant]
        ratios = [r["spread_ratio"] for r in mine]
        summary[variant] = {
            "spread_ratio_mean": None if None in ratios else statistics.mean(ratios),
            "spread_ratio": ratios,
            "spread_unequal_mean": statistics.mean(r["spread_mean"]["1"] for r in mine),
            "spread_equal_mean": statistics.mean(r["spread_mean"]["2"] for r in mine),
            "eval_loss_mean": statistics.mean(r["eval_loss"] for r in mine),
        }
        if all("along_share" in r for r in mine):
            summary[variant]["along_share_by_round"] = round_means(mine, "along_share")
            rounds = len(summary[variant]["along_share_by_round"]["1"])
            summary[variant]["stage1_lead_by_round"] = [
                [statistics.mean(r["stage1_lead"][i][k] for r in mine) for k in range(len(SPEEDS))]
                for i in range(rounds)
            ]
        gaps = {s: [g for r in mine for g in r["pair_gap"][s]] for s in ("1", "2")}
        if gaps["1"] and gaps["2"]:
            by_kind: dict[bool, list[float]] = {True: [], False: []}  # split or mixed
            for r in mine:
                for gap, was_split in zip(r["pair_gap"]["1"], r["stage1_split"], strict=True):
                    by_kind[was_split].append(gap)
            split, mixed = by_kind[True], by_kind[False]
            summary[variant]["pair_gap_mean"] = {s: statistics.mean(g) for s, g in gaps.items()}
            summary[variant]["stage1_pair_gap_split"] = statistics.mean(split) if split else None
            summary[variant]["stage1_pair_gap_mixed"] = statistics.mean(mixed) if mixed else None
            summary[variant]["pair_gap_by_round"] = gap_by_round(mine)
    return summary


def round_means(runs: list[dict[str, Any]], key: str) -> dict[str, list[float]]:
    """Per stage, each round's figure ``key`` as the mean over ``runs`` (seeds), over the
    rounds every run has for both stages."""
    rounds = min(len(r[key][s]) for r in runs for s in ("1", "2"))
    return {
        s: [statistics.mean(r[key][s][i] for r in runs) for i in range(rounds)] for s in ("1", "2")
    }


def gap_by_round(runs: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each round's pair gap, per stage, as the mean over ``runs`` (seeds), and the ratio of
    the unequal stage's to the equal one's: whether the unequal stage's excess is there
    throughout or in some part of the run (the warm-up, say)."""
    out = round_means(runs, "pair_gap")
    out["ratio"] = [a / b if b > 0 else 0.0 for a, b in zip(out["1"], out["2"], strict=True)]
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(result["summary"])
    method = {"noloco": "NoLoCo", "diloco": "DiLoCo"}[result["settings"].get("method", "noloco")]
    along = method == "NoLoCo" and all(
        "along_share_by_round" in result["summary"][v] for v in variants
    )
    fig, axes = plt.subplots(1, 3 if along else 2, figsize=(19 if along else 13, 4.2))
    null = ", equal: none slowed" if EQUAL_STAGE1 & set(variants) else ""
    fig.suptitle(
        f"{method} on the clock, one process: stage 1 two fast, one 2x and one 4x slower{null}"
    )
    if method == "DiLoCo":  # one slow-weight copy per stage after every round: no spread
        _plot_places_and_loss(result, variants, axes)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return
    for i, variant in enumerate(variants):
        mine = [r for r in result["runs"] if r["variant"] == variant]
        rounds = range(1, len(mine[0]["spread"]["1"]) + 1)
        for stage, style in (("1", "-"), ("2", ":")):
            mean = [
                statistics.mean(v) for v in zip(*(r["spread"][stage] for r in mine), strict=True)
            ]
            unequal = stage == "1" and variant not in EQUAL_STAGE1
            label = f"{variant}, stage {stage}" + (" (unequal)" if unequal else " (equal)")
            axes[0].semilogy(
                rounds, [max(m, 1e-7) for m in mean], style, color=f"C{i}", label=label
            )
        ratios = result["summary"][variant]["spread_ratio"]
        axes[1].scatter([i] * len(ratios), ratios, color=f"C{i}", alpha=0.6)
        axes[1].bar(i, result["summary"][variant]["spread_ratio_mean"], color=f"C{i}", alpha=0.3)
    axes[0].set_title("slow weights' spread after each round (mean over seeds)")
    axes[0].set_xlabel("round")
    axes[0].legend(fontsize=7)
    axes[1].axhline(2.0, color="grey", lw=0.8, ls="--")
    axes[1].set_xticks(range(len(variants)))
    axes[1].set_xticklabels(
        [f"{v}\neval {result['summary'][v]['eval_loss_mean']:.3f}" for v in variants]
    )
    axes[1].set_title("spread ratio, unequal stage / equal stage (each seed, and the mean)")
    if along:
        for i, variant in enumerate(variants):
            shares = result["summary"][variant]["along_share_by_round"]
            for stage, style in (("1", "-"), ("2", ":")):
                rounds = range(1, len(shares[stage]) + 1)
                axes[2].plot(
                    rounds, shares[stage], style, color=f"C{i}", label=f"{variant}, stage {stage}"
                )
        axes[2].set_title("share of the spread along the round's mean move (mean over seeds)")
        axes[2].set_xlabel("round")
        axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_places_and_loss(result: dict[str, Any], variants: list[str], axes: Any) -> None:
    """DiLoCo: stage 1's inner steps and places in the schedule at the end (the first
    seed), and each seed's eval loss per variant."""
    first = [next(r for r in result["runs"] if r["variant"] == v) for v in variants]
    names = ["fast", "fast", "2x slower", "4x slower"]
    width = 0.8 / (len(variants) + 1)
    xs = range(len(names))
    axes[0].bar(xs, first[0]["inner_steps"]["1"], width, color="grey", label="inner steps")
    for i, run_ in enumerate(first):
        places = run_["schedule_places"]["1"]
        label = f"place in the schedule, {run_['variant']}"
        axes[0].bar([x + (i + 1) * width for x in xs], places, width, color=f"C{i}", label=label)
    axes[0].set_xticks([x + width * len(variants) / 2 for x in xs])
    axes[0].set_xticklabels(names)
    axes[0].set_title(f"stage 1 at the end (seed {first[0]['seed']})")
    axes[0].legend(fontsize=7)
    for i, variant in enumerate(variants):
        losses = [r["eval_loss"] for r in result["runs"] if r["variant"] == variant]
        axes[1].scatter([i] * len(losses), losses, color=f"C{i}", alpha=0.7)
        axes[1].bar(i, statistics.mean(losses), color=f"C{i}", alpha=0.3)
    axes[1].set_ylim(min(r["eval_loss"] for r in result["runs"]) * 0.98)
    axes[1].set_xticks(range(len(variants)))
    axes[1].set_xticklabels(
        [f"{v}\neval {result['summary'][v]['eval_loss_mean']:.3f}" for v in variants]
    )
    axes[1].set_title("eval loss at the end (each seed, and the mean)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--round", type=int, default=8, help="global steps per round")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument(
        "--method",
        default="noloco",
        choices=("noloco", "diloco"),
        help="diloco: every round all-reduces, so the figures are eval loss and places",
    )
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument(
        "--step-samples",
        type=int,
        default=8,
        help="samples per inner step (8: one microbatch; the live benchmark's steps are 256, "
        "where a displacement is mostly the gradient's direction rather than its noise)",
    )
    p.add_argument(
        "--total-steps",
        type=int,
        default=0,
        help="the learning-rate schedule's length (0: the daemon's, 3000; shorter: the run "
        "reaches the decay, where replicas on their own schedules stand furthest apart)",
    )
    p.add_argument("--warmup-steps", type=int, default=20, help="with --total-steps")
    p.add_argument(
        "--in-flight",
        type=int,
        default=1,
        help="microbatches in flight per head replica, the pipeline's staleness as "
        "bench.convergence_sim emulates it (1: synchronous; at 8 with 32-sample steps a "
        "gradient lands a step or two after its forward, staler than the live benchmark's "
        "8 in flight with 256-sample steps, at most one step)",
    )
    p.add_argument("--name", default="", help="results file stem (default sync_unequal_sim)")
    p.add_argument("--quick", action="store_true", help="seconds: the test's smoke run")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.seeds = 3, "0"
        args.threads = 1  # a test shares the machine: two threads there only spin
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    runs = [
        run(variant, int(seed), args)
        for seed in args.seeds.split(",")
        for variant in args.variants.split(",")
    ]
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    summary = summarise(runs)
    result = {
        "settings": {**SETTINGS, **settings, "sync.method": args.method, "speeds": SPEEDS},
        "runs": runs,
        "summary": summary,
    }
    for variant, s in summary.items():
        log(
            f"{variant}: spread ratio {s['spread_ratio_mean']} {s['spread_ratio']}, "
            f"eval loss {s['eval_loss_mean']:.4f}"
            + (
                f", pair gap {s['pair_gap_mean']} (stage 1 split "
                f"{s['stage1_pair_gap_split']}, mixed {s['stage1_pair_gap_mixed']})"
                if "pair_gap_mean" in s
                else ""
            )
        )
    name = args.name or ("sync_unequal_sim-quick" if args.quick else "sync_unequal_sim")
    save(result, args.out, name, None if args.no_plot else plot)
    return result


if __name__ == "__main__":
    main()
