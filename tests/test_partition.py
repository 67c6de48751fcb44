"""A network partition with real hosts: cut the swarm in two, heal it, and it is one again.

Six hosts, each its own network namespace, find each other by zeroconf alone and form one
swarm: two head nodes and two replicas of each of two block stages, laid out so that each
half of the lab holds a whole pipeline (head, stage 1, stage 2). Then half of the hosts move
to a bridge of their own: each side expires the other from its tables (after
``membership.ttl_s``) and keeps training alone. Once the bridges are one again, every node
must list all five others within a bound, both heads must still be training, and each
replica must pair with its twin from the other side again (NoLoCo gossip).

Known issue, reported as an expected failure while it lasts: when the replicas' weight
screens had warmed up before the cut, the twins' honest drift apart can look like poisoning
(``too_far``), and each bans the other (``net.ban_s``) instead of pairing again.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import FAST_SWARM, wait_for
from tests.netns import Host, Lab, netns_lab  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.timeout(420)]

PORT = 7070
STAGES = [0, 1, 2, 0, 1, 2]  # hosts 0-2 and 3-5 each hold a whole pipeline
SIDE_A, SIDE_B = [0, 1, 2], [3, 4, 5]
TTL_S = 4.0
SETTINGS = {
    **FAST_SWARM,
    "swarm.num_block_stages": "2",
    "node.join_wait_s": "4",
    "train.max_in_flight": "4",
    "membership.ttl_s": str(TTL_S),
    "data.batch_size": "8",
    "data.seq_len": "64",
    "balance.benchmark_s": "0",
    "sync.outer_steps": "5",  # NoLoCo rounds every few seconds: alone apart, paired after
}
PARTITION_S = 30.0  # how long the sides stay apart: several ttl_s, so all is settled
# Heal to one swarm. Zeroconf reports a peer once, so nothing on the LAN tells either side
# that the other is back: a node finds it by contacting again the addresses of the peers
# that expired, with a backoff capped at swarm.membership.LOST_RETRY_MAX_S = 30 s (requests
# the kernel still retransmits from before the cut may get there first). One retry plus a
# heartbeat round or two to spread the news: 60 s leaves room for a machine shared with
# other work, and a swarm that does not merge again never does.
MERGE_BOUND_S = 60.0


def status(host: Host) -> dict[str, Any]:
    """``/status`` of the node on ``host``, asked from inside its namespace."""
    code = (
        "import sys, urllib.request\n"
        f"r = urllib.request.urlopen('http://127.0.0.1:{PORT}/status', timeout=10)\n"
        "sys.stdout.write(r.read().decode())\n"
    )
    out: dict[str, Any] = json.loads(host.run([sys.executable, "-I", "-c", code], timeout=30))
    return out


def paired_rounds(host: Host) -> int:
    return int(status(host)["sync"]["rounds"].get("paired", 0))


def peers_seen(st: dict[str, Any]) -> set[str]:
    return {p["peer_id"] for ps in st["peers"].values() for p in ps}


def start(lab: Lab, swarm: str, tmp_path: Path) -> list[Any]:
    logs = []
    for stage, host in zip(STAGES, lab.hosts, strict=True):
        log = open(tmp_path / f"{host.name}.log", "wb")  # noqa: SIM115 - closed by the caller
        logs.append(log)
        cmd = [sys.executable, "-m", "node", "join", "--stage", str(stage)]
        cmd += ["--listen", f"0.0.0.0:{PORT}", "--swarm", swarm]
        for key, value in SETTINGS.items():
            cmd += ["--set", f"{key}={value}"]
        host.popen(cmd, stdout=log, stderr=log)
    return logs


def test_a_partitioned_swarm_heals_into_one_and_keeps_training(
    netns_lab: Callable[[int], Lab],  # noqa: F811
    tmp_path: Path,
) -> None:
    lab = netns_lab(len(STAGES))
    logs = start(lab, f"part-{secrets.token_hex(3)}", tmp_path)
    heads = [lab.hosts[i] for i, stage in enumerate(STAGES) if stage == 0]
    try:
        ids: dict[str, str] = {}

        def whole(hosts: list[Host]) -> bool:
            """Each of ``hosts`` is ready and lists exactly the others of ``hosts``."""
            seen = {}
            for host in hosts:
                st = status(host)
                ids[host.name] = st["peer_id"]
                seen[host.name] = peers_seen(st) if st["ready"] else None
            return all(
                seen[host.name] == {ids[h.name] for h in hosts if h is not host} for host in hosts
            )

        wait_for(lambda: whole(lab.hosts), 180, "all six hosts to form one swarm")

        def completed(host: Host) -> int:
            return int(status(host)["counters"].get("microbatches_completed", 0))

        for head in heads:
            wait_for(lambda head=head: completed(head) >= 10, 120, f"{head.name} training")
        # A swarm that has trained together for a while: every replica has paired with its
        # twin often enough for its weight screen to have warmed up (sync.screen_warmup = 3).
        wait_for(
            lambda: all(paired_rounds(h) >= 3 for h in lab.hosts), 120, "three gossip pairings"
        )

        lab.split(SIDE_B)
        t_cut = time.monotonic()
        side_a, side_b = [lab.hosts[i] for i in SIDE_A], [lab.hosts[i] for i in SIDE_B]
        # Each side expires the other after ttl_s; both halves hold a pipeline and train on.
        wait_for(lambda: whole(side_a) and whole(side_b), 60, "each side to forget the other")
        expired_s = time.monotonic() - t_cut
        done = {h.name: completed(h) for h in heads}
        for head in heads:
            wait_for(
                lambda head=head: completed(head) >= done[head.name] + 10,
                90,
                f"{head.name} training alone during the partition",
            )
        time.sleep(max(0.0, t_cut + PARTITION_S - time.monotonic()))

        lab.rejoin()
        t_heal = time.monotonic()
        paired = {h.name: paired_rounds(h) for h in lab.hosts}
        wait_for(lambda: whole(lab.hosts), MERGE_BOUND_S, "the two sides to merge again")
        merged_s = time.monotonic() - t_heal
        steps = {h.name: status(h)["step"] for h in heads}
        done = {h.name: completed(h) for h in heads}
        for head in heads:
            wait_for(
                lambda head=head: (
                    status(head)["step"] > steps[head.name]
                    and completed(head) >= done[head.name] + 10
                ),
                90,
                f"{head.name} training after the merge",
            )
        print(
            f"\npartition: sides forgot each other {expired_s:.1f}s after the cut "
            f"(ttl {TTL_S:.0f}s); one swarm again {merged_s:.1f}s after the heal"
        )
        assert all(p.poll() is None for p in lab.procs), [p.poll() for p in lab.procs]

        # Every stage has one replica on each side: they gossip with each other again.
        twin = {lab.hosts[a].name: lab.hosts[b] for a, b in zip(SIDE_A, SIDE_B, strict=True)}
        twin |= {b.name: lab.hosts[a] for a, b in zip(SIDE_A, twin.values(), strict=True)}

        def paired_again() -> bool:
            sts = {h.name: status(h) for h in lab.hosts}
            banned = {name: st["counters"].get("peers_banned", 0) for name, st in sts.items()}
            # honest drift while apart must not pass for poison (swarm.screen's floor)
            assert not any(banned.values()), f"twins banned each other after the heal: {banned}"
            return all(
                st["sync"]["rounds"].get("paired", 0) > paired[name]
                and st["sync"]["last_partner"] == ids[twin[name].name]
                for name, st in sts.items()
            )

        wait_for(paired_again, 60, "each replica to pair with its twin across the old cut")
    finally:
        for proc in lab.procs:
            proc.terminate()
        for proc in lab.procs:
            proc.wait(timeout=20)
        for log in logs:
            log.close()
        print(
            "\n".join(
                f"--- {h.name}\n" + (tmp_path / f"{h.name}.log").read_text(errors="replace")[-2000:]
                for h in lab.hosts
            )
        )
    assert all(proc.returncode == 0 for proc in lab.procs), [p.returncode for p in lab.procs]
