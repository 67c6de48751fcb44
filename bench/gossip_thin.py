"""NoLoCo between a public replica and one behind a thin uplink: fixed fp32 against ``auto``.

A public head and two replicas of the one block stage (``node join``, real processes): one
public (with ``--public N``, N of them: ``public``, ``public2``, ...), one NATed behind a
router namespace whose uplink is a token bucket of ``--mbit`` Mbit/s with a 1 s queue
(``tests.netns.Lab.cap_router_uplink``), so it serves through a relay. The stage's NoLoCo
contribution (slow weights and pseudo-gradient) is 9.6 MB in fp32; a partner waits
``sync.request_timeout_s`` (10 s) plus its size at ``sync.min_link_mbps`` (10 Mbit/s) for
it, or, where the proposal announced a slower upload, that upload plus 10 s, up to
``sync.max_upload_wait_s``. The NATed replica's hops share its uplink with its gossip, so
its uploads get well under the cap.

For each ``sync.codec`` of ``--codecs`` in turn (the same on every replica), and each
``sync.max_upload_wait_s`` of ``--max-upload-wait-s`` (0: no announced waits),
``--measure-s`` seconds from the moment every replica serves: each replica's rounds (paired,
solo, followed), its RMS distance from the replicas' mean slow weights (sampled in the middle of every
round of the stage's grid, where no boundary's outer step is starting; fetched from inside
the NATed host, which reaches every replica), what its status says of its uplink (the
contribution's seconds to send against a partner's wait), the codec its last round used, its
proposals a round and the bytes it gossiped, and the head's completed microbatches. With
``--against OLD`` every run is made on that commit first (checked out as a worktree,
``bench.ab.this_and``), then on this checkout; each run names its commit. Writes
``bench/results/<--name>.json`` (``gossip_thin``).

Usage: ``python -m bench.gossip_thin [--mbit 5] [--measure-s 240] [--codecs fp32 auto]
[--max-upload-wait-s 60] [--public 1] [--against OLD] [--name gossip_thin]`` (as root: network
namespaces).
"""

from __future__ import annotations

import argparse
import json
import queue
import secrets
import statistics
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.netns import Host

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent
SPREAD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from bench.convergence_sim import distances_from_mean
from bench.sync_unequal import slow_weights
for line in sys.stdin:
    try:
        got = distances_from_mean([slow_weights(a, 1) for a in sys.argv[2:]])
    except Exception as e:
        got = repr(e)
    print(json.dumps([line.strip(), got]), flush=True)
