"""The pipeline over an emulated WAN: latency, thin uplinks and unequal machines (issue 22).

Every node is a real ``node join`` process in its own network namespace (``tests/netns.py``:
hosts on one bridge). Each host's uplink is capped by a kernel token bucket on its ``eth0``
(``tc qdisc ... tbf``: real packets queue and wait), and since this kernel has no netem, the
one-way latency is the transport's own injection (``net.inject_latency_s``: every frame a
node sends waits that long before it goes). The swarm is a head and 3 block stages of the
tiny model, one or two replicas per stage, stages fixed (no balancing moves).

Variants, each run in turn in one invocation (ratios are taken against the 0 ms run of the
same window policy in the same invocation: the machine is noisy):

- one-way latency 0, 25, 50, 100 ms at 100 Mbit/s, and 50 ms at 20 Mbit/s, one replica per
  stage, with ``train.window`` fixed (6 in flight, the default until the thin-uplink runs of
  ``bench/thin_uplink.py``) and adaptive (at most ``ADAPTIVE_MAX``);
- two replicas per stage at 0 and 50 ms;
- a mixed swarm at 50 ms: two replicas per block stage, one of them 2x (stage 1) or 4x
  (stage 2) slower (``train.slowdown``), to see whether each replica's share of the
  microbatches follows its share of the stage's compute capacity (its measured service rate);
- the activation codec at 50 ms and 20 Mbit/s: fp32, int8 and ``auto`` (``swarm.wirecodec``:
  chosen by each node from the arrival rates its receivers report) beside the default
  bf16, and ``auto`` beside bf16 at 50 ms and 100 Mbit/s; each run records the codec every
  node ended with and the link rate its receivers reported (``wire``). Every other variant
  sends bf16. ``--quick`` runs 0 and 50 ms, and ``auto`` at 20 Mbit/s.

Per run: the head's tokens/s from the end of a warm-up until the token budget is spent; each
compute thread's busy time over wall time (``compute_busy_s`` in ``node status``); the
head's in-flight window (mean of samples taken every second); the eval loss the head
computes once the budget is spent (the same tokens for every run, up to one poll; tokens/s
is measured over at least ``MIN_MEASURE_S`` after the warm-up even if the budget is spent).

On two shared cores every process competes for the same CPU, so a node waiting on the
network frees a core for the others: latency costs less here than on separate machines, and
the utilisation figures are shares of a crowded machine. TCP itself sees no latency (the
delay is added above it), so the congestion-window ramp of a real long pipe is not emulated.

Writes ``bench/results/wan.json`` (``--quick``: ``wan-quick.json``; ``ratio_50ms`` and
``ratio_100ms``: tokens/s against 0 ms at 100 Mbit/s, one replica per stage, the fixed window,
``BASE_WINDOW``) and ``wan.png``. Needs root (namespaces, tc). Usage: ``python -m bench.wan [--quick] [--tokens 600000]``.
"""

from __future__ import annotations

import argparse
import json
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from node.client import fetch_status, request_eval
from node.config import TrainConfig
from tests.netns import Host, Lab, netns_available

RESULTS = Path(__file__).parent / "results"
PORT = 7070
SETTINGS = (
    "swarm.num_block_stages=3",
    "train.eval_interval_s=0",
    "node.join_wait_s=2",
    "balance.benchmark_s=0",
    "net.reachability_retry_s=5",
)
BASE_WINDOW = "fixed"
"""The window of the headline ratios and of every variant that does not compare windows:
the recorded runs were taken with it, when it was the default. (The default is now the
adaptive window bounded by ``train.max_in_flight``, 6, which the ``adaptive`` variants, at
most ``ADAPTIVE_MAX``, bound the other way.)"""
ADAPTIVE_MAX = 16
"""The adaptive window's bound in its variants: room to grow past the fixed default (6)."""
MIN_MEASURE_S = 10.0
"""Tokens/s is measured over at least this long after the warm-up, budget spent or not."""


@dataclass(frozen=True)
class Variant:
    name: str
    latency_ms: float
    rate_mbit: float
    replicas: int = 1
    window: str = BASE_WINDOW
    slowdown: dict[int, list[float]] = field(default_factory=dict)
    """Block stage -> its replicas' ``train.slowdown`` (missing: 1)."""
    codec: str = "bf16"
    """``train.wire_codec``: activations and gradients on the wire (bf16 unless the variant
    compares codecs, so that the node's choice does not confound latency)."""
    max_in_flight: int = TrainConfig().max_in_flight
    """``train.max_in_flight``: the window (fixed) or its bound (adaptive)."""
    seed: int = 0
    """``swarm.seed``: initial weights and data order."""


