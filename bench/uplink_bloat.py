"""Small messages behind an upload on a thin uplink with a deep router queue: CUBIC, CUBIC
paced by the node, and BBR.

A volunteer behind a home router uploads its weights (a NoLoCo contribution, a state
transfer) while it keeps sending small messages: answers to proposals, pings, acks. The
router's uplink is the bottleneck, and its queue is deep. With a loss-based congestion
control the upload fills that queue, and every small message waits behind it; with BBR the
queue stays short (``node.net.tcp``, which the daemon uses for ``net.tcp_congestion``), and
so it does with CUBIC when the node paces its uploads itself (``node.net.pacing``, the
daemon's ``net.uplink_pacing``, for where BBR is not allowed).

The lab (``tests/netns.py``): host A behind its own router namespace, whose uplink is a
kernel token bucket (``tc tbf``, ``--mbit`` Mbit/s, a queue of ``--queue-ms``, a bucket of
``--burst``), and a public
host B. The tbf sits on the router, as a home router's queue does: on the sender's own
interface TCP Small Queues would keep it short whatever the congestion control. On A, one
process uploads ``--mb`` MB to B over HTTP (the daemon's body for a large frame) while it
times a small request to B every 100 ms on another connection, with its sockets set through
``node.net.tcp.CongestionControl`` to ``cubic`` (Linux's default), ``cubic`` with the
daemon's ``UplinkPacer`` (``paced``) or ``bbr``, in turn for ``--rounds`` rounds. Per run:
the upload's time, the small requests' round trip idle and during the upload, and the
pacer's pace, measured capacity and queueing delay beside each small request. Writes
``bench/results/uplink_bloat.json`` and ``uplink_bloat.png``.

Usage: ``python -m bench.uplink_bloat [--rounds 3] [--mb 16] [--mbit 10] [--queue-ms 1000]
[--quick]`` (as root: it builds network namespaces).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
VARIANTS = ("cubic", "paced", "bbr")
"""``paced``: CUBIC with the node's own pacing (``node.net.pacing``)."""
PORT = 7070
SMALL_EVERY_S = 0.1


def say(text: str) -> None:
    print(f"[uplink_bloat {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# ---- inside the namespaces ----------------------------------------------------------------


def sink(port: int) -> None:
    """Host B: ``GET /small`` answers two bytes, ``POST /sink`` reads and counts a body."""
    from aiohttp import web

    async def small(_: web.Request) -> web.Response:
        return web.Response(body=b"ok")

    async def take(request: web.Request) -> web.Response:
        n = 0
        async for chunk in request.content.iter_any():
            n += len(chunk)
        return web.Response(text=str(n))

    app = web.Application(client_max_size=1 << 31)
    app.router.add_get("/small", small)
    app.router.add_post("/sink", take)
    web.run_app(app, host="0.0.0.0", port=port, print=None)


async def upload(target: str, congestion: str, mb: float) -> dict[str, Any]:
    """Host A: the upload and the small requests beside it, with ``congestion``."""
    import aiohttp

    from node.net.tcp import CongestionControl, congestion_of
    from node.net.transport import FramePayload

    paced = congestion == "paced"
    cc = CongestionControl("cubic" if paced else congestion, pacing="on" if paced else "off")
    if not cc.check():
        raise SystemExit(f"congestion control {congestion!r} unavailable: {cc.why}")
    pacing = asyncio.create_task(cc.pacer.run()) if cc.pacer is not None else None
    paces: list[tuple[float, float | None, float]] = []

    def session() -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, socket_factory=cc.socket_factory())
        )

    async with session() as bulk, session() as small:

        async def one() -> float:
            t0 = time.perf_counter()
            async with small.get(f"http://{target}/small") as r:
                await r.read()
            return time.perf_counter() - t0

        idle = [await one() for _ in range(10)]
        pooled = [  # the kernel's word that the connection uses it
            congestion_of(proto.transport.get_extra_info("socket"))
            for conns in small.connector._conns.values()  # type: ignore[union-attr]
            for proto, _ in conns
            if proto.transport is not None
        ]
        assert pooled and set(pooled) == {cc.name}, pooled

        async def send() -> float:
            t0 = time.perf_counter()
            # the daemon's body for a large frame: written buffer by buffer
            body = FramePayload([bytes(1 << 20)] * int(mb))
            async with bulk.post(f"http://{target}/sink", data=body) as r:
                assert int(await r.text()) == int(mb) << 20
            return time.perf_counter() - t0

        sending = asyncio.create_task(send())
        await asyncio.sleep(0.5)  # the upload under way: its window grown
        during: list[float] = []
        while not sending.done():
            during.append(await one())
            if cc.pacer is not None:
                st = cc.pacer.status()
                paces.append(
                    (st["pace_bytes_per_s"], st["capacity_bytes_per_s"], st["queueing_ms"])
                )
            await asyncio.sleep(SMALL_EVERY_S)
        upload_s = await sending
    if pacing is not None:
        pacing.cancel()
    return {
        "paces": paces,
        "congestion": congestion,
        "upload_s": upload_s,
        "idle_ms": 1e3 * statistics.median(idle),
        "during_ms": [1e3 * d for d in during],
    }


