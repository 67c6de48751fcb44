"""Synchronisation time against the number of replicas: NoLoCo exchange vs ring all-reduce.

Measured: for N = 2, 4, 8 replicas of one stage, N real processes (``bench/sync_worker.py``:
the daemon's HTTP transport, its latency/bandwidth emulation and its sync services) start
each repetition together; each reports how long its NoLoCo exchange and its ring
all-reduce of the same stage-sized tensor took.

Modelled: a latency/bandwidth model with two fitted constants (per-message overhead ``c``
and per-byte processing cost ``k``), least-squares fitted to the measurements, with the
fit error reported, then extended to N = 1024 along with a binary-tree all-reduce::

    noloco = listen/2 + 4 (L + c) + 4 S (1/B + k)          a proposal and its answer, then the
                                                           contributions (phi + delta) each way
    ring   = 2 (N-1) [2 (L + c) + S/N (1/B + k)]           every step waits for its chunk's acknowledgement
    tree   = 2 ceil(log2 N) [2 (L + c) + S (1/B + k)]      reduce up, broadcast down

With ``--hivemind PYTHON`` (a Python that has hivemind, never this project's: see
``bench/perf_hivemind.py``) the same run also times hivemind's ``DecentralizedAverager``
all-reduce of a tensor of the same size at the same N, for a side-by-side comparison.

With ``--netns`` every replica runs in a network namespace of its own (``tests/netns.py``)
whose uplink is a real kernel token bucket at ``--bandwidth-mbps`` (``tc tbf``: packets queue,
TCP's windows and every transfer overlap as on separate machines), instead of the
transport's emulated cap; latency, if any, is still the transport's (this kernel has no
netem). This is the volunteer's case: every replica owns its uplink, so two pairs
exchanging at once do not share one, and on two shared cores the emulation (which sleeps
for the wire time, then copies at CPU speed) is the less faithful of the two.

Writes ``bench/results/NAME.json`` and ``NAME.png`` (``--name``, default ``sync_scaling``).
Usage: ``python -m bench.sync_scaling [--quick] [--numel N] [--netns] [--hivemind PYTHON]``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from node.config import resolve_config
from node.demo import free_port
from node.stage.model import stage_blocks

RESULTS = Path(__file__).parent / "results"


def stage_numel(preset: str = "tiny", num_block_stages: int = 3) -> int:
    cfg = resolve_config(
        None, {}, {"swarm.model": preset, "swarm.num_block_stages": str(num_block_stages)}
    ).model
    return len(stage_blocks(cfg, num_block_stages, 1)) * cfg.block_params()


PORT = 7900  # in --netns mode every replica has an address of its own


def measure(n: int, numel: int, args: argparse.Namespace) -> dict[str, Any]:
    if not args.netns:
        addresses = [f"127.0.0.1:{free_port()}" for _ in range(n)]
        return _measure(n, numel, args, addresses, subprocess.Popen, args.bandwidth_mbps)
    from tests.netns import Lab

    with Lab.create(n) as lab:
        for host in lab.hosts:
            if args.bandwidth_mbps:
                host.cap_uplink(args.bandwidth_mbps)
        addresses = [f"{h.address}:{PORT}" for h in lab.hosts]
        hosts = iter(lab.hosts)
        return _measure(
            n, numel, args, addresses, lambda cmd, **kw: next(hosts).popen(cmd, **kw), 0
        )


def _measure(
    n: int,
    numel: int,
    args: argparse.Namespace,
    addresses: list[str],
    popen: Any,
    emulated_mbps: float,
) -> dict[str, Any]:
    """Start one worker per address with ``popen`` (this host, or one namespace each), each
    emulating ``emulated_mbps`` of uplink in its transport (0: none), and collect their rows."""
    start_at = time.time() + 6.0 + 0.5 * n
    cmd = [
        sys.executable,
        "-m",
        "bench.sync_worker",
        "--addresses",
        ",".join(addresses),
        "--numel",
        str(numel),
        "--reps",
        str(args.reps),
        "--start-at",
        str(start_at),
        "--period",
        str(args.period),
        "--latency-ms",
        str(args.latency_ms),
        "--bandwidth-mbps",
        str(emulated_mbps),
        "--listen-s",
        str(args.listen_s),
        "--timeout-s",
        str(args.timeout_s),
    ]
    procs = [popen([*cmd, "--index", str(i)], stdout=subprocess.PIPE, text=True) for i in range(n)]
    rows = []
    for p in procs:
        out, _ = p.communicate(timeout=start_at - time.time() + args.reps * args.period + 120)
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    noloco = [r["s"] for r in rows if r["method"] == "noloco"]
    ring = [r["s"] for r in rows if r["method"] == "ring" and r["ok"]]
    # A replica's exchange ends when it has its partner's contribution: for the acceptor
    # when the proposer's upload is in, for the proposer when the reply is back too. The
    # median over replicas mixes both; the slowest replica of a repetition is when every
    # pair of it had finished.
    slowest = [
        max(r["s"] for r in rows if r["method"] == "noloco" and r["rep"] == rep)
        for rep in sorted({r["rep"] for r in rows if r["method"] == "noloco"})
    ]
    return {
        "n": n,
        "noloco_s": statistics.median(noloco),
        "noloco_slowest_s": statistics.median(slowest),
        "ring_s": statistics.median(ring) if ring else None,
        "noloco_paired_fraction": sum(r["paired"] for r in rows if r["method"] == "noloco")
        / len(noloco),
        "ring_failed": sum(1 for r in rows if r["method"] == "ring" and not r["ok"]),
        "samples": len(noloco),
        "rows": rows,
    }


def run_hivemind(python: str, numel: int, ns: list[int], reps: int) -> list[dict[str, Any]]:
    """hivemind's averaging of ``numel`` fp32 values at each N, in its own Python."""
    script = Path(__file__).parent / "perf_hivemind.py"
    cmd = [python, str(script), "--numel", str(numel), "--sizes", ",".join(map(str, ns))]
    cmd += ["--reps", str(reps), "--payload-bytes", "0"]
    print("hivemind:", " ".join(cmd[1:]), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True).stdout
    rows: list[dict[str, Any]] = json.loads(out.strip().splitlines()[-1])["averaging"]
    return rows


