"""Volunteers behind home routers: real hosts in network namespaces, real NATs.

A NATed host sits behind its own router namespace, which masquerades its private network
with no port forwarded: it dials out to anyone and nobody dials in. Its heartbeats reach the
public hosts, but every hop sent to it directly would fail. Before, the head listed it as a
ready replica, routed work to it that failed, and it logged "serving stage 1" and nothing
else. Now it asks peers to dial it back, learns it cannot be dialled, and serves through a
relay (``node.net.relay``): a WebSocket it opens to a public peer. The tests:

- a public head and a NATed block node: the head is its relay, and the swarm learns;
- two NATed replicas of one stage behind two routers, a public head and a public relay:
  microbatches reach both replicas and NoLoCo pairs them, all through the relay;
- no peer relays: the NATed node says it is unreachable, with advice, and takes no stage,
  while the swarm trains through a public block node.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import IO, Any

import pytest

from tests.helpers import accounted, wait_for
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


def ready_status(host: Host) -> dict[str, Any] | None:
    """The host's node status once it serves, else None."""
    st = status_of(host)
    return st if st["ready"] else None


def relaying_for(host: Host, capacity: int) -> bool:
    return bool(status_of(host)["relay"]["capacity"] == capacity)


def join(
    host: Host,
    stage: str,
    bootstrap: str | None,
    log: Path,
    swarm: str,
    settings: tuple[str, ...] = (),
) -> IO[bytes]:
    """Start ``node join`` inside ``host``, output to ``log`` (returned, to be closed);
    ``settings``: more ``KEY=VALUE`` settings."""
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
    for setting in settings:
        cmd += ["--set", setting]
    if bootstrap:
        cmd += ["--bootstrap", bootstrap]
    out = log.open("wb")
    host.popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return out


NO_RELAY = ("net.relay_capacity=0",)


def eval_loss(host: Host) -> float:
    code = f"from node.client import request_eval; print(request_eval('127.0.0.1:{PORT}'))"
    return float(host.run([sys.executable, "-c", code], timeout=120))


def completed(host: Host) -> int:
    return int(status_of(host)["counters"].get("microbatches_completed", 0))


def show_logs(tmp_path: Path, names: list[str]) -> None:
    for name in names:
        print(f"--- {name} ---\n" + (tmp_path / f"{name}.log").read_text(errors="replace")[-2500:])


def test_a_natted_block_node_serves_through_the_head_and_the_swarm_learns(
    netns_lab: Callable[[int], Lab],  # noqa: F811
    tmp_path: Path,
) -> None:
    lab = netns_lab(1)
    (public_head,) = lab.hosts
    behind_nat = lab.add_natted()
    swarm = f"nat-{secrets.token_hex(3)}"
    head = f"{public_head.address}:{PORT}"
    logs = [
        join(public_head, "0", None, tmp_path / "head.log", swarm),
        join(behind_nat, "1", head, tmp_path / "natted.log", swarm),
    ]
    try:
        st = wait_for(partial(ready_status, behind_nat), 120, "the NATed node to serve")
        assert st["reachability"]["state"] == "relayed", st["reachability"]
        assert [v["address"] for v in st["relay"]["via"]] == [head]
        wait_for(lambda: completed(public_head) >= 5, 120, "5 microbatches through the relay")
        first = eval_loss(public_head)
        wait_for(lambda: completed(public_head) >= 80, 240, "80 microbatches through the relay")
        last = eval_loss(public_head)
        print(f"eval loss {first:.3f} -> {last:.3f}")
        assert last < first - 0.1
        head_st = status_of(public_head)
        assert head_st["relay"]["nodes"] == [st["peer_id"]]  # one hop: the head is the relay
        text = (tmp_path / "natted.log").read_text(errors="replace")
        assert f"reachability: relayed at 192.168.1.2:{PORT} (via {head})" in text
    finally:
        lab.close()
        for out in logs:
            out.close()
        show_logs(tmp_path, ["head", "natted"])