def variants(quick: bool) -> list[Variant]:
    if quick:
        return [
            Variant("0ms", 0, 100),
            Variant("50ms", 50, 100),
            Variant("50ms-20mbit-auto", 50, 20, codec="auto"),
        ]
    out = []
    for window, top in (("fixed", TrainConfig().max_in_flight), ("adaptive", ADAPTIVE_MAX)):
        for lat in (0, 25, 50, 100):
            out.append(Variant(f"{lat}ms", lat, 100, window=window, max_in_flight=top))
        out.append(Variant("50ms-20mbit", 50, 20, window=window, max_in_flight=top))
    out += [
        Variant("2rep-0ms", 0, 100, replicas=2, window=BASE_WINDOW),
        Variant("2rep-50ms", 50, 100, replicas=2, window=BASE_WINDOW),
        Variant("mixed-50ms", 50, 100, 2, BASE_WINDOW, {1: [1, 2], 2: [1, 4], 3: [1, 1]}),
    ]
    for codec in ("fp32", "int8", "auto"):  # against the default bf16 of "50ms-20mbit"
        out.append(Variant(f"50ms-20mbit-{codec}", 50, 20, window=BASE_WINDOW, codec=codec))
    for codec in ("bf16", "auto"):  # at 100 Mbit/s, one after the other
        out.append(Variant(f"50ms-{codec}", 50, 100, window=BASE_WINDOW, codec=codec))
    return out


def say(text: str) -> None:
    print(f"[wan {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def join(
    host: Host,
    stage: int,
    slowdown: float,
    v: Variant,
    swarm: str,
    head: str | None,
    log: IO[bytes],
) -> None:
    """Start ``node join`` for ``stage`` inside ``host``."""
    cmd = [sys.executable, "-m", "node", "join", "--stage", str(stage)]
    cmd += ["--listen", f"0.0.0.0:{PORT}", "--swarm", swarm, "--no-zeroconf"]
    settings = [*SETTINGS, f"train.window={v.window}", f"train.wire_codec={v.codec}"]
    settings += [f"train.max_in_flight={v.max_in_flight}", f"swarm.seed={v.seed}"]
    if v.latency_ms:
        settings.append(f"net.inject_latency_s={v.latency_ms / 1e3}")
    if slowdown != 1:
        settings.append(f"train.slowdown={slowdown}")
    if head:
        cmd += ["--bootstrap", head]
    for setting in settings:
        cmd += ["--set", setting]
    host.popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def status(host: Host) -> dict[str, Any]:
    st: dict[str, Any] = fetch_status(f"{host.address}:{PORT}", timeout_s=5.0)
    return st


def wait_for(what: str, check: Any, timeout_s: float, logs: Path) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got = check()
        except ValueError:  # not listening yet
            got = None
        if got:
            return got
        time.sleep(0.5)
    raise RuntimeError(f"{what}: not within {timeout_s:.0f}s; logs in {logs}")