"""
"""Run once inside a host with this checkout's root and the replicas' addresses: for each
line read, that line's text and each replica's RMS distance from their mean slow weights
(or why they could not be had), as one JSON line (this checkout's code whichever commit the
nodes run). One process for the whole run: importing torch in a fresh one for each sample
took much of a round on two busy cores, and 2 samples of 32 timed out."""


def say(text: str) -> None:
    print(f"[gossip_thin {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def public_names(n: int) -> list[str]:
    """The names of ``n`` public replicas in a row: ``public``, ``public2``, ..."""
    return ["public" if i == 0 else f"public{i + 1}" for i in range(n)]


def live(
    codec: str,
    mbit: float,
    measure_s: float,
    round_s: float,
    logs: Path,
    wait_s: float = 60.0,
    n_public: int = 1,
) -> dict[str, Any]:
    """One swarm with ``sync.codec = codec`` and ``sync.max_upload_wait_s = wait_s`` on every
    replica: ``n_public`` public ones and one NATed behind ``mbit``."""
    from tests.helpers import wait_for
    from tests.netns import Lab
    from tests.test_nat import PORT, completed, join, ready_status, status_of

    logs.mkdir(parents=True, exist_ok=True)
    sync = (
        "sync.method=noloco",
        f"sync.round_s={round_s:g}",
        f"sync.codec={codec}",
        f"sync.max_upload_wait_s={wait_s:g}",
    )
    names = public_names(n_public)
    with Lab.create(1 + n_public) as lab:
        head_host, *publics = lab.hosts
        hosts = dict(zip(names, publics, strict=True))
        natted = lab.add_natted()
        lab.cap_router_uplink(lab.routers[-1], mbit, 1000)
        swarm = f"gossip-{secrets.token_hex(3)}"
        head = f"{head_host.address}:{PORT}"
        outs = [
            join(head_host, "0", None, logs / "head.log", swarm, sync),
            *(join(h, "1", head, logs / f"{n}.log", swarm, sync) for n, h in hosts.items()),
            join(
                natted, "1", head, logs / "natted.log", swarm, (*sync, "net.tcp_congestion=cubic")
            ),
        ]
        try:
            for host in (*hosts.values(), natted):
                wait_for(partial(ready_status, host), 180, "every replica to serve")
            done0, t0 = completed(head_host), time.monotonic()
            addresses = [f"{h.address}:{PORT}" for h in hosts.values()] + [f"127.0.0.1:{PORT}"]
            samples = sample_spreads(natted, addresses, round_s, t0 + measure_s)
            elapsed = time.monotonic() - t0
            replicas = {name: status_of(h) for name, h in {**hosts, "natted": natted}.items()}
            done = completed(head_host) - done0
        finally:
            lab.close()
            for out in outs:
                out.close()
    row: dict[str, Any] = {
        "codec_setting": codec,
        "max_upload_wait_s": wait_s,
        "mbit": mbit,
        "measure_s": round(elapsed, 1),
        "head_microbatches": done,
        "replicas": list(replicas),
        "spread_samples": len(samples),
    }
    for i, (name, st) in enumerate(replicas.items()):
        s = st["sync"]
        rounds = s["rounds"]
        paired, solo = int(rounds.get("paired", 0)), int(rounds.get("solo", 0))
        followed = int(rounds.get("followed", 0))  # rounds it took a partner's, sent none
        row[name] = {
            "paired": paired,
            "solo": solo,
            "followed": followed,
            "paired_fraction": paired / max(1, paired + solo),
            "codec": s.get("codec"),
            "contribution_send_s": s["contribution_send_s"],
            "contribution_given_s": s["contribution_given_s"],
            "uplink_too_thin": s["uplink_too_thin"],
            "too_thin_rounds": st["counters"].get("gossip_uplink_too_thin", 0),
            "contribution_exchange_s": s.get("contribution_exchange_s"),  # older: None
            "round_multiple": s.get("round_multiple", 1),  # older: every round
            "link_mbit": st["wire"]["link_mbps"],
            "hop_load_mbit": st["wire"].get("load_mbps"),  # older commits: None
            "spread_rms_mean": s["spread_rms_mean"],  # its partners', at its pairings
            "spread_from_mean": statistics.fmean(x[i] for x in samples) if samples else None,
            "spread_series": [x[i] for x in samples],
            "proposals": s["proposals"],
            "proposals_per_round": round(s["proposals"] / max(1, paired + solo), 1),
            "followers_answered": s.get("followers_answered", 0),  # older: none
            "promises_lapsed": s["promises_lapsed"],
            "sync_mb_sent": round(s["bytes_sent"] / 1e6, 1),
        }
    return row


def sample_spreads(
    natted: Host, addresses: list[str], round_s: float, until: float
) -> list[list[float]]:
    """Until ``until`` (monotonic), in the middle of every round of the stage's grid: each
    replica's RMS distance from the replicas' mean slow weights (``SPREAD``, one process
    inside the ``natted`` host), in the order of ``addresses``. A sample that fails or takes
    over 60 s is said and skipped (a late answer is told apart by its number and dropped)."""
    from bench.sync_unequal import seconds_to_mid_round

    sampler = natted.popen(
        [sys.executable, "-c", SPREAD, str(ROOT), *addresses],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    answers: queue.Queue[str] = queue.Queue()
    assert sampler.stdout is not None and sampler.stdin is not None
    threading.Thread(target=_pass_lines, args=(sampler.stdout, answers), daemon=True).start()
    samples: list[list[float]] = []
    asked = 0
    try:
        while (left := until - time.monotonic()) > 0:
            wait = seconds_to_mid_round(round_s, time.time())
            if wait < 1.0:  # a sample has just been taken in this middle
                wait += round_s
            if wait >= left:
                time.sleep(left)
                break
            time.sleep(wait)
            asked += 1
            try:
                sampler.stdin.write(f"{asked}\n")
                sampler.stdin.flush()
            except OSError:  # it exited: say so, and keep the run's length
                say(f"  the spread sampler exited ({sampler.poll()}); no more samples")
                time.sleep(max(0.0, until - time.monotonic()))
                break
            got = _answer(answers, str(asked), 60.0)
            if isinstance(got, list):
                samples.append(got)
            else:
                say(f"  a spread sample failed: {got}")
    finally:
        sampler.kill()
        sampler.wait()
    return samples


def _pass_lines(stream: IO[str], into: queue.Queue[str]) -> None:
    for line in stream:
        into.put(line)


def _answer(answers: queue.Queue[str], number: str, timeout_s: float) -> list[float] | str:
    """The sampler's answer to request ``number`` within ``timeout_s``, skipping late
    answers to earlier ones; why not, as text, when it fails or does not come."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            tag, got = json.loads(answers.get(timeout=left))
        except queue.Empty:
            break
        if tag == number:
            return got if isinstance(got, list) else str(got)
    return f"no answer within {timeout_s:g} s"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mbit", type=float, default=5.0)
    p.add_argument("--measure-s", type=float, default=240.0)
    p.add_argument("--round-s", type=float, default=30.0)
    p.add_argument("--codecs", nargs="+", default=["fp32", "auto"])
    p.add_argument(
        "--max-upload-wait-s",
        nargs="+",
        type=float,
        default=[60.0],
        help="sync.max_upload_wait_s values, each run with every codec (0: no announced waits)",
    )
    p.add_argument("--public", type=int, default=1, help="public replicas beside the NATed one")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--name", default="gossip_thin", help="the results file's name")
    p.add_argument("--logs", type=Path, default=Path("/tmp/gossip_thin"))
    p.add_argument("--against", help="an older commit to run first, side by side")
    args = p.parse_args(argv)
    from bench.ab import inside, short_rev, this_and

    rows = []
    variants = [(c, w) for w in args.max_upload_wait_s for c in args.codecs]
    with this_and(args.against) as checkouts:
        for (codec, wait_s), (commit, tree) in ((v, c) for v in variants for c in checkouts):
            say(
                f"{commit}: sync.codec {codec}, sync.max_upload_wait_s {wait_s:g}, NATed "
                f"replica behind {args.mbit:g} Mbit/s"
            )
            with inside(tree):
                at = args.logs / f"{codec}-{wait_s:g}-{commit}"
                row = live(codec, args.mbit, args.measure_s, args.round_s, at, wait_s, args.public)
            row["commit"] = commit
            for name in row["replicas"]:
                r = row[name]
                say(
                    f"  {name}: {r['paired']}/{r['paired'] + r['solo']} rounds paired, "
                    f"{r['followed']} followed, {r['followers_answered']} followers answered (each "
                    f"{r['round_multiple']} of the stage's), last in {r['codec']}, send "
                    f"{r['contribution_send_s']} s against {r['contribution_given_s']} s given, "
                    f"exchange {r['contribution_exchange_s']} s, link {r['link_mbit']} Mbit/s, "
                    f"{r['proposals_per_round']} proposals a round, {r['sync_mb_sent']} MB sent, "
                    f"{r['spread_from_mean']} from the replicas' mean"
                )
            say(f"  head: {row['head_microbatches']} microbatches in {row['measure_s']} s")
            rows.append(row)

    result = {
        "commit": short_rev(),
        "params": {
            "mbit": args.mbit,
            "measure_s": args.measure_s,
            "round_s": args.round_s,
            "public_replicas": args.public,
            "uplink": "kernel token bucket, 1 s queue, on the NATed replica's router",
        },
        "runs": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
