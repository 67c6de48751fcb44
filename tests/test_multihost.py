"""Three hosts, each its own network namespace on a shared bridge, find each other by
zeroconf alone (no bootstrap address) and train together.

Every host also carries a decoy address that all of them share (as hosts behind the same
Docker bridge or VPN address do), so announcing or dialling the wrong interface fails.
"""

from __future__ import annotations

import json
import secrets
import sys
from collections.abc import Callable
from typing import Any

import pytest

from tests.helpers import wait_for
from tests.netns import Lab, netns_lab  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.timeout(300)]

DECOY = "172.31.255.1"
PORT = 7070


def get_json(lab_host: Any, path: str, method: str = "GET") -> dict[str, Any]:
    code = (
        "import urllib.request, sys\n"
        f"req = urllib.request.Request('http://127.0.0.1:{PORT}{path}', method='{method}', "
        f"data=b'' if '{method}' == 'POST' else None)\n"
        "sys.stdout.write(urllib.request.urlopen(req, timeout=120).read().decode())\n"
    )
    out: dict[str, Any] = json.loads(lab_host.run([sys.executable, "-c", code], timeout=150))
    return out


def test_three_hosts_discover_each_other_by_zeroconf_and_train(
    netns_lab: Callable[[int], Lab],  # noqa: F811
    tmp_path: Any,
) -> None:
    lab = netns_lab(3)
    swarm = f"netns-{secrets.token_hex(3)}"
    for host in lab.hosts:
        host.run(["ip", "addr", "add", f"{DECOY}/24", "dev", "lo"])
    logs = []
    for stage, host in enumerate(lab.hosts):
        log = open(tmp_path / f"{host.name}.log", "wb")  # noqa: SIM115 - closed below
        logs.append(log)
        host.popen(
            [
                sys.executable,
                "-m",
                "node",
                "join",
                "--stage",
                str(stage),
                "--listen",
                f"0.0.0.0:{PORT}",
                "--swarm",
                swarm,
                "--set",
                "swarm.num_block_stages=2",
                "--set",
                "node.join_wait_s=4",
                "--set",
                "train.eval_interval_s=0",
            ],
            stdout=log,
            stderr=log,
        )
    try:
        addresses = {h.address for h in lab.hosts}

        def everyone_sees_everyone() -> bool:
            for host in lab.hosts:
                st = get_json(host, "/status")
                seen = {p["address"].rsplit(":", 1)[0] for ps in st["peers"].values() for p in ps}
                if not st["ready"] or seen != addresses - {host.address}:
                    return False
            return True

        wait_for(
            everyone_sees_everyone,
            120,
            "every host to list the other two at their bridge addresses",
        )
        for host in lab.hosts:
            assert get_json(host, "/status")["address"] == f"{host.address}:{PORT}"
        head = lab.hosts[0]
        before = get_json(head, "/eval", "POST")["eval_loss"]
        wait_for(
            lambda: get_json(head, "/status")["counters"].get("microbatches_completed", 0) >= 40,
            150,
            "40 microbatches",
        )
        after = get_json(head, "/eval", "POST")["eval_loss"]
        assert after < before - 0.5, (before, after)
    finally:
        for proc in lab.procs:
            proc.terminate()
        for proc in lab.procs:
            proc.wait(timeout=15)
        for log in logs:
            log.close()
        text = "\n".join(
            (tmp_path / f"{h.name}.log").read_text(errors="replace")[-3000:] for h in lab.hosts
        )
        print(text)
    assert all(proc.returncode == 0 for proc in lab.procs), [p.returncode for p in lab.procs]
