"""Tests of swarm.discovery: address selection (pure), zeroconf on loopback, zeroconf across hosts."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import secrets
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from swarm import discovery
from swarm.discovery import (
    Sighting,
    ZeroconfDiscovery,
    announce_addresses,
    instance_label,
    local_ipv4_networks,
    outbound_address,
    pick_address,
)
from tests.netns import Lab, netns_lab  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parent.parent


def nets(*specs: str) -> list[ipaddress.IPv4Interface]:
    return [ipaddress.IPv4Interface(spec) for spec in specs]


# --- pick_address -----------------------------------------------------------------------------


def test_pick_prefers_a_candidate_on_our_subnet() -> None:
    local = nets("127.0.0.1/8", "10.0.0.1/24")
    assert pick_address(["192.168.1.5", "10.0.0.7"], local) == "10.0.0.7"


def test_pick_most_specific_prefix_wins() -> None:
    local = nets("10.0.0.1/8", "10.1.9.1/24")
    assert pick_address(["10.2.2.2", "10.1.9.9"], local) == "10.1.9.9"
    assert pick_address(["10.2.2.2", "10.3.3.3"], local) == "10.2.2.2"  # tie: the first


def test_pick_without_a_shared_subnet_takes_the_first_routable() -> None:
    local = nets("127.0.0.1/8", "10.0.0.1/24")
    assert pick_address(["127.0.0.1", "169.254.1.1", "203.0.113.5", "198.51.100.1"], local) == (
        "203.0.113.5"
    )
    assert pick_address(["peer.example", "127.0.0.1"], local) == "peer.example"


def test_pick_loopback_and_link_local_come_last() -> None:
    local = nets("127.0.0.1/8", "10.0.0.1/24")
    assert pick_address(["127.0.0.1", "169.254.3.3"], local) == "127.0.0.1"
    assert pick_address(["169.254.3.3", "127.0.0.1"], local) == "169.254.3.3"
    # loopback "matches" our 127/8 but is the peer's own loopback, not ours
    assert pick_address(["127.0.0.1", "192.0.2.9"], local) == "192.0.2.9"


def test_pick_link_local_on_our_link_beats_an_unrelated_routable() -> None:
    local = nets("169.254.7.7/16")
    assert pick_address(["192.168.1.5", "169.254.3.4"], local) == "169.254.3.4"


def test_pick_skips_our_own_address_shared_by_every_host() -> None:
    # every host has the same Docker bridge: 172.17.0.1 is "me", not the peer
    local = nets("127.0.0.1/8", "172.17.0.1/16", "10.0.0.1/24")
    assert pick_address(["172.17.0.1", "10.0.0.7"], local) == "10.0.0.7"
    assert pick_address(["172.17.0.1", "203.0.113.5"], local) == "203.0.113.5"
    # a peer on this very host announces only our own addresses: any of them works
    assert pick_address(["172.17.0.1", "10.0.0.1"], local) == "172.17.0.1"


def test_pick_rejects_an_empty_list() -> None:
    with pytest.raises(ValueError):
        pick_address([], nets("10.0.0.1/24"))


def test_pick_defaults_to_this_hosts_interfaces() -> None:
    assert pick_address(["127.0.0.1"]) == "127.0.0.1"
    assert any(net.ip.is_loopback for net in local_ipv4_networks())


def test_sighting_best_address_is_host_port() -> None:
    sighting = Sighting("ab", "s", "f", ("127.0.0.1",), 7001)
    assert sighting.best_address() == "127.0.0.1:7001"


# --- announce_addresses, outbound_address, instance_label -------------------------------------


def test_announce_a_specific_listen_address_alone() -> None:
    assert announce_addresses("10.0.0.5") == ["10.0.0.5"]


def test_announce_wildcard_lists_every_non_loopback_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = nets("127.0.0.1/8", "10.0.0.1/24", "192.168.1.2/24", "10.0.0.1/24")
    monkeypatch.setattr(discovery, "local_ipv4_networks", lambda: fake)
    assert announce_addresses("0.0.0.0") == ["10.0.0.1", "192.168.1.2"]
    assert announce_addresses("") == ["10.0.0.1", "192.168.1.2"]


def test_announce_wildcard_on_a_loopback_only_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discovery, "local_ipv4_networks", lambda: nets("127.0.0.1/8"))
    assert announce_addresses("0.0.0.0") == ["127.0.0.1"]


def test_outbound_address_to_loopback() -> None:
    assert outbound_address("127.0.0.1") == "127.0.0.1"


def test_instance_label_is_a_valid_dns_label() -> None:
    label = instance_label("ab" * 64)
    assert label.startswith("murmur-abab") and len(label.encode()) <= 63
    assert instance_label("x.y z") == "murmur-x-y-z"
    with pytest.raises(ValueError):
        instance_label("")


# --- real zeroconf on loopback, one process ----------------------------------------------------


def recorder(into: dict[str, Sighting]) -> Callable[[Sighting], None]:
    def record(sighting: Sighting) -> None:
        into[sighting.peer_id] = sighting

    return record


async def test_zeroconf_on_loopback_reports_only_same_swarm_and_fingerprint() -> None:
    threads_before = set(threading.enumerate())
    swarm, other_swarm = f"test-{secrets.token_hex(4)}", f"other-{secrets.token_hex(4)}"
    # (swarm, fingerprint) per node: a, b pair up; c, d pair up in another swarm (a positive
    # control that they were announced); e shares the swarm name but not the fingerprint.
    plan = {
        "a": (swarm, "fp1"),
        "b": (swarm, "fp1"),
        "c": (other_swarm, "fp1"),
        "d": (other_swarm, "fp1"),
        "e": (swarm, "fp2"),
    }
    ids = {name: secrets.token_hex(32) for name in plan}  # 64 hex chars: label truncation too
    seen: dict[str, dict[str, Sighting]] = {name: {} for name in plan}
    nodes = [
        ZeroconfDiscovery(
            swarm=sw,
            fingerprint=fp,
            peer_id=ids[name],
            port=7000 + i,
            addresses=["127.0.0.1"],
            interfaces=["127.0.0.1"],
            on_sighting=recorder(seen[name]),
        )
        for i, (name, (sw, fp)) in enumerate(plan.items())
    ]
    expected = {"a": {ids["b"]}, "b": {ids["a"]}, "c": {ids["d"]}, "d": {ids["c"]}, "e": set()}
    try:
        await asyncio.wait_for(asyncio.gather(*(node.start() for node in nodes)), 15)
        deadline = time.monotonic() + 10
        while any(set(seen[n]) != expected[n] for n in ("a", "b", "c", "d")):
            assert time.monotonic() < deadline, f"not all pairs met: {seen}"
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.5)  # time for any wrong sighting (e, or c/d in a/b) to arrive
        assert {name: set(found) for name, found in seen.items()} == expected
        sighting = seen["a"][ids["b"]]
        assert (sighting.swarm, sighting.fingerprint, sighting.port) == (swarm, "fp1", 7001)
        assert sighting.addresses == ("127.0.0.1",)
        assert sighting.best_address() == "127.0.0.1:7001"
    finally:
        started = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(node.stop() for node in nodes)), 20)
        assert time.monotonic() - started < 10
    await asyncio.wait_for(nodes[0].stop(), 1)  # idempotent
    deadline = time.monotonic() + 3
    while set(threading.enumerate()) - threads_before and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert set(threading.enumerate()) - threads_before == set()


async def test_stop_before_start_is_a_no_op() -> None:
    node = ZeroconfDiscovery(
        swarm="s", fingerprint="f", peer_id="ab", port=1, on_sighting=lambda s: None
    )
    await asyncio.wait_for(node.stop(), 1)
    with pytest.raises(RuntimeError):
        await node.start()


# --- real hosts: one namespace each, zeroconf on all their interfaces ---------------------------

CHILD = textwrap.dedent(
    """
    import asyncio, json, sys
    from swarm.discovery import ZeroconfDiscovery

    async def main(peer_id: str, port: int, swarm: str, run_s: float) -> None:
        def report(s):
            line = {"peer_id": s.peer_id, "best": s.best_address(), "addresses": s.addresses}
            print(json.dumps(line), flush=True)

        node = ZeroconfDiscovery(
            swarm=swarm, fingerprint="fp", peer_id=peer_id, port=port, on_sighting=report
        )
        await node.start()
        await asyncio.sleep(run_s)
        await asyncio.wait_for(node.stop(), 10)

    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])))
    """
)
DECOY = "172.31.255.1"  # the same extra address on every host, like a Docker bridge


@pytest.mark.netns
@pytest.mark.slow
def test_zeroconf_across_namespaces_picks_each_peers_lan_address(
    netns_lab: Callable[[int], Lab],  # noqa: F811
    tmp_path: Path,
) -> None:
    lab = netns_lab(3)
    script = tmp_path / "discover.py"
    script.write_text(CHILD)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    swarm = f"test-{secrets.token_hex(4)}"
    peer_ids = [secrets.token_hex(8) for _ in lab.hosts]
    for host in lab.hosts:
        # a second interface address every host shares: the multi-interface trap
        host.run(["ip", "addr", "add", f"{DECOY}/24", "dev", "lo"])
    procs = [
        host.popen(
            [sys.executable, str(script), peer_ids[i], str(7000 + i), swarm, "8"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i, host in enumerate(lab.hosts)
    ]
    for i, proc in enumerate(procs):
        out, err = proc.communicate(timeout=40)
        assert proc.returncode == 0, err
        best = {line["peer_id"]: line for line in map(json.loads, out.splitlines())}
        others = {j for j in range(len(lab.hosts)) if j != i}
        assert set(best) == {peer_ids[j] for j in others}, (out, err)
        for j in others:
            assert best[peer_ids[j]]["best"] == f"{lab.hosts[j].address}:{7000 + j}"
            assert sorted(best[peer_ids[j]]["addresses"]) == sorted([lab.hosts[j].address, DECOY])


@pytest.mark.netns
def test_netns_lab_cut_heal_and_cleanup(netns_lab: Callable[[int], Lab]) -> None:  # noqa: F811
    lab = netns_lab(2)
    names = [host.name for host in lab.hosts]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    assert all(name in listed.stdout for name in names)
    assert all(len(host.veth) <= 15 for host in lab.hosts)
    assert lab.hosts[0].run(["ip", "-4", "-o", "addr", "show", "eth0"]).count(lab.hosts[0].address)

    def master(i: int) -> str:
        show = subprocess.run(
            ["ip", "-o", "link", "show", lab.hosts[i].veth], capture_output=True, text=True
        )
        return show.stdout

    lab.cut(1)
    assert f"master {lab.bridge}" not in master(1)
    lab.heal(1)
    assert f"master {lab.bridge}" in master(1)
    sleeper = lab.hosts[0].popen(["sleep", "60"])
    lab.close()
    assert sleeper.poll() is not None
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    assert not any(name in listed.stdout for name in names)
    bridge = subprocess.run(["ip", "link", "show", lab.bridge], capture_output=True, text=True)
    assert bridge.returncode != 0