def model(
    n: int, s_bytes: float, lat: float, bw: float, listen: float, c: float, k: float
) -> dict[str, float]:
    per = 1.0 / bw + k
    return {
        "noloco_s": listen / 2 + 4 * (lat + c) + 4 * s_bytes * per,
        "ring_s": 2 * (n - 1) * (2 * (lat + c) + s_bytes / n * per),
        "tree_s": 2 * math.ceil(math.log2(n)) * (2 * (lat + c) + s_bytes * per) if n > 1 else 0.0,
    }


def fit(
    measured: list[dict[str, Any]], s_bytes: float, lat: float, bw: float, listen: float
) -> tuple[float, float]:
    """Least-squares ``c`` and ``k`` (both enter the model linearly)."""
    rows, ys = [], []
    for m in measured:
        n = m["n"]
        rows.append((4.0, 4 * s_bytes))
        ys.append(m["noloco_s"] - listen / 2 - 4 * lat - 4 * s_bytes / bw)
        if m["ring_s"] is not None:
            rows.append((4.0 * (n - 1), 2 * (n - 1) * s_bytes / n))
            ys.append(m["ring_s"] - 2 * (n - 1) * (2 * lat + s_bytes / n / bw))
    a11 = sum(r[0] * r[0] for r in rows)
    a12 = sum(r[0] * r[1] for r in rows)
    a22 = sum(r[1] * r[1] for r in rows)
    b1 = sum(r[0] * y for r, y in zip(rows, ys, strict=True))
    b2 = sum(r[1] * y for r, y in zip(rows, ys, strict=True))
    det = a11 * a22 - a12 * a12
    return (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sim = result["simulated"]
    ns = [r["n"] for r in sim]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.loglog(ns, [r["ring_s"] for r in sim], "-", color="tab:red", label="ring all-reduce (model)")
    ax.loglog(
        ns, [r["tree_s"] for r in sim], "-", color="tab:orange", label="tree all-reduce (model)"
    )
    ax.loglog(
        ns, [r["noloco_s"] for r in sim], "-", color="tab:blue", label="NoLoCo exchange (model)"
    )
    points = [
        (result["measured"], "ring_s", "o", "tab:red", "ring (measured)"),
        (result["measured"], "noloco_s", "o", "tab:blue", "NoLoCo (measured)"),
        (result.get("hivemind", []), "allreduce_s", "s", "tab:green", "hivemind all-reduce"),
    ]
    for rows, key, marker, color, label in points:
        if rows:
            ax.loglog(
                [r["n"] for r in rows], [r[key] for r in rows], marker, color=color, label=label
            )
    p = result["params"]
    ax.set_title(
        f"Sync time of one stage ({p['stage_bytes'] / 1e6:.1f} MB), {p['latency_ms']:.0f} ms one-way, "
        + (f"{p['bandwidth_mbps']:.0f} Mbit/s" if p["bandwidth_mbps"] else "no uplink cap")
        + (" (token buckets)" if p.get("uplink", "").startswith("kernel") else "")
    )
    ax.set_xlabel("replicas of the stage (N)")
    ax.set_ylabel("seconds per synchronisation")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="N = 2, 4 and 2 repetitions (a smoke run)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--period", type=float, default=8.0, help="seconds between repetitions")
    p.add_argument("--latency-ms", type=float, default=25.0)
    p.add_argument("--bandwidth-mbps", type=float, default=100.0, help="0: no uplink cap")
    p.add_argument(
        "--netns",
        action="store_true",
        help="each replica in its own network namespace, its uplink a kernel token bucket",
    )
    p.add_argument("--listen-s", type=float, default=0.05)
    p.add_argument(
        "--timeout-s",
        type=float,
        default=20.0,
        help="fixed part of a gossip request's and a ring step's timeout (plus the transfer's "
        "allowance at 10 Mbit/s); the round's deadline is 1.5x this, the hold half",
    )
    p.add_argument("--preset", default="tiny")
    p.add_argument("--numel", type=int, default=0, help="values per stage (0: the preset's)")
    p.add_argument("--hivemind", default="", help="a Python with hivemind: compare with it")
    p.add_argument("--name", default="sync_scaling", help="results file name, no suffix")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    ns = [2, 4] if args.quick else [2, 4, 8]
    if args.quick:
        args.reps = 2
    numel = args.numel or stage_numel(args.preset)
    # bytes/s of the emulated uplink; 0 means none emulated: no wire time in the model
    s_bytes, lat = 4.0 * numel, args.latency_ms / 1000
    bw = args.bandwidth_mbps * 125_000 or math.inf
    measured = []
    for n in ns:
        m = measure(n, numel, args)
        print(
            f"N={n}: noloco {m['noloco_s']:.3f}s (slowest replica {m['noloco_slowest_s']:.3f}s, "
            f"paired {m['noloco_paired_fraction']:.0%}), ring {m['ring_s']}",
            flush=True,
        )
        measured.append(m)
    hivemind = run_hivemind(args.hivemind, numel, ns, args.reps) if args.hivemind else []
    for m in measured:
        hm = next((h for h in hivemind if h["n"] == m["n"]), None)
        if hm is not None:
            m["hivemind_allreduce_s"] = hm["allreduce_s"]
            m["hivemind_step_s"] = hm["step_s"]
            m["ring_over_hivemind"] = m["ring_s"] / hm["allreduce_s"] if m["ring_s"] else None
    c, k = fit(measured, s_bytes, lat, bw, args.listen_s)
    for m in measured:
        pred = model(m["n"], s_bytes, lat, bw, args.listen_s, c, k)
        m["model_noloco_s"], m["model_ring_s"] = pred["noloco_s"], pred["ring_s"]
    errors = [
        abs(m[f"model_{k_}"] - m[k_]) / m[k_]
        for m in measured
        for k_ in ("noloco_s", "ring_s")
        if m[k_]
    ]
    simulated = [
        {"n": n, **model(n, s_bytes, lat, bw, args.listen_s, c, k)}
        for n in [2**i for i in range(1, 11)]
    ]
    for row in simulated:
        row["ring_over_noloco"] = row["ring_s"] / row["noloco_s"]
        row["tree_over_noloco"] = row["tree_s"] / row["noloco_s"]
    result = {
        "params": {
            "stage_numel": numel,
            "stage_bytes": s_bytes,
            "latency_ms": args.latency_ms,
            "bandwidth_mbps": args.bandwidth_mbps,
            "uplink": "kernel token bucket per namespace" if args.netns else "emulated",
            "listen_s": args.listen_s,
            "timeout_s": args.timeout_s,
            "reps": args.reps,
            "fitted_overhead_per_message_s": c,
            "fitted_cost_per_byte_s": k,
            "model_max_relative_error": max(errors),
        },
        "measured": measured,
        "noloco_largest_over_smallest_n": measured[-1]["noloco_s"] / measured[0]["noloco_s"],
        "noloco_slowest_largest_over_smallest_n": measured[-1]["noloco_slowest_s"]
        / measured[0]["noloco_slowest_s"],
        "hivemind": hivemind,
        "simulated": simulated,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / f"{args.name}.png")
    for m in measured:
        if "hivemind_allreduce_s" in m:
            print(
                f"N={m['n']}: hivemind all-reduce {m['hivemind_allreduce_s']:.3f}s, "
                f"whole step {m['hivemind_step_s']:.3f}s; ring/hivemind {m['ring_over_hivemind']:.2f}"
            )
    last = simulated[-1]
    print(
        f"model: c={c * 1e3:.2f} ms/message, k={k * 1e9:.2f} ns/byte, max error {max(errors):.0%}"
    )
    print(
        f"N=1024: noloco {last['noloco_s']:.2f}s, ring {last['ring_s']:.1f}s ({last['ring_over_noloco']:.0f}x), "
        f"tree {last['tree_s']:.2f}s ({last['tree_over_noloco']:.1f}x)"
    )
    return result


if __name__ == "__main__":
    main()