def run(v: Variant, tokens: int, warmup_s: float, logs: Path) -> dict[str, Any]:
    """One variant on a fresh lab; its figures."""
    stages = [s for s in range(4) for _ in range(v.replicas)]
    lab = Lab.create(len(stages))
    outs: list[IO[bytes]] = []
    try:
        lab.reach_from_root()  # to poll the nodes' /status from here
        for host in lab.hosts:
            host.cap_uplink(v.rate_mbit)
        swarm = f"wan-{secrets.token_hex(3)}"
        head = f"{lab.hosts[0].address}:{PORT}"
        for i, (host, stage) in enumerate(zip(lab.hosts, stages, strict=True)):
            slowdown = v.slowdown.get(stage, [1.0] * v.replicas)[i % v.replicas]
            log = (logs / f"{v.name}-{v.window}-{i}-s{stage}.log").open("wb")
            outs.append(log)
            join(host, stage, slowdown, v, swarm, None if i == 0 else head, log)
        heads = [h for h, s in zip(lab.hosts, stages, strict=True) if s == 0]
        blocks = [(h, s) for h, s in zip(lab.hosts, stages, strict=True) if s > 0]
        wait_for(
            "the swarm to train",
            lambda: all(status(h).get("train_s", 0.0) >= warmup_s for h in heads),
            180,
            logs,
        )
        t0 = time.monotonic()
        st0 = {h.name: status(h) for h in lab.hosts}
        windows: list[float] = []
        while True:
            time.sleep(1.0)
            now = [status(h) for h in heads]
            windows += [float(st["window"].get("size", 0)) for st in now]
            spent = sum(st["tokens"] for st in now) >= tokens
            if spent and time.monotonic() - t0 >= MIN_MEASURE_S:
                break
            if time.monotonic() - t0 > 900:
                raise RuntimeError(f"{v.name}: budget not spent in 900 s; logs in {logs}")
        wall = time.monotonic() - t0
        st1 = {h.name: status(h) for h in lab.hosts}
        eval_loss = statistics.mean(request_eval(f"{h.address}:{PORT}") for h in heads)
        done = sum(st1[h.name]["tokens"] - st0[h.name]["tokens"] for h in heads)
        util = {
            f"{i + 1}:s{s}": (st1[h.name]["compute_busy_s"] - st0[h.name]["compute_busy_s"]) / wall
            for i, (h, s) in enumerate(zip(lab.hosts, stages, strict=True))
        }
        out: dict[str, Any] = {
            **asdict(v),
            "tokens_per_s": done / wall,
            "tokens_at_eval": sum(st1[h.name]["tokens"] for h in heads),
            "eval_loss": eval_loss,
            "window_mean": statistics.mean(windows) if windows else None,
            "compute_utilisation": util,
            "utilisation_mean": statistics.mean(util.values()),
            "seconds": wall,
            "wire": {
                f"{i + 1}:s{s}": {k: st1[h.name]["wire"][k] for k in ("codec", "link_mbps")}
                for i, (h, s) in enumerate(zip(lab.hosts, stages, strict=True))
            },
        }
        if v.replicas > 1:
            out["shares"] = shares(blocks, st0, st1)
        return out
    finally:
        lab.close()
        for out_file in outs:
            out_file.close()