# ---- the lab --------------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tests.netns import Lab

    runs = []
    with Lab.create(1) as lab:
        (public,) = lab.hosts
        natted = lab.add_natted()
        lab.cap_router_uplink(lab.routers[-1], args.mbit, args.queue_ms, args.burst)
        target = f"{public.address}:{PORT}"
        server = public.popen([sys.executable, "-m", "bench.uplink_bloat", "--sink"])
        try:
            time.sleep(2.0)
            for rnd in range(args.rounds):
                order = VARIANTS if rnd % 2 == 0 else tuple(reversed(VARIANTS))
                for cc in order:
                    cmd = [sys.executable, "-m", "bench.uplink_bloat", "--upload", target]
                    try:
                        out = natted.run(
                            [*cmd, "--cc", cc, "--mb", str(args.mb)],
                            timeout=120 + 16 * args.mb * 8 / args.mbit,
                        )
                    except subprocess.CalledProcessError as e:
                        raise RuntimeError(f"the upload with {cc} failed: {e.stderr}") from None
                    run = json.loads(out.strip().splitlines()[-1])
                    run["round"] = rnd
                    during = sorted(run["during_ms"])
                    say(
                        f"round {rnd + 1}/{args.rounds} {cc}: upload {run['upload_s']:.2f} s, "
                        f"small request idle {run['idle_ms']:.1f} ms, during the upload "
                        f"p50 {statistics.median(during):.0f} ms, max {during[-1]:.0f} ms"
                    )
                    runs.append(run)
        finally:
            server.terminate()
            server.wait(10)
    return runs


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cc in VARIANTS:
        mine = [r for r in runs if r["congestion"] == cc]
        during = sorted(d for r in mine for d in r["during_ms"])
        out[cc] = {
            "upload_s_median": statistics.median(r["upload_s"] for r in mine),
            "idle_ms_median": statistics.median(r["idle_ms"] for r in mine),
            "during_ms_p50": statistics.median(during),
            "during_ms_p95": during[min(len(during) - 1, int(0.95 * len(during)))],
            "during_ms_max": during[-1],
            "small_requests": len(during),
        }
    for other in ("paced", "bbr"):
        out[f"cubic_over_{other}_p50"] = out["cubic"]["during_ms_p50"] / out[other]["during_ms_p50"]
        out[f"upload_s_{other}_over_cubic"] = (
            out[other]["upload_s_median"] / out["cubic"]["upload_s_median"]
        )
    capacities = [c for r in runs if r["congestion"] == "paced" for _, c, _ in r["paces"]]
    out["paced"]["capacity_bytes_per_s_median"] = statistics.median(capacities)
    out["paced"]["paced_share"] = sum(
        1 for r in runs if r["congestion"] == "paced" for p, _, _ in r["paces"] if p
    ) / max(1, len(capacities))
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4))
    every = [d for r in result["runs"] for d in r["during_ms"]]
    bins = list(np.geomspace(max(0.1, min(every)), max(every) * 1.01, 60))
    for cc, colour in zip(VARIANTS, ("tab:red", "tab:green", "tab:blue"), strict=True):
        during = [d for r in result["runs"] if r["congestion"] == cc for d in r["during_ms"]]
        label = "cubic, paced by the node" if cc == "paced" else cc
        ax.hist(during, bins=bins, alpha=0.6, color=colour, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("small request round trip during the upload (ms, log scale)")
    ax.set_ylabel("requests")
    ax.set_title(
        f"{result['mb']} MB upload on {result['mbit']} Mbit/s, router queue {result['queue_ms']} ms"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mb", type=float, default=16.0)
    p.add_argument("--mbit", type=float, default=10.0)
    p.add_argument("--queue-ms", type=int, default=1000)
    p.add_argument(
        "--burst",
        default="10kb",
        help="the token bucket's size; it also bounds the packets the bucket splits, and a "
        "larger one lets the sender's 64 kB offload packets through whole, 52 ms each at "
        "10 Mbit/s, as no real uplink sends them",
    )
    p.add_argument("--quick", action="store_true", help="one round of 4 MB: the smoke test")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--sink", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--upload", metavar="HOST:PORT", help=argparse.SUPPRESS)
    p.add_argument("--cc", default="bbr", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.mb = 1, 4.0
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.sink:
        sink(PORT)
        return {}
    if args.upload:
        print(json.dumps(asyncio.run(upload(args.upload, args.cc, args.mb))))
        return {}
    runs = measure(args)
    result = {
        "rounds": args.rounds,
        "mb": args.mb,
        "mbit": args.mbit,
        "queue_ms": args.queue_ms,
        "burst": args.burst,
        "runs": runs,
        "summary": summarise(runs),
    }
    name = "uplink_bloat-quick" if args.quick else "uplink_bloat"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    if not args.quick:
        plot(result, args.out / f"{name}.png")
    s = result["summary"]
    say(
        f"small request during the upload, p50: cubic {s['cubic']['during_ms_p50']:.0f} ms, "
        f"paced {s['paced']['during_ms_p50']:.0f} ms, bbr {s['bbr']['during_ms_p50']:.0f} ms; "
        f"upload time over cubic's: paced {s['upload_s_paced_over_cubic']:.2f}, bbr "
        f"{s['upload_s_bbr_over_cubic']:.2f}; the pacer measured "
        f"{s['paced']['capacity_bytes_per_s_median'] * 8 / 1e6:.1f} Mbit/s"
    )
    return result


if __name__ == "__main__":
    main()
