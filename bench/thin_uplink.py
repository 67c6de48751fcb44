"""A volunteer on a very thin uplink: the pipeline's in-flight window, fixed against adaptive.

A public head and a NATed block node (``node join``, real processes; the block node behind a
router namespace whose uplink is a token bucket of ``--mbit`` Mbit/s with a 1 s queue,
``tests.netns.Lab.cap_router_uplink``, its sockets on CUBIC with the node's own pacing, as on
a distribution that does not allow BBR). A microbatch's activations are 16 x 128 x 128
values, 512 kB in bf16, and the block node uploads one output and one gradient per
microbatch: at 2 Mbit/s that is about 4 s of uplink per microbatch. Six in flight
(``train.window = fixed``) queue about 25 s of uploads: a hop waits past its 10 s deadline and
a microbatch past its 30 s one, the head re-issues what is already queued, and the swarm
stops training. The adaptive window (``swarm.window``, capped at ``train.max_in_flight``)
sees the round trip grow, keeps fewer in flight and trains at the link's pace.

What the adaptive default costs where links are not thin: the head and 3 block stages of
``bench/wan.py`` (100 Mbit/s token buckets, 0 and 50 ms one-way), each policy bounded by
the default ``train.max_in_flight`` (6), ``--fat-seeds`` seeds, tokens/s after a warm-up and
the eval loss once ``--tokens`` are spent (``bench.wan.run``).

Where the default stops working: ``--floor 1 0.5`` runs the defaults (adaptive window) once
at each of these thinner uplinks, added under ``floor`` with the commit it ran (earlier
commits' runs stay, to be read side by side). With ``--against REV`` each floor uplink is
run on that commit too (checked out as a worktree, ``bench.ab.this_and``), before this
checkout, in the same sitting. With ``--pacing auto off`` each floor uplink is run with the
block node's own pacing (``net.uplink_pacing``; ``auto`` engages it on CUBIC) and then
without it: plain CUBIC. With ``--latency-ms L`` every node of a floor run delays what it
sends by ``L`` ms (``net.inject_latency_s``; this kernel has no netem), so each request's
round trip is ``2 L`` longer. Each floor run records what the block node's pacer measured
of its uplink: when it first engaged (its log line) and every 5 s after.

On the thin uplink, for each policy in turn, ``--rounds`` rounds: from the moment the block
node serves, the head's counters for ``--measure-s`` seconds (microbatches completed,
re-issued, dropped), its window (sampled every 5 s) and the codec the block node ended
with. Writes
``bench/results/thin_uplink.json`` and ``thin_uplink.png`` (microbatches completed over
time); ``--rounds 0`` or ``--fat-seeds 0`` keeps that part's recorded runs.

Usage: ``python -m bench.thin_uplink [--rounds 2] [--mbit 2] [--measure-s 120]`` (as root).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.ab import inside, this_and

RESULTS = Path(__file__).parent / "results"
POLICIES = ("fixed", "adaptive")


def say(text: str) -> None:
    print(f"[thin_uplink {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def live(
    window: str | None,
    mbit: float,
    measure_s: float,
    logs: Path,
    pacing: str = "auto",
    latency_ms: float = 0.0,
) -> dict[str, Any]:
    """One swarm with ``train.window = window`` on the head (None: the default), the block
    node behind an ``mbit`` uplink with ``net.uplink_pacing = pacing``, each node delaying
    what it sends by ``latency_ms`` (``net.inject_latency_s``: a round trip of twice that);
    the nodes' logs in ``logs`` (``head.log``, ``natted.log``)."""
    from bench.uplink_live import first_pace, natted_swarm
    from tests.test_nat import status_of

    latency = (f"net.inject_latency_s={latency_ms / 1e3:g}",) if latency_ms else ()
    head_settings = (*latency, *(() if window is None else (f"train.window={window}",)))
    node_settings = (f"net.uplink_pacing={pacing}", *latency)
    with natted_swarm(mbit, logs, head_settings, node_settings) as (public, natted):
        t0 = time.monotonic()
        sizes: list[int] = []
        timeline: list[tuple[float, int]] = []
        pacer: list[float] = []
        while (elapsed := time.monotonic() - t0) < measure_s:
            time.sleep(min(5.0, measure_s - elapsed))
            st = status_of(public)
            sizes.append(int(st["window"]["size"]))
            done = int(st["counters"].get("microbatches_completed", 0))
            timeline.append((round(time.monotonic() - t0, 1), done))
            pacer_now = status_of(natted)["tcp_congestion"]["pacing"] or {}
            if pacer_now.get("pacing"):
                pacer.append(round(pacer_now["capacity_bytes_per_s"] * 8 / 1e6, 2))
        elapsed = time.monotonic() - t0
        final = status_of(public)
        counters = final["counters"]
        node = status_of(natted)
        wire = node["wire"]
    return {
        "window": final["window"]["policy"],
        "mbit": mbit,
        "pacing": pacing,
        "latency_ms": latency_ms,
        "measure_s": round(elapsed, 1),
        "completed": int(counters.get("microbatches_completed", 0)),
        "microbatches_per_s": int(counters.get("microbatches_completed", 0)) / elapsed,
        "retried": int(counters.get("microbatches_retried", 0)),
        "dropped": int(counters.get("microbatches_dropped", 0)),
        "drop_notices": int(counters.get("drop_notices", 0)),
        "not_sent": int(node["counters"].get("send_failed_uplink_busy", 0)),
        "window_mean": statistics.fmean(sizes),
        "window_sizes": sizes,
        "codec": wire["codec"],
        "link_mbit": wire["link_mbps"],
        "timeline": timeline,
        "pacer_first_mbit": first_pace(logs / "natted.log"),
        "pacer_mbit": pacer,
        "relay_attaches": final["relay"].get("attaches", {}).get("ok", 0),
    }


