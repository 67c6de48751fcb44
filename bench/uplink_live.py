"""The daemon itself on a thin uplink with a deep router queue: pacing off against on.

``bench/uplink_bloat.py`` measures the pacer's classes on one upload. This runs the swarm:
a public head and a NATed block node (``node join``, real processes) behind a router
namespace whose uplink is a token bucket of ``--mbit`` Mbit/s with a 1 s queue
(``tests.netns.Lab.cap_router_uplink``). The block node's sockets use CUBIC, as where an
unprivileged process may not have BBR, with ``net.uplink_pacing`` ``off`` or ``auto``, in
turn for ``--rounds`` rounds. Once the swarm trains, the NATed host times a small request
(``GET /status`` of the head) every 0.5 s for ``--probe-s`` seconds, through the router's
queue that the node's uploads (its outputs and gradients, and its relay link) fill, and the
head counts the microbatches completed meanwhile. Writes ``bench/results/uplink_live.json``.
With ``--against REV`` each round runs that commit first (a worktree, ``bench.ab.this_and``),
then this checkout, and writes ``uplink_live-ab.json``; ``--pacing auto`` leaves out the
unpaced runs.

Usage: ``python -m bench.uplink_live [--rounds 2] [--mbit 20] [--probe-s 60] [--pacing off
auto] [--against REV]`` (as root).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.ab import inside, this_and

if TYPE_CHECKING:
    from tests.netns import Host

RESULTS = Path(__file__).parent / "results"
METRICS_PORT = 9100

PROBE = r"""
import json, sys, time, urllib.request
url, until, out = sys.argv[1], time.time() + float(sys.argv[2]), []
while time.time() < until:
    t0 = time.perf_counter()
    try:
        urllib.request.urlopen(url, timeout=10).read()
        out.append(1e3 * (time.perf_counter() - t0))
    except OSError:
        out.append(-1.0)
    time.sleep(0.5)
print(json.dumps(out))
"""


def say(text: str) -> None:
    print(f"[uplink_live {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


@contextmanager
def natted_swarm(
    mbit: float,
    logs: Path,
    head_settings: tuple[str, ...] = (),
    node_settings: tuple[str, ...] = (),
) -> Iterator[tuple[Host, Host]]:
    """A public head and a NATed block node (``node join``), the block node behind a router
    whose uplink is ``mbit`` Mbit/s with a 1 s queue and its sockets on CUBIC; yields
    (public, natted) once the block node serves, their logs in ``logs`` (``head.log``,
    ``natted.log``). Torn down on exit."""
    from tests.helpers import wait_for
    from tests.netns import Lab
    from tests.test_nat import PORT, join, ready_status

    logs.mkdir(parents=True, exist_ok=True)
    with Lab.create(1) as lab:
        (public,) = lab.hosts
        natted = lab.add_natted()
        lab.cap_router_uplink(lab.routers[-1], mbit, 1000)
        swarm = f"uplink-{secrets.token_hex(3)}"
        head = f"{public.address}:{PORT}"
        node_settings = ("net.tcp_congestion=cubic", *node_settings)
        outs = [
            join(public, "0", None, logs / "head.log", swarm, head_settings),
            join(natted, "1", head, logs / "natted.log", swarm, node_settings),
        ]
        try:
            wait_for(partial(ready_status, natted), 120, "the NATed node to serve")
            yield public, natted
        finally:
            lab.close()
            for out in outs:
                out.close()


def live(pacing: str, mbit: float, probe_s: float, logs: Path) -> dict[str, Any]:
    """One swarm with ``net.uplink_pacing = pacing`` on the NATed node; its logs in
    ``logs`` (``head.log``, ``natted.log``)."""
    from tests.helpers import wait_for
    from tests.test_nat import PORT, completed, status_of

    settings = (f"net.uplink_pacing={pacing}", f"net.metrics_port={METRICS_PORT}")
    with natted_swarm(mbit, logs, node_settings=settings) as (public, natted):
        wait_for(lambda: completed(public) >= 5, 120, "five microbatches")
        time.sleep(5)  # the pipeline's window open
        first, t0 = completed(public), time.monotonic()
        head = f"{public.address}:{PORT}"
        cmd = [sys.executable, "-c", PROBE, f"http://{head}/status", str(probe_s)]
        probes = json.loads(natted.run(cmd, timeout=probe_s + 60).strip().splitlines()[-1])
        done, elapsed = completed(public) - first, time.monotonic() - t0
        st = status_of(natted)
        scrape = (
            "import urllib.request as u; "
            f"print(u.urlopen('http://127.0.0.1:{METRICS_PORT}').read().decode())"
        )
        metrics = natted.run([sys.executable, "-c", scrape], timeout=30)
    answered = sorted(p for p in probes if p >= 0)
    return {
        "pacing": pacing,
        "mbit": mbit,
        "in_use": st["tcp_congestion"]["in_use"],
        "microbatches_per_s": done / elapsed,
        "probes": probes,
        "probe_failed": len(probes) - len(answered),
        "probe_p50_ms": statistics.median(answered),
        "probe_p90_ms": answered[int(0.9 * (len(answered) - 1))],
        "probe_max_ms": answered[-1],
        "pacer": st["tcp_congestion"]["pacing"],
        "pacer_first_mbit": first_pace(logs / "natted.log"),
        "uplink_metrics": sorted(
            line.split(" ")[0] for line in metrics.splitlines() if line.startswith("murmur_uplink")
        ),
    }


def first_pace(log: Path) -> float | None:
    """The uplink (Mbit/s) the node's pacer measured when it first engaged, from its log."""
    found = re.search(r"pacing uploads at about ([\d.]+) Mbit/s", log.read_text(errors="replace"))
    return float(found.group(1)) if found else None


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--mbit", type=float, default=20.0)
    p.add_argument("--probe-s", type=float, default=60.0)
    p.add_argument(
        "--pacing", nargs="+", choices=("off", "auto"), default=["off", "auto"], help="in turn"
    )
    p.add_argument(
        "--against",
        metavar="REV",
        help="run each round on this commit too, first (written to uplink_live-ab.json)",
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="uplink_live-"))
    say(f"the nodes' logs: {logs}")
    runs = []
    with this_and(args.against) as checkouts:
        for rnd in range(args.rounds):
            for (commit, tree), pacing in itertools.product(checkouts, args.pacing):
                with inside(tree):
                    run = live(pacing, args.mbit, args.probe_s, logs / f"{rnd}-{commit}-{pacing}")
                run["round"], run["commit"] = rnd, commit
                runs.append(run)
                say(
                    f"round {rnd + 1}/{args.rounds} {commit} pacing {pacing}: small request "
                    f"p50 {run['probe_p50_ms']:.1f} ms, p90 {run['probe_p90_ms']:.1f} ms, max "
                    f"{run['probe_max_ms']:.0f} ms; {run['microbatches_per_s']:.2f} "
                    f"microbatches/s; pacer first read {run['pacer_first_mbit']} Mbit/s"
                )
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"mbit": args.mbit, "probe_s": args.probe_s, "runs": runs}
    name = "uplink_live-ab.json" if args.against else "uplink_live.json"
    (args.out / name).write_text(json.dumps(result, indent=2) + "\n")
    return runs


if __name__ == "__main__":
    main()