def shares(
    blocks: list[tuple[Host, int]], st0: dict[str, Any], st1: dict[str, Any]
) -> list[dict[str, Any]]:
    """Per block replica: its share of its stage's forwards against its share of the stage's
    compute capacity (its service rate, samples per busy second, as it measures it)."""
    rows = []
    for stage in sorted({s for _, s in blocks}):
        mine = [h for h, s in blocks if s == stage]
        fwd = {h.name: st1[h.name]["forwards"] - st0[h.name]["forwards"] for h in mine}
        rate = {h.name: float(st1[h.name]["throughput"]) for h in mine}
        for h in mine:
            work_share = fwd[h.name] / max(1, sum(fwd.values()))
            capacity_share = rate[h.name] / max(1e-9, sum(rate.values()))
            rows.append(
                {
                    "stage": stage,
                    "host": h.name,
                    "forwards": fwd[h.name],
                    "service_rate": rate[h.name],
                    "work_share": work_share,
                    "capacity_share": capacity_share,
                    "share_error": work_share / capacity_share - 1 if capacity_share else None,
                }
            )
    return rows


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each run's ratios to the 0 ms run of its window policy, replicas and seed; the
    headline ratios are medians over seeds."""

    def key(r: dict[str, Any]) -> tuple[str, int, int]:
        return (r["window"], r["replicas"], r.get("seed", 0))

    bases = {key(r): r for r in runs if r["name"] in ("0ms", "2rep-0ms")}
    for r in runs:
        base = bases.get(key(r))
        if base and base["tokens_per_s"] > 0:
            r["ratio_to_0ms"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["eval_loss_vs_0ms"] = r["eval_loss"] / base["eval_loss"] - 1
    out: dict[str, Any] = {}
    for window in ("fixed", "adaptive"):
        for lat in (25, 50, 100):
            rows = [
                r
                for r in runs
                if r["name"] == f"{lat}ms" and r["window"] == window and "ratio_to_0ms" in r
            ]
            if rows:
                out[f"ratio_{lat}ms_{window}"] = statistics.median(r["ratio_to_0ms"] for r in rows)
                out[f"eval_loss_vs_0ms_{lat}ms_{window}"] = statistics.median(
                    r["eval_loss_vs_0ms"] for r in rows
                )
    for lat in (50, 100):
        name = f"ratio_{lat}ms_{BASE_WINDOW}"
        if name in out:
            out[f"ratio_{lat}ms"] = out[name]
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, (ax, lx, bx) = plt.subplots(1, 3, figsize=(15, 4.2))
    for window, color in (("fixed", "tab:blue"), ("adaptive", "tab:orange")):
        rows = [
            r
            for r in runs
            if r["window"] == window and r["replicas"] == 1 and r["rate_mbit"] == 100
        ]
        if not rows:
            continue
        lats = sorted({r["latency_ms"] for r in rows})
        label = f"window {window} (max {rows[0]['max_in_flight']})"
        for axis, key in ((ax, "ratio_to_0ms"), (lx, "eval_loss")):
            axis.scatter(
                [r["latency_ms"] for r in rows],
                [r.get(key, 1.0) for r in rows],
                color=color,
                alpha=0.5,
                s=18,
            )
            medians = [
                statistics.median(r.get(key, 1.0) for r in rows if r["latency_ms"] == lat)
                for lat in lats
            ]
            axis.plot(lats, medians, "-", color=color, label=label)
    ax.axhline(0.8, color="grey", lw=0.8, ls=":")
    ax.axhline(0.7, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("one-way latency (ms), 100 Mbit/s uplinks")
    ax.set_ylabel("tokens/s relative to 0 ms")
    ax.set_title("Throughput against latency (head + 3 stages)")
    lx.set_xlabel("one-way latency (ms), 100 Mbit/s uplinks")
    lx.set_ylabel(f"eval loss after {result['params']['tokens']:,} tokens")
    lx.set_title("Loss at equal tokens (dots: seeds; lines: medians)")
    for axis in (ax, lx):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    mixed = next((r for r in runs if r["name"] == "mixed-50ms"), None)
    if mixed:
        rows = mixed["shares"]
        xs = range(len(rows))
        bx.bar([x - 0.2 for x in xs], [r["capacity_share"] for r in rows], 0.4, label="capacity")
        bx.bar([x + 0.2 for x in xs], [r["work_share"] for r in rows], 0.4, label="microbatches")
        bx.set_xticks(list(xs), [f"s{r['stage']} {r['host'][-1]}" for r in rows], fontsize=8)
        bx.set_ylabel("share of the stage")
        bx.set_title("Mixed swarm at 50 ms: work follows capacity?")
        bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="0 and 50 ms, a small budget (smoke)")
    p.add_argument("--tokens", type=int, default=600_000, help="token budget per run")
    p.add_argument("--warmup-s", type=float, default=10.0)
    p.add_argument(
        "--only",
        default="",
        help="comma-separated variant names to run; their rows replace those in the results",
    )
    p.add_argument("--seed", type=int, default=0, help="swarm.seed of every run")
    p.add_argument(
        "--window", choices=("fixed", "adaptive"), help="only the variants of this window policy"
    )
    p.add_argument("--replot", action="store_true", help="summarise wan.json again and redraw")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.replot:
        path = args.out / "wan.json"
        result = json.loads(path.read_text())
        result.update(summarise(result["runs"]))
        path.write_text(json.dumps(result, indent=2) + "\n")
        plot(result, args.out / "wan.png")
        return dict(result)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the lab is torn down
    ok, why = netns_available()
    if not ok:
        raise SystemExit(f"bench.wan needs network namespaces: {why}")
    tokens = 180_000 if args.quick and args.tokens == 600_000 else args.tokens
    logs = Path(tempfile.mkdtemp(prefix="murmuration-wan-"))
    todo = [
        replace(v, seed=args.seed)
        for v in variants(args.quick)
        if (not args.only or v.name in args.only.split(","))
        and (args.window is None or v.window == args.window)
    ]
    runs = []
    for v in todo:
        say(f"{v.name} (window {v.window}, {v.replicas} per stage): {tokens} tokens")
        r = run(v, tokens, args.warmup_s, logs)
        say(
            f"  {r['tokens_per_s']:,.0f} tokens/s, eval {r['eval_loss']:.3f}, "
            f"window {r['window_mean']}, utilisation {r['utilisation_mean']:.2f}"
        )
        runs.append(r)
    name = "wan-quick" if args.quick else "wan"
    previous = args.out / f"{name}.json"
    if args.only and previous.exists():  # a re-run of some variants: keep the others' rows
        new = {(r["name"], r["window"], r["seed"]) for r in runs}
        kept = json.loads(previous.read_text())["runs"]
        runs = [r for r in kept if (r["name"], r["window"], r.get("seed", 0)) not in new] + runs
    result = {"params": {"tokens": tokens, "warmup_s": args.warmup_s}, "runs": runs}
    result.update(summarise(runs))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / f"{name}.png")
    for k, val in result.items():
        if k.startswith("ratio_"):
            say(f"{k} = {val:.3f}")
    return result


if __name__ == "__main__":
    main()
