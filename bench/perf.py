"""Transport and pipeline performance (issue 8): every figure against its baseline, one run.

1. wire throughput: a 64 MiB activation frame between two processes through the daemon's
   ``HttpTransport`` and request path, against raw TCP sending the same bytes
   (``bench/perf_wire.py``); target >= 60 % of raw;
2. small-message latency: one hop of a 16 KiB activation, p50 and p99, against a bare
   aiohttp echo of the same size (``bench/perf_wire.py``); target p50 within 1.5x;
3. pipeline efficiency: tokens/s of a local swarm (head + 3 block stages) against one process
   training the same model on the same batches, and where the swarm's CPU goes
   (``bench/perf_pipeline.py``: py-spy over every thread, torch's profiler over the
   compute threads' operators); target >= 80 %;
4. activation compression: bytes per microbatch and eval-loss cost of fp32, bf16 and int8 on
   the wire after a short fixed budget (``bench/perf_codec.py``);
5. hivemind, where it can be installed (a separate venv, ``bench/perf_hivemind.py``): tensor
   throughput between two peers, and averaging a stage among N = 2, 4, 8 peers against our
   NoLoCo exchange and ring all-reduce without emulated latency (``bench/sync_scaling.py``).

Every comparison alternates or interleaves its two sides within the run (the machine is
shared and noisy) and reports medians. Writes ``bench/results/perf.json`` and ``perf.png``.
``--short`` is the smoke run the tests use: tiny sizes, seconds instead of minutes.

Usage: ``python -m bench.perf [--short] [--hivemind-python /work/hm-venv/bin/python]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
HIVEMIND_PYTHON = Path("/work/hm-venv/bin/python")
GLIBC_DEFAULTS = {"MURMUR_MALLOC_REUSE": "0"}
"""A receiver that leaves glibc's allocator as it is (``node/allocator.py``: the daemon tunes it)."""


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _median_ratio(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def wire(args: argparse.Namespace) -> dict[str, Any]:
    from bench.perf_wire import measure_throughput

    runs = []
    for i in range(args.repeats):
        _say(f"wire: {args.payload_bytes >> 20} MiB frames, run {i + 1}/{args.repeats}")
        runs.append(measure_throughput(args.payload_bytes, args.wire_reps))
    out: dict[str, Any] = {
        "wire_ratio_to_raw_tcp": _median_ratio(runs, "wire_ratio_to_raw_tcp"),
        "raw_tcp_MBps": _median_ratio(runs, "raw_tcp_MBps"),
        "http_frame_MBps": _median_ratio(runs, "http_frame_MBps"),
        "runs": runs,
    }
    if not args.short:
        _say("wire: receiver with glibc's default allocator settings (MURMUR_MALLOC_REUSE=0)")
        untuned = measure_throughput(args.payload_bytes, args.wire_reps, GLIBC_DEFAULTS)
        out["with_glibc_defaults"] = {"env": GLIBC_DEFAULTS, **untuned}
    return out


def latency(args: argparse.Namespace) -> dict[str, Any]:
    from bench.perf_wire import measure_latency

    runs = []
    for i in range(args.latency_repeats):
        _say(f"latency: {args.hops} hops of 16 KiB, run {i + 1}/{args.latency_repeats}")
        runs.append(measure_latency(args.hops))
    return {
        "hop_p50_ratio_to_echo": _median_ratio(runs, "hop_p50_ratio_to_echo"),
        "hop_p99_ratio_to_echo": _median_ratio(runs, "hop_p99_ratio_to_echo"),
        "hop_encoding_p50_ratio_to_echo": _median_ratio(runs, "hop_encoding_p50_ratio_to_echo"),
        "hop_p50_ms": statistics.median(r["hop"]["p50_ms"] for r in runs),
        "hop_p99_ms": statistics.median(r["hop"]["p99_ms"] for r in runs),
        "echo_p50_ms": statistics.median(r["echo"]["p50_ms"] for r in runs),
        "echo_p99_ms": statistics.median(r["echo"]["p99_ms"] for r in runs),
        "runs": runs,
    }


def pipeline(args: argparse.Namespace) -> dict[str, Any]:
    from bench.perf_pipeline import measure_pipeline

    threads = [1] if args.short else [1, 2]
    return measure_pipeline(
        args.swarm_s,
        args.warmup_s,
        threads,
        profile=args.profile,
        short=args.short,
        torch_profile_s=2.0 if args.short else 20.0,
    )


def codecs(args: argparse.Namespace) -> dict[str, Any]:
    from bench.perf_codec import measure_codecs

    return measure_codecs(args.codec_microbatches)


def ours_without_latency(numel: int, sizes: list[int], reps: int) -> list[dict[str, Any]]:
    """Our NoLoCo exchange and ring all-reduce, loopback without emulated latency/bandwidth."""
    from bench.sync_scaling import measure

    ns = argparse.Namespace(reps=reps, period=5.0, latency_ms=0.0, bandwidth_mbps=0.0)
    ns.listen_s = 0.05
    out = []
    for n in sizes:
        _say(f"sync: our NoLoCo exchange and ring among {n} processes")
        out.append(measure(n, numel, ns))
    return out


def hivemind(args: argparse.Namespace) -> dict[str, Any]:
    """hivemind's figures (or why there are none) next to ours for the same sizes."""
    from bench.sync_scaling import stage_numel

    python = Path(args.hivemind_python)
    if not python.exists():
        return {"status": "unavailable", "reason": f"no hivemind environment at {python}"}
    numel = stage_numel("tiny")
    sizes = [2] if args.short else [2, 4, 8]
    cmd = [str(python), str(Path(__file__).with_name("perf_hivemind.py")), "--numel", str(numel)]
    cmd += ["--sizes", ",".join(map(str, sizes)), "--reps", str(1 if args.short else 3)]
    cmd += ["--payload-bytes", str(args.payload_bytes)]
    _say("hivemind: " + " ".join(cmd[1:]))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return {"status": "unavailable", "reason": "timed out after 900 s"}
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode or not lines:
        return {"status": "unavailable", "reason": done.stderr.strip()[-800:]}
    result: dict[str, Any] = json.loads(lines[-1])
    result["ours"] = ours_without_latency(numel, sizes, 1 if args.short else 3)
    result["stage_numel"] = numel
    return result


PARTS = {
    "wire": wire,
    "latency": latency,
    "pipeline": pipeline,
    "codecs": codecs,
    "hivemind": hivemind,
}


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The figures issue 8 asks for, at the top level of the JSON."""
    out: dict[str, Any] = {}
    if "wire" in result:
        out["wire_ratio_to_raw_tcp"] = result["wire"]["wire_ratio_to_raw_tcp"]
    if "latency" in result:
        out["hop_p50_ratio_to_echo"] = result["latency"]["hop_p50_ratio_to_echo"]
    if "pipeline" in result:
        out["pipeline_efficiency"] = result["pipeline"]["pipeline_efficiency"]
        out["pipeline_cpu_efficiency"] = result["pipeline"]["pipeline_cpu_efficiency"]
    if "codecs" in result:
        c = result["codecs"]
        out["activation_bytes"] = {k: c[k]["frame_bytes"] for k in ("fp32", "bf16", "int8")}
    if "hivemind" in result:
        out["hivemind"] = result["hivemind"]
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    if "wire" in result:
        w = result["wire"]
        axes[0].bar(["raw TCP", "HTTP frame"], [w["raw_tcp_MBps"], w["http_frame_MBps"]])
        axes[0].set_title(f"64 MiB payload: {w['wire_ratio_to_raw_tcp']:.0%} of raw")
        axes[0].set_ylabel("MB/s (median)")
    if "latency" in result:
        lat = result["latency"]
        xs = [0, 1]
        axes[1].bar(
            [x - 0.2 for x in xs], [lat["echo_p50_ms"], lat["hop_p50_ms"]], 0.4, label="p50"
        )
        axes[1].bar(
            [x + 0.2 for x in xs], [lat["echo_p99_ms"], lat["hop_p99_ms"]], 0.4, label="p99"
        )
        axes[1].set_xticks(xs, ["aiohttp echo", "activation hop"])
        axes[1].set_title(f"16 KiB hop: p50 {lat['hop_p50_ratio_to_echo']:.2f}x echo")
        axes[1].set_ylabel("ms")
        axes[1].legend()
    if "pipeline" in result:
        _plot_cpu(axes[2], result["pipeline"])
        if "torch_profile" in result["pipeline"]:
            _plot_operators(axes[3], result["pipeline"]["torch_profile"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def cpu_breakdown(p: dict[str, Any]) -> dict[str, float]:
    """The swarm's CPU milliseconds per 1000 tokens by category (py-spy shares within each
    thread times that thread's measured CPU); the event loop as one category."""
    by_thread = p["swarm"]["cpu_ms_per_1k_tokens_by_thread"]
    shares = p.get("profile", {}).get("share_by_thread", {}).get("compute thread")
    if not shares:
        return dict(by_thread)
    out = {f"compute: {k}": v * by_thread["other threads"] for k, v in shares.items()}
    out["event loop (HTTP, frames, decode)"] = by_thread["event loop thread"]
    return out


def _plot_cpu(ax: Any, p: dict[str, Any]) -> None:
    single = min(s["cpu_ms_per_1k_tokens"] for s in p["single_process"].values())
    ax.bar(["one process"], [single], color="tab:gray")
    bottom = 0.0
    for name, ms in sorted(cpu_breakdown(p).items(), key=lambda kv: -kv[1]):
        ax.bar(["swarm (4 processes)"], [ms], bottom=bottom, label=name)
        bottom += ms
    ax.set_title(f"CPU per token: one process = {p['pipeline_cpu_efficiency']:.0%} of swarm")
    ax.set_ylabel("CPU ms per 1000 tokens")
    ax.set_ylim(0, 2.1 * bottom)  # room for the legend above the bars
    ax.legend(fontsize=6, loc="upper left")


def _plot_operators(ax: Any, t: dict[str, Any]) -> None:
    """The compute threads' CPU by kind of operator, torch profiler on, both sides stacked."""
    sides = {"one process": t["one_process"], "swarm (4 compute threads)": t["swarm"]}
    kinds = list(t["swarm"]["kinds_ms"])
    bottoms = dict.fromkeys(sides, 0.0)
    for kind in kinds:
        ms = [side["kinds_ms"].get(kind, 0.0) for side in sides.values()]
        ax.bar(list(sides), ms, bottom=list(bottoms.values()), label=kind)
        bottoms = {k: b + m for (k, b), m in zip(bottoms.items(), ms, strict=True)}
    ax.set_title("compute threads by torch operator (profiler on)")
    ax.set_ylabel("CPU ms per 1000 tokens")
    ax.set_ylim(0, 1.9 * max(bottoms.values()))
    ax.legend(fontsize=6, loc="upper left")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--short", action="store_true", help="smoke run: tiny sizes, a minute")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset to run")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for perf.json/png")
    p.add_argument("--hivemind-python", default=str(HIVEMIND_PYTHON))
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--replot", action="store_true", help="redraw perf.png from perf.json")
    args = p.parse_args(argv)
    full = not args.short
    args.repeats = 3 if full else 1
    args.payload_bytes = (64 << 20) if full else (1 << 20)
    args.wire_reps = 8 if full else 2
    args.hops = 1000 if full else 50
    args.latency_repeats = 5 if full else 1  # a run is seconds long, and its ratio noisy
    args.swarm_s = 40.0 if full else 2.0
    args.warmup_s = 10.0 if full else 0.5
    args.profile = full
    args.codec_microbatches = 40 if full else 2
    unknown = set(args.parts.split(",")) - PARTS.keys()
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; known: {', '.join(PARTS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.replot:
        plot(json.loads((args.out / "perf.json").read_text()), args.out / "perf.png")
        return
    t0 = time.monotonic()
    result: dict[str, Any] = {}
    for name in args.parts.split(","):
        result[name] = PARTS[name](args)
    result = {
        **headline(result),
        "mode": "short" if args.short else "full",
        "seconds": round(time.monotonic() - t0, 1),
        **{k: v for k, v in result.items() if k != "hivemind"},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "perf.json").write_text(json.dumps(result, indent=2) + "\n")
    if not args.no_plot:
        plot(result, args.out / "perf.png")
    summary = {k: v for k, v in headline(result).items() if k != "hivemind"}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
