"""A volunteer behind a home router: real hosts in network namespaces, a real NAT.

Host A (public) runs the head stage, host C (public) a block stage; host B sits behind its own
router namespace, which masquerades B's private network with no port forwarded, so B dials
out to anyone and nobody dials in. B's heartbeats reach A, but every hop to B would fail.
Before, A listed B as a ready replica, routed work to it that failed, and B logged "serving
stage 1" and nothing else. Now B asks peers to dial it back, learns it is unreachable, says
so (log, ``node status``, advice), takes no stage, and the swarm trains through C.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pytest

from tests.helpers import wait_for
from tests.netns import Host, Lab, netns_lab  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.timeout(300)]

PORT = 7070


def status_of(host: Host) -> dict[str, Any]:
    """``node status --json`` run inside the host's namespace (its own 127.0.0.1)."""
    out = host.run(
        [sys.executable, "-m", "node", "status", f"127.0.0.1:{PORT}", "--json"], timeout=60
    )
    st: dict[str, Any] = json.loads(out)
    return st


def join(host: Host, stage: str, bootstrap: str | None, log: Path, swarm: str) -> IO[bytes]:
    """Start ``node join`` inside ``host``, output to ``log`` (returned, to be closed)."""
    cmd = [
        sys.executable,
        "-m",
        "node",
        "join",
        "--stage",
        stage,
        "--listen",
        f"0.0.0.0:{PORT}",
        "--swarm",
        swarm,
        "--no-zeroconf",
        "--set",
        "swarm.num_block_stages=1",
        "--set",
        "train.eval_interval_s=0",
        "--set",
        "node.join_wait_s=2",
        "--set",
        "net.reachability_retry_s=5",
        "--set",
        "balance.benchmark_s=0",
    ]
    if bootstrap:
        cmd += ["--bootstrap", bootstrap]
    out = log.open("wb")
    host.popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return out


def test_a_node_behind_nat_knows_it_is_unreachable_and_takes_no_stage(
    netns_lab: Callable[[int], Lab],  # noqa: F811
    tmp_path: Path,
) -> None:
    lab = netns_lab(2)
    public_head, public_block = lab.hosts
    behind_nat = lab.add_natted()
    swarm = f"nat-{secrets.token_hex(3)}"
    head = f"{public_head.address}:{PORT}"
    logs = [
        join(public_head, "0", None, tmp_path / "head.log", swarm),
        join(public_block, "1", head, tmp_path / "block.log", swarm),
        join(behind_nat, "1", head, tmp_path / "natted.log", swarm),
    ]
    try:
        st = wait_for(
            lambda: (s := status_of(behind_nat))["reachability"]["state"] == "unreachable" and s,
            90,
            "the NATed node to find itself unreachable",
        )
        assert st["stage"] == -1 and not st["ready"], st
        assert "forward TCP port 7070" in st["reachability"]["advice"]
        assert f"192.168.1.2:{PORT}" == st["reachability"]["address"]
        log_text = (tmp_path / "natted.log").read_text(errors="replace")
        assert "reachability: unreachable" in log_text and "serving stage" not in log_text

        def head_trains_without_it() -> dict[str, Any] | None:
            s = status_of(public_head)
            done = s["counters"].get("microbatches_completed", 0)
            return s if done >= 20 else None

        head_st = wait_for(head_trains_without_it, 150, "20 microbatches through the public block")
        natted = [
            p for ps in head_st["peers"].values() for p in ps if p["address"].startswith("192.168.")
        ]
        assert natted and not any(p["ready"] for p in natted)  # heard of, never ready
        assert status_of(public_block)["reachability"]["state"] == "direct"
        text = lab.natted[0].run(
            [sys.executable, "-m", "node", "status", f"127.0.0.1:{PORT}"], timeout=60
        )
        assert "reachability: unreachable" in text and "forward TCP port" in text
    finally:
        lab.close()
        for out in logs:
            out.close()
        for name in ("head", "block", "natted"):
            print(
                f"--- {name} ---\n" + (tmp_path / f"{name}.log").read_text(errors="replace")[-2500:]
            )