def test_two_natted_replicas_behind_two_routers_train_and_pair_through_a_relay(
    netns_lab: Callable[[int], Lab],  # noqa: F811
    tmp_path: Path,
) -> None:
    lab = netns_lab(2)
    public_head, public_relay = lab.hosts
    natted = [lab.add_natted(), lab.add_natted()]
    swarm = f"nat-{secrets.token_hex(3)}"
    head = f"{public_head.address}:{PORT}"
    two = ("swarm.num_block_stages=2", "sync.round_s=8")
    logs = [
        join(public_head, "0", None, tmp_path / "head.log", swarm, (*two, *NO_RELAY)),
        join(public_relay, "2", head, tmp_path / "relay.log", swarm, two),
        *(
            join(host, "1", head, tmp_path / f"natted{k}.log", swarm, two)
            for k, host in enumerate(natted)
        ),
    ]
    try:
        relay = f"{public_relay.address}:{PORT}"
        for host in natted:
            st = wait_for(partial(ready_status, host), 120, "NATed replica")
            assert st["reachability"]["state"] == "relayed"
            assert [v["address"] for v in st["relay"]["via"]] == [relay]

        def both_served_and_paired() -> list[dict[str, Any]] | None:
            sts = [status_of(h) for h in natted]
            ok = all(
                s["relay"]["served"].get("ok", 0) >= 10
                and s["sync"]["rounds"].get("paired", 0) >= 1
                for s in sts
            )
            return sts if ok else None

        sts = wait_for(both_served_and_paired, 240, "both replicas served and paired")
        for s in sts:
            print(s["peer_id"][:8], s["relay"]["served"], s["sync"]["rounds"], s["step"])
        relay_st = status_of(public_relay)
        assert sorted(relay_st["relay"]["nodes"]) == sorted(s["peer_id"] for s in sts)
        assert status_of(public_head)["relay"]["capacity"] == 0
    finally:
        lab.close()
        for out in logs:
            out.close()
        show_logs(tmp_path, ["head", "relay", "natted0", "natted1"])


def test_when_the_relay_in_use_dies_the_natted_node_moves_and_training_goes_on(
    netns_lab: Callable[[int], Lab],  # noqa: F811
    tmp_path: Path,
) -> None:
    lab = netns_lab(3)
    public_head, *public_relays = lab.hosts
    behind_nat = lab.add_natted()
    swarm = f"nat-{secrets.token_hex(3)}"
    head = f"{public_head.address}:{PORT}"
    logs = [join(public_head, "0", None, tmp_path / "head.log", swarm, NO_RELAY)]
    relays, procs = [], []
    for k, host in enumerate(public_relays):
        logs.append(join(host, "relay", head, tmp_path / f"relay{k}.log", swarm))
        relays.append(f"{host.address}:{PORT}")
        procs.append(lab.procs[-1])  # the relay-only node's process, to kill
    try:
        for host in public_relays:  # both relay-only nodes up before the NATed node looks
            wait_for(partial(relaying_for, host, 8), 60, "a relay")
        logs.append(join(behind_nat, "1", head, tmp_path / "natted.log", swarm, ("net.relays=1",)))
        st = wait_for(partial(ready_status, behind_nat), 120, "NATed node")
        (used,) = (v["address"] for v in st["relay"]["via"])
        wait_for(lambda: completed(public_head) >= 10, 120, "10 microbatches through the relay")
        os.killpg(procs[relays.index(used)].pid, signal.SIGKILL)  # the relay goes away
        (other,) = (r for r in relays if r != used)
        wait_for(
            lambda: [v["address"] for v in status_of(behind_nat)["relay"]["via"]] == [other],
            60,
            "the NATed node to attach to the other relay",
        )
        before = completed(public_head)
        wait_for(lambda: completed(public_head) >= before + 10, 120, "10 more microbatches")
        head_st = status_of(public_head)
        issued, ended = accounted(head_st["counters"], head_st["pending"])
        assert issued == ended, head_st["counters"]
    finally:
        lab.close()
        for out in logs:
            out.close()
        show_logs(tmp_path, ["head", "relay0", "relay1", "natted"])