def floor_runs(
    uplinks: list[float],
    measure_s: float,
    against: str | None,
    logs: Path,
    pacings: tuple[str, ...] = ("auto",),
    latency_ms: float = 0.0,
) -> list[dict[str, Any]]:
    """The default at each of ``uplinks``, under each of ``pacings`` in turn
    (``net.uplink_pacing`` on the block node), with ``latency_ms`` one way, on
    ``against``'s checkout first when given, then on this one; each run names its commit,
    its pacing and its latency."""
    runs = []
    with this_and(against) as checkouts:
        for mbit in uplinks:
            for pacing in pacings:
                for commit, tree in checkouts:
                    with inside(tree):
                        at = logs / f"floor-{mbit:g}-{pacing}-{latency_ms:g}ms-{commit}"
                        run = live(None, mbit, measure_s, at, pacing, latency_ms)
                    run["commit"] = commit
                    runs.append(run)
    return runs


def fat_links(seeds: int, tokens: int, logs: Path) -> list[dict[str, Any]]:
    """``bench.wan``'s swarm at 0 and 50 ms, fixed against adaptive, both bounded by the
    default ``train.max_in_flight``."""
    from bench.wan import Variant
    from bench.wan import run as wan_run

    rows = []
    for seed in range(seeds):
        (logs / f"seed{seed}").mkdir(parents=True, exist_ok=True)
        for latency in (0, 50):
            for window in POLICIES:
                v = Variant(f"{latency}ms", latency, 100, window=window, seed=seed)
                r = wan_run(v, tokens, 10.0, logs / f"seed{seed}")
                rows.append({k: r[k] for k in FAT_FIELDS})
                say(
                    f"fat links, seed {seed}, {latency} ms, window {window}: "
                    f"{r['tokens_per_s']:,.0f} tokens/s, eval {r['eval_loss']:.3f}, "
                    f"window {r['window_mean']:.1f} on average"
                )
    return rows


FAT_FIELDS = (
    "latency_ms",
    "window",
    "seed",
    "max_in_flight",
    "tokens_per_s",
    "eval_loss",
    "window_mean",
    "tokens_at_eval",
)


