"""SWARM's hop draw under a bounded window: what a slow replica and the draw itself cost.

Each of ``senders`` heads keeps ``window`` microbatches in flight (``train.max_in_flight``)
and sends each to one replica of the next stage. Here the stage is a set of FIFO servers
with exponential service times (the fast ones 1, one slow replica ``slow`` times longer),
the heads and the network cost nothing, and each finished microbatch is at once replaced by
a new one from the same head, so the figure is the stage's throughput in microbatches per
fast service time. Each head has its own router figures: a replica's queue as the ack of
that head's last microbatch there said (every head's jobs included), drained at its rate
since, so with several heads the figures of a replica miss what the other heads sent it
since. Three ways to choose, all from ``swarm.routing.route_weights`` itself:

- ``swarm``: SWARM's rule, a draw with a seeded ``random.Random`` in proportion to the
  weights;
- ``least``: the largest weight (a tie drawn at random): no draw;
- ``cut2``: ``train.route_cutoff = 2``, the draw after ``swarm.routing.cut_weights`` left out the
  replicas expected to take more than twice as long as the best (rechecked after
  ``RECHECK`` fast service times).

The question the live ``bench/devices.py`` run raised: a CPU replica 17 times slower than
two GPU replicas beside it left the head at 70 % of the all-GPU rate. This shows what the
draw costs there, at small windows most (a thin uplink runs at two in flight); what taking
the largest weight costs where several heads act on stale figures and herd onto one
replica (SWARM Parallelism, Ryabinin et al., ICML 2023, section 3.2, the reason for the
draw); and whether the cut keeps the best of both.

Writes ``bench/results/<--name>.json`` and ``.png`` (``routing_window``). Usage:
``python -m bench.routing_window [--jobs 50000] [--senders 1 4] [--windows 1 2 4 6 8 16]
[--slow 1 2 5 17]``; a few minutes.
"""

from __future__ import annotations

import argparse
import heapq
import random
from typing import Any

from bench import add_output_args, save
from protocol.messages import PeerRecord
from swarm.routing import PeerStats, cut_weights, route_weights

RULES = ("swarm", "least", "cut2")
CUT = {"cut2": 2.0}
"""``cutK``: ``train.route_cutoff = K``, ``swarm.routing.cut_weights`` itself: the draw
among the replicas whose expected time to finish our microbatch is at most K times the
best one's."""
RECHECK = 150.0
"""``cut_weights``' recheck in fast service times: the daemon's ``RECHECK_S`` (30 s) at
0.2 s a job. At 50 (10 s) eight senders of one in flight each recheck a replica 17 times
slower so often that it costs more than the draw (0.83 against 0.86 of the fast pair)."""


def choose(
    records: list[PeerRecord],
    stats: dict[str, PeerStats],
    now: float,
    rule: str,
    rng: random.Random,
) -> int:
    """The replica ``rule`` picks, from ``route_weights``' figures."""
    weights = route_weights(records, stats, now)
    if rule == "least":
        best = max(weights)
        return rng.choice([k for k, w in enumerate(weights) if w == best])
    if rule in CUT:
        weights = cut_weights(records, stats, weights, now, CUT[rule], RECHECK)
    return rng.choices(range(len(weights)), weights=weights)[0]