def test_with_no_relay_a_node_behind_nat_knows_it_is_unreachable_and_takes_no_stage(
    netns_lab: Callable[[int], Lab],  # noqa: F811
    tmp_path: Path,
) -> None:
    lab = netns_lab(2)
    public_head, public_block = lab.hosts
    behind_nat = lab.add_natted()
    swarm = f"nat-{secrets.token_hex(3)}"
    head = f"{public_head.address}:{PORT}"
    logs = [
        join(public_head, "0", None, tmp_path / "head.log", swarm, NO_RELAY),
        join(public_block, "1", head, tmp_path / "block.log", swarm, NO_RELAY),
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
        show_logs(tmp_path, ["head", "block", "natted"])


def test_natted_auto_nodes_started_together_take_turns_through_the_relay(
    netns_lab: Callable[[int], Lab],  # noqa: F811
    tmp_path: Path,
) -> None:
    """Four ``--stage auto`` volunteers behind four home routers start at once, and with
    them a public head, their bootstrap and only relay. Each learns it cannot be dialled,
    attaches to the head, and only then announces a stage; the announcements of its fellow
    joiners reach it only through the head (pushed over their relay links), later than on a
    LAN. The join's turns (``swarm.balance.settle_join``) must still see them: two on each
    block stage. And each must learn it is NATed before it serves, though the first peers it
    asks to dial it back may be NATed joiners nobody can reach
    (``node.services.reachability``). The head, whose only peers are those joiners, is
    verified by the first that attaches to it (before, nobody could answer its check, and it
    served unverified after three checks, about 10 s)."""
    lab = netns_lab(1)
    (public_head,) = lab.hosts
    natted = [lab.add_natted() for _ in range(4)]
    swarm = f"nat-{secrets.token_hex(3)}"
    head = f"{public_head.address}:{PORT}"
    two = ("swarm.num_block_stages=2", "sync.round_s=8")
    logs = [join(public_head, "0", None, tmp_path / "head.log", swarm, two)]
    names = ["head", *(f"natted{k}" for k in range(4))]
    try:
        logs += [
            join(host, "auto", head, tmp_path / f"natted{k}.log", swarm, two)
            for k, host in enumerate(natted)
        ]
        sts = [wait_for(partial(ready_status, host), 180, "a NATed joiner") for host in natted]
        assert all(s["reachability"]["state"] == "relayed" for s in sts)
        stages = sorted(s["stage"] for s in sts)
        print("stages taken:", stages)
        assert stages == [1, 1, 2, 2], stages
        for k in range(4):
            text = (tmp_path / f"natted{k}.log").read_text(errors="replace")
            assert "stage auto: joining stage" in text
            # it served only once relayed: asked first only NATed joiners like itself
            # (records with no relays yet, that nobody can dial), a node took the silence
            # for "nobody to ask" and served announced as direct, unreachable for 30 s
            relayed, serving = text.find("reachability: relayed"), text.find("serving stage")
            assert 0 <= relayed < serving, text[-3000:]
        st = status_of(public_head)
        print("the head:", st["reachability"])
        assert st["stage"] == 0 and st["reachability"]["state"] == "direct"
        assert set(st["reachability"]["checked_by"]) <= {s["peer_id"] for s in sts}
        assert "serving unverified" not in (tmp_path / "head.log").read_text(errors="replace")
        wait_for(lambda: completed(public_head) >= 1, 120, "a microbatch through the relays")
    finally:
        lab.close()
        for out in logs:
            out.close()
        show_logs(tmp_path, names)


SINK = """
import socket
s = socket.create_server(("0.0.0.0", 9999))
c, _ = s.accept()
while c.recv(1 << 16):
    pass
"""
BULK = """
import socket, sys, time
for _ in range(50):
    try:
        c = socket.create_connection((sys.argv[1], 9999))
        break
    except OSError:
        time.sleep(0.1)
while True:
    c.sendall(bytes(1 << 16))
"""


def test_a_relayed_node_keeps_its_relay_while_its_thin_uplinks_queue_is_full(
    tmp_path: Path,
) -> None:
    """Behind a 0.5 Mbit/s uplink with a 1 s queue, kept full by a bulk upload beside the
    node's own (another program on the volunteer's machine), the answers to the relay's
    pings wait a second and more. The relay must not take that for a dead link: when the
    answer had to come within 1 s, the link dropped within seconds, and the node was
    unreachable until it attached again (then after 30 s)."""
    from bench.uplink_live import natted_swarm
    from tests.netns import netns_available

    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    with natted_swarm(0.5, tmp_path) as (public, natted):
        sink = public.popen([sys.executable, "-c", SINK])
        bulk = natted.popen([sys.executable, "-c", BULK, public.address])
        time.sleep(30)
        # the queue was kept full: the bulk upload is still sending (it exits if it could
        # not connect), and the sink still receiving
        assert bulk.poll() is None and sink.poll() is None
        st = status_of(public)["relay"]
        assert st["attaches"].get("ok") == 1, st  # attached once, never dropped
        assert len(st["nodes"]) == 1, st