def plot(result: dict[str, Any], path: Path) -> None:
    """Microbatches completed over time on the thin uplink, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colours = {"fixed": "tab:red", "adaptive": "tab:green"}
    for r in result["runs"]:
        xs = [0.0] + [t for t, _ in r["timeline"]]
        ys = [0] + [done for _, done in r["timeline"]]
        label = f"{r['window']} window, round {r['round'] + 1}"
        ax.plot(xs, ys, color=colours.get(r["window"], "grey"), label=label)
    ax.set_xlabel("seconds since the NATed block node began to serve")
    ax.set_ylabel("microbatches completed at the head")
    ax.set_title(f"A block node behind a {result['mbit']:g} Mbit/s uplink (1 s queue)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--mbit", type=float, default=2.0)
    p.add_argument("--measure-s", type=float, default=120.0)
    p.add_argument("--fat-seeds", type=int, default=2, help="0: skip the fat-link runs")
    p.add_argument("--tokens", type=int, default=300_000, help="token budget of a fat-link run")
    p.add_argument(
        "--floor",
        type=float,
        nargs="*",
        default=[],
        help="thinner uplinks (Mbit/s) to run the adaptive default at, once each",
    )
    p.add_argument(
        "--against", metavar="REV", help="run each floor uplink on this commit too, first"
    )
    p.add_argument(
        "--pacing",
        nargs="+",
        default=["auto"],
        choices=("auto", "on", "off"),
        help="the block node's net.uplink_pacing in the floor runs, each in turn",
    )
    p.add_argument(
        "--latency-ms",
        type=float,
        default=0.0,
        help="one-way latency every node adds in the floor runs (net.inject_latency_s)",
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="thin_uplink-"))
    say(f"the nodes' logs: {logs}")
    path = args.out / "thin_uplink.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    # a part not run this time (--rounds 0 or --fat-seeds 0) keeps its recorded runs
    fat = fat_links(args.fat_seeds, args.tokens, logs / "fat") if args.fat_seeds else []
    fat = fat or previous.get("fat_links", [])
    runs = [] if args.rounds else previous.get("runs", [])
    for rnd in range(args.rounds):
        for window in POLICIES:
            run = live(window, args.mbit, args.measure_s, logs / f"{rnd}-{window}")
            run["round"] = rnd
            runs.append(run)
            say(
                f"round {rnd + 1}/{args.rounds} window {window}: {run['completed']} microbatches "
                f"in {run['measure_s']:.0f} s ({run['microbatches_per_s']:.2f}/s), "
                f"{run['retried']} re-issued, {run['dropped']} dropped, window "
                f"{run['window_mean']:.1f} on average, codec {run['codec']}"
            )
    floor = floor_runs(
        args.floor, args.measure_s, args.against, logs, tuple(args.pacing), args.latency_ms
    )
    for run in floor:
        say(
            f"adaptive at {run['mbit']:g} Mbit/s, {run['latency_ms']:g} ms, "
            f"pacing {run['pacing']}: "
            f"{run['completed']} microbatches in "
            f"{run['measure_s']:.0f} s, {run['retried']} re-issued, {run['dropped']} dropped, "
            f"{run['not_sent']} not sent, {run['drop_notices']} drop notices, "
            f"window {run['window_mean']:.1f}, codec {run['codec']}, pacer first read "
            f"{run['pacer_first_mbit']} Mbit/s ({run['commit']})"
        )
    floor = previous.get("floor", []) + floor  # each run names its commit: kept side by side
    summary: dict[str, Any] = {
        w: {
            "microbatches_per_s_median": statistics.median(
                r["microbatches_per_s"] for r in runs if r["window"] == w
            ),
            "dropped_total": sum(r["dropped"] for r in runs if r["window"] == w),
        }
        for w in POLICIES
        if any(r["window"] == w for r in runs)
    }
    for latency in (0, 50):
        by = {
            w: [r for r in fat if r["latency_ms"] == latency and r["window"] == w] for w in POLICIES
        }
        if all(by.values()):
            summary[f"fat_{latency}ms"] = {
                "tokens_per_s_adaptive_over_fixed": statistics.median(
                    a["tokens_per_s"] / f["tokens_per_s"]
                    for a, f in zip(by["adaptive"], by["fixed"], strict=True)
                ),
                "eval_loss_fixed": [r["eval_loss"] for r in by["fixed"]],
                "eval_loss_adaptive": [r["eval_loss"] for r in by["adaptive"]],
                "window_mean_adaptive": [r["window_mean"] for r in by["adaptive"]],
            }
    result = {
        "mbit": args.mbit,
        "measure_s": args.measure_s,
        "summary": summary,
        "runs": runs,
        "fat_links": fat,
        "floor": floor,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    if runs:
        plot(result, args.out / "thin_uplink.png")
    return result


if __name__ == "__main__":
    main()
