"""What routing loses when replicas' figures are old: the real router (``swarm.routing``)
drawing every hop, in virtual time, against stage replicas modelled as queues.

A large swarm republishes each member's figures (queue, rate) rarely: membership spreads
them within a byte budget, every few minutes at 100 nodes and hours at 1000
(``bench/membership.py``), and a pong brings a member's figures once per round-robin pass
(N seconds). Every microbatch's ack now carries the receiver's queue and rate of the moment.
This measures both ways side by side, on the same arrivals:

- ``records``: each replica weighed by its published record alone (refreshed every
  ``period`` seconds, each replica at its own phase, drawn in [0.5, 1.5) of it as
  membership draws them);
- ``acks``: the same records, and each sender's last ack from each replica (the code as
  it is).

Both with the daemon's ``train.route_cutoff`` (``--cutoff``; 0 for SWARM's draw from every
replica), which acts on fresh acks only, so ``records`` is the same either way.

The stage: ``RATES`` (samples/s: two fast, two middling, four slow replicas), 16 senders
(the previous stage's replicas) each sending 8-sample microbatches as a Poisson stream at
``--load`` of the stage's capacity (0.6), 10 ms one way. Half-way through, a fast replica
slows to a quarter of its rate (its owner started using the machine; the load is then 0.74
of what is left). Reported per period and way: the microbatches' mean and 95th-percentile
wait in a replica's queue (one still waiting at the end counts what it has waited), the
longest queue, and the slowed replica's share of the microbatches sent after it slowed
against its share of the capacity. The network and the replicas are a model; the draws are the real code's.

Writes ``bench/results/routing_freshness.json`` and ``.png``. Usage: ``python -m
bench.routing_freshness [--periods 10,100,1000] [--seconds 1200] [--seeds 0,1,2]``;
``--quick`` for the test's small version.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.config import TrainConfig
from protocol.messages import PeerRecord
from swarm.routing import Router

RESULTS = Path(__file__).parent / "results"
RATES = [32.0, 32.0, 16.0, 16.0, 8.0, 8.0, 8.0, 8.0]
"""Samples per second of each replica of the stage."""
SAMPLES = 8
"""Samples per microbatch."""
SENDERS = 16
CUTOFF = TrainConfig().route_cutoff
"""The daemon's default ``train.route_cutoff`` (0: SWARM's draw from every replica)."""
ONE_WAY_S = 0.010
SLOWED, SLOWDOWN = 0, 4.0
"""Which replica slows half-way through, and by how much."""
MODES = ("records", "acks")


@dataclass
class Replica:
    rate: float
    queue: deque[tuple[float, int]] = field(default_factory=deque)
    """Waiting microbatches: (arrival time, sender)."""
    busy: bool = False
    taken_after: int = 0
    """Microbatches sent to it after the slowdown."""


def simulate(
    mode: str,
    period_s: float,
    seconds: float,
    load: float,
    seed: int,
    cutoff: float = CUTOFF,
) -> dict[str, Any]:
    """One run; the arrivals and publication phases depend on ``seed`` only, not on ``mode``.
    ``cutoff``: the routers' ``train.route_cutoff`` (0: SWARM's draw from every replica)."""
    arrivals = random.Random(seed)
    phases = random.Random(seed + 1)
    replicas = [Replica(r) for r in RATES]
    ids = [f"r{j}" for j in range(len(RATES))]
    routers = [
        Router(random.Random(f"{seed}-{i}"), ban_s=10.0, cutoff=cutoff) for i in range(SENDERS)
    ]
    for router in routers:
        router.samples = SAMPLES
    records = {j: _record(ids[j], replicas[j]) for j in range(len(RATES))}
    mb_per_s = load * sum(RATES) / SAMPLES / SENDERS
    events: list[tuple[float, int, str, Any]] = []
    seq = 0

    def at(t: float, kind: str, data: Any = None) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, data))

    for i in range(SENDERS):
        at(arrivals.expovariate(mb_per_s), "send", i)
    for j in range(len(RATES)):
        at(phases.uniform(0, period_s), "publish", j)
    at(seconds / 2, "slow")
    waits: list[float] = []
    stays: list[float] = []  # wait and service: what a sender's window holds the slot for
    max_queue, slowed = 0, False
    while events:
        now, _, kind, data = heapq.heappop(events)
        if now > seconds:
            break
        if kind == "send":
            i = data
            candidates = list(records.values())
            peer = routers[i].choose(candidates, now)
            assert peer is not None
            j = ids.index(peer.peer_id)
            routers[i].started(peer.peer_id)
            at(now + ONE_WAY_S, "arrive", (i, j))
            at(now + arrivals.expovariate(mb_per_s), "send", i)
        elif kind == "arrive":
            i, j = data
            r = replicas[j]
            r.queue.append((now, i))
            r.taken_after += slowed
            max_queue = max(max_queue, len(r.queue) + r.busy)
            ack = (len(r.queue) + r.busy, r.rate) if mode == "acks" else (-1, 0.0)
            at(now + ONE_WAY_S, "ack", (i, j, ack))
            _serve(r, j, now, at)
        elif kind == "ack":
            i, j, (queue, rate) = data
            routers[i].finished(ids[j], True, now, 2 * ONE_WAY_S, queue, rate)
        elif kind == "done":
            replicas[data].busy = False
            _serve(replicas[data], data, now, at)
        elif kind == "start":
            waited, service_s = data
            waits.append(waited)
            stays.append(waited + service_s)
        elif kind == "publish":
            records[data] = _record(ids[data], replicas[data])
            at(now + period_s * phases.uniform(0.5, 1.5), "publish", data)
        elif kind == "slow":
            replicas[SLOWED].rate /= SLOWDOWN
            slowed = True
    assert slowed
    # a microbatch still waiting at the end has waited at least until then
    waits += [seconds - arrived for r in replicas for arrived, _ in r.queue]
    stays += [seconds - arrived + SAMPLES / r.rate for r in replicas for arrived, _ in r.queue]
    after = [r.taken_after for r in replicas]
    rates_after = [r.rate for r in replicas]
    share = after[SLOWED] / max(1, sum(after))
    capacity = rates_after[SLOWED] / sum(rates_after)
    waits.sort()
    return {
        "mode": mode,
        "period_s": period_s,
        "seed": seed,
        "microbatches": len(waits),
        "wait_mean_s": round(statistics.fmean(waits), 3),
        "wait_p95_s": round(waits[int(0.95 * (len(waits) - 1))], 3),
        "stay_mean_s": round(statistics.fmean(stays), 3),
        "max_queue": max_queue,
        "slowed_share_after": round(share, 4),
        "slowed_capacity_share_after": round(capacity, 4),
        "slowed_left_waiting": len(replicas[SLOWED].queue),
    }


def _record(peer_id: str, r: Replica) -> PeerRecord:
    """What the replica publishes: its queue and rate now."""
    queue = len(r.queue) + r.busy
    return PeerRecord(peer_id, f"{peer_id}:1", 1, throughput=r.rate, queue=queue, ready=True)


def _serve(r: Replica, j: int, now: float, at: Any) -> None:
    if r.busy or not r.queue:
        return
    arrived, _ = r.queue.popleft()
    r.busy = True
    at(now, "start", (now - arrived, SAMPLES / r.rate))
    at(now + SAMPLES / r.rate, "done", j)


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per period and mode: medians over the seeds."""
    out = []
    keys = sorted({(r["period_s"], r["mode"]) for r in rows})
    for period_s, mode in keys:
        runs = [r for r in rows if (r["period_s"], r["mode"]) == (period_s, mode)]
        out.append(
            {
                "period_s": period_s,
                "mode": mode,
                "seeds": len(runs),
                **{
                    k: statistics.median(r[k] for r in runs)
                    for k in (
                        "wait_mean_s",
                        "wait_p95_s",
                        "stay_mean_s",
                        "max_queue",
                        "slowed_share_after",
                        "slowed_capacity_share_after",
                    )
                },
            }
        )
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    periods = sorted({r["period_s"] for r in summary})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.38
    for k, mode in enumerate(MODES):
        rows = {r["period_s"]: r for r in summary if r["mode"] == mode}
        xs = [p + (k - 0.5) * width for p in range(len(periods))]
        ax1.bar(xs, [rows[p]["wait_mean_s"] for p in periods], width, label=mode)
        ax2.bar(xs, [rows[p]["slowed_share_after"] for p in periods], width, label=mode)
    capacity = summary[0]["slowed_capacity_share_after"]
    ax2.axhline(capacity, color="k", ls="--", lw=1, label="its share of the capacity")
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(periods)), [f"{p:g} s" for p in periods])
        ax.set_xlabel("records republished every")
        ax.legend()
    ax1.set_ylabel("mean wait in a replica's queue (s)")
    ax2.set_ylabel("slowed replica's share of the work after it slowed")
    fig.suptitle(
        f"Routing by published records or by acks ({result['config']['load']:.0%} load, "
        f"median of {len(result['config']['seeds'])} seeds)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.routing_freshness", description=__doc__)
    p.add_argument("--periods", default="10,100,1000", help="record refresh periods, seconds")
    p.add_argument("--seconds", type=float, default=1200.0, help="virtual seconds per run")
    p.add_argument(
        "--load", type=float, default=0.6, help="offered load / the stage's first capacity"
    )
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument(
        "--cutoff", type=float, default=CUTOFF, help="train.route_cutoff (0: SWARM's draw)"
    )
    p.add_argument("--quick", action="store_true", help="two periods, 200 s, one seed")
    p.add_argument("--out", type=Path, default=RESULTS / "routing_freshness.json")
    args = p.parse_args(argv)
    periods = [float(x) for x in args.periods.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    if args.quick:
        periods, seeds, args.seconds = [10.0, 1000.0], [0], 200.0
    rows = []
    for period_s in periods:
        for seed in seeds:
            for mode in MODES:
                row = simulate(mode, period_s, args.seconds, args.load, seed, args.cutoff)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    result: dict[str, Any] = {
        "config": {
            "rates": RATES,
            "samples": SAMPLES,
            "senders": SENDERS,
            "one_way_s": ONE_WAY_S,
            "load": args.load,
            "cutoff": args.cutoff,
            "seconds": args.seconds,
            "slowed": {"replica": SLOWED, "by": SLOWDOWN, "at_s": args.seconds / 2},
            "seeds": seeds,
        },
        "rows": rows,
        "summary": summarise(rows),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    for r in result["summary"]:
        print(
            f"records every {r['period_s']:>6g} s, {r['mode']:>7}: wait {r['wait_mean_s']:.2f} s "
            f"(p95 {r['wait_p95_s']:.2f}; with service {r['stay_mean_s']:.2f} s), longest queue "
            f"{r['max_queue']:g}, slowed replica "
            f"{r['slowed_share_after']:.1%} of the work for {r['slowed_capacity_share_after']:.1%}"
            " of the capacity"
        )
    return result


if __name__ == "__main__":
    main()