def simulate(
    services: list[float], window: int, rule: str, jobs: int, seed: int, senders: int = 1
) -> dict[str, Any]:
    """``jobs`` microbatches through servers of mean service times ``services`` from
    ``senders`` heads with ``window`` in flight each, every head choosing by ``rule`` from
    its own figures: throughput (jobs per unit time), each server's share of the jobs, and
    the mean time a job spent in the stage. A head hears a replica's queue only in the acks
    of its own microbatches, so with several heads its figure for a replica it has not sent
    to lately misses what the others sent there since."""
    rng = random.Random(seed)
    n = len(services)
    records = [
        PeerRecord(f"r{i}", "", 1, throughput=1 / s, ready=True) for i, s in enumerate(services)
    ]
    stats = [{r.peer_id: PeerStats() for r in records} for _ in range(senders)]
    at = [0] * n  # jobs at each server, queued or running, every head's
    free_at = [0.0] * n  # when each server has finished what it holds
    done: list[tuple[float, int, int, float]] = []  # (finish, server, head, sent) heap
    sent_to = [0] * n

    def send(now: float, head: int) -> None:
        i = choose(records, stats[head], now, rule, rng)
        free_at[i] = max(now, free_at[i]) + rng.expovariate(1 / services[i])
        at[i] += 1
        sent_to[i] += 1
        ack = stats[head][records[i].peer_id]  # its ack, at once: no transfer time
        ack.queue, ack.queue_s, ack.rate = at[i], now, 1 / services[i]
        heapq.heappush(done, (free_at[i], i, head, now))

    for _ in range(window):
        for head in range(senders):
            send(0.0, head)
    now, finished, time_in_stage = 0.0, 0, 0.0
    while finished < jobs:
        now, i, head, sent = heapq.heappop(done)
        at[i] -= 1
        finished += 1
        time_in_stage += now - sent
        send(now, head)  # the router hears nothing of a finish: the result goes on down the line
    return {
        "throughput": finished / now,
        "shares": [k / sum(sent_to) for k in sent_to],
        "mean_time_in_stage": time_in_stage / finished,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Each number of heads, window and slowness: each rule with the fast two alone and with
    the slow third beside them (the same seed)."""
    rows = []
    for senders in args.senders:
        for window in args.windows:
            for slow in args.slow:
                rows.append(row(senders, window, slow, args.jobs, args.seed))
    return {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}


def row(senders: int, window: int, slow: float, jobs: int, seed: int) -> dict[str, Any]:
    """One configuration under every rule, printed as it ends."""
    got: dict[str, Any] = {
        "senders": senders,
        "window": window,
        "slow": slow,
        "capacity": 2 + 1 / slow,
    }
    for rule in RULES:
        alone = simulate([1.0, 1.0], window, rule, jobs, seed, senders)
        beside = simulate([1.0, 1.0, float(slow)], window, rule, jobs, seed, senders)
        got[rule] = {
            **beside,
            "fast_alone": alone["throughput"],
            "over_fast_alone": beside["throughput"] / alone["throughput"],
        }
    each = ", ".join(
        f"{rule} {got[rule]['throughput']:.3f} ({got[rule]['over_fast_alone']:.2f}x, "
        f"{got[rule]['shares'][2]:.1%} to it)"
        for rule in RULES
    )
    print(
        f"{senders} head(s) x {window:2d} in flight, third replica {slow:2g}x slower: {each}; "
        f"capacity {got['capacity']:.3f}",
        flush=True,
    )
    return got


STYLES = {"swarm": ("o-", "SWARM draw"), "least": ("s--", "largest"), "cut2": ("^-", "cut at 2x")}


def plot(result: dict[str, Any], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    slows = sorted({r["slow"] for r in rows})
    heads = sorted({r.get("senders", 1) for r in rows})
    fig, axes = plt.subplots(
        len(heads),
        len(slows),
        figsize=(3.2 * len(slows), 3.0 * len(heads) + 0.4),
        sharey=True,
        squeeze=False,
    )
    for axes_row, senders in zip(axes, heads, strict=True):
        for ax, slow in zip(axes_row, slows, strict=True):
            mine = [r for r in rows if r["slow"] == slow and r.get("senders", 1) == senders]
            windows = [r["window"] for r in mine]
            for rule in RULES:
                if rule not in mine[0]:
                    continue
                style, label = STYLES[rule]
                ax.plot(windows, [r[rule]["throughput"] for r in mine], style, label=label)
            ax.plot(
                windows,
                [r["swarm"]["fast_alone"] for r in mine],
                ":",
                color="grey",
                label="SWARM draw, fast two alone",
            )
            ax.axhline(2 + 1 / slow, color="grey", lw=0.8, label="capacity")
            ax.set_title(f"{senders} head(s), third {slow:g}x slower", fontsize=9)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("microbatches in flight per head")
        axes_row[0].set_ylabel("microbatches per fast service time")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--jobs", type=int, default=50_000, help="microbatches a configuration")
    p.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16])
    p.add_argument("--slow", type=float, nargs="+", default=[1.0, 2.0, 5.0, 17.0])
    p.add_argument("--senders", type=int, nargs="+", default=[1, 4], help="heads sending")
    p.add_argument("--seed", type=int, default=0)
    add_output_args(p, "routing_window")
    args = p.parse_args(argv)
    result = run(args)
    save(result, args.out, args.name or "routing_window", None if args.no_plot else plot)
    return result


if __name__ == "__main__":
    main()
