"""SWARM's hop draw under a bounded window: what a slow replica and the draw itself cost.

A head keeps ``window`` microbatches in flight (``train.max_in_flight``) and sends each to
one replica of the next stage. Here the stage is a set of FIFO servers with exponential
service times (the fast ones 1, one slow replica ``slow`` times longer), the head and the
network cost nothing, and each finished microbatch is at once replaced by a new one, so the
figure is the stage's throughput in microbatches per fast service time. Two ways to choose:

- ``swarm``: the daemon's rule, ``swarm.routing.route_weights`` itself, fed what the
  daemon's router is told: each microbatch's ack, here at once (the network costs nothing),
  carries the replica's jobs queued or running with it included and its service rate, and
  the router drains that queue at that rate until the next ack; a draw with a seeded
  ``random.Random`` in proportion to the weights;
- ``least``: the largest of the same weights (a tie drawn at random): the same figures,
  no weighted draw.

The question the live ``bench/devices.py`` run raised: a CPU replica 17 times slower than
two GPU replicas beside it left the head at 70 % of the all-GPU rate. If the rule under a
window of six were the cause, this would show it. It also shows what the random draw costs
against the least-loaded choice at small windows (a thin uplink runs at two in flight),
which SWARM accepts so that many senders with stale figures do not herd onto one replica
(SWARM Parallelism, Ryabinin et al., ICML 2023, section 3.2): a single sender with exact
figures, as here, is where the draw looks worst.

Writes ``bench/results/<--name>.json`` and ``.png`` (``routing_window``). Usage:
``python -m bench.routing_window [--jobs 100000] [--windows 1 2 4 6 8 16]
[--slow 1 2 5 17]``; under a minute.
"""

from __future__ import annotations

import argparse
import heapq
import random
from typing import Any

from bench import add_output_args, save
from protocol.messages import PeerRecord
from swarm.routing import PeerStats, route_weights

RULES = ("swarm", "least")


def simulate(services: list[float], window: int, rule: str, jobs: int, seed: int) -> dict[str, Any]:
    """``jobs`` microbatches through servers of mean service times ``services`` with
    ``window`` in flight, chosen by ``rule``: throughput (jobs per unit time), each
    server's share of the jobs, and the mean time a job spent in the stage."""
    rng = random.Random(seed)
    n = len(services)
    records = [
        PeerRecord(f"r{i}", "", 1, throughput=1 / s, ready=True) for i, s in enumerate(services)
    ]
    stats = {r.peer_id: PeerStats() for r in records}
    at = [0] * n  # our jobs at each server, queued or running
    free_at = [0.0] * n  # when each server has finished what it holds
    done: list[tuple[float, int, float]] = []  # (finish, server, sent) heap
    sent_to = [0] * n

    def send(now: float) -> None:
        weights = route_weights(records, stats, now)
        if rule == "swarm":
            i = rng.choices(range(n), weights=weights)[0]
        else:
            best = max(weights)
            i = rng.choice([k for k in range(n) if weights[k] == best])
        free_at[i] = max(now, free_at[i]) + rng.expovariate(1 / services[i])
        at[i] += 1
        sent_to[i] += 1
        ack = stats[records[i].peer_id]  # what its ack says, at once: no transfer time
        ack.queue, ack.queue_s, ack.rate = at[i], now, 1 / services[i]
        heapq.heappush(done, (free_at[i], i, now))

    for _ in range(window):
        send(0.0)
    now, finished, time_in_stage = 0.0, 0, 0.0
    while finished < jobs:
        now, i, sent = heapq.heappop(done)
        at[i] -= 1
        finished += 1
        time_in_stage += now - sent
        send(now)  # the router hears nothing of a finish: the result goes on down the line
    return {
        "throughput": finished / now,
        "shares": [k / sum(sent_to) for k in sent_to],
        "mean_time_in_stage": time_in_stage / finished,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Each window and slowness: each rule with the fast two alone and with the slow third
    beside them (the same seed)."""
    rows = []
    for window in args.windows:
        for slow in args.slow:
            row: dict[str, Any] = {"window": window, "slow": slow, "capacity": 2 + 1 / slow}
            for rule in RULES:
                alone = simulate([1.0, 1.0], window, rule, args.jobs, args.seed)
                beside = simulate([1.0, 1.0, float(slow)], window, rule, args.jobs, args.seed)
                row[rule] = {
                    **beside,
                    "fast_alone": alone["throughput"],
                    "over_fast_alone": beside["throughput"] / alone["throughput"],
                }
            rows.append(row)
            sw, least = row["swarm"], row["least"]
            print(
                f"window {window:2d}, third replica {slow:2g}x slower: swarm "
                f"{sw['fast_alone']:.3f} -> {sw['throughput']:.3f} ({sw['over_fast_alone']:.2f}x,"
                f" {sw['shares'][2]:.1%} to it), least {least['fast_alone']:.3f} -> "
                f"{least['throughput']:.3f} ({least['over_fast_alone']:.2f}x); capacity "
                f"{row['capacity']:.3f}",
                flush=True,
            )
    return {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}


def plot(result: dict[str, Any], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    slows = sorted({r["slow"] for r in rows})
    fig, axes = plt.subplots(1, len(slows), figsize=(3.2 * len(slows), 3.4), sharey=True)
    for ax, slow in zip(axes if len(slows) > 1 else [axes], slows, strict=True):
        mine = [r for r in rows if r["slow"] == slow]
        windows = [r["window"] for r in mine]
        for rule, style, label in (("swarm", "o-", "SWARM draw"), ("least", "s--", "largest")):
            got = [r[rule]["throughput"] for r in mine]
            line = ax.plot(windows, got, style, label=f"{label}, slow third beside")[0]
            alone = [r[rule]["fast_alone"] for r in mine]
            ax.plot(windows, alone, ":", color=line.get_color(), label=f"{label}, fast two alone")
        ax.axhline(2 + 1 / slow, color="grey", lw=0.8, label="capacity")
        ax.set_title(f"third replica {slow:g}x slower", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("microbatches in flight")
    axes_list = axes if len(slows) > 1 else [axes]
    axes_list[0].set_ylabel("microbatches per fast service time")
    axes_list[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--jobs", type=int, default=100_000, help="microbatches a configuration")
    p.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16])
    p.add_argument("--slow", type=float, nargs="+", default=[1.0, 2.0, 5.0, 17.0])
    p.add_argument("--seed", type=int, default=0)
    add_output_args(p, "routing_window")
    args = p.parse_args(argv)
    result = run(args)
    save(result, args.out, args.name or "routing_window", None if args.no_plot else plot)
    return result


if __name__ == "__main__":
    main()
