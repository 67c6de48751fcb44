"""``node.net.pacing``: the rule against hand-computed steps, ``TCP_INFO`` read from real
loopback connections, and caps set on and lifted from real sockets (read back from the
kernel). The rule's effect behind a real router with a deep queue is the uplink benchmark's
(``tests/test_bench_uplink_bloat.py``, ``bench/README.md``)."""

from __future__ import annotations

import socket
import struct
import threading
from pathlib import Path

import pytest

from node.config import resolve_config
from node.daemon import Node
from node.net import pacing
from node.net.pacing import (
    FORGET_S,
    MIN_RATE,
    SO_MAX_PACING_RATE,
    TARGET_S,
    UNPACED,
    PaceRule,
    TcpInfo,
    UplinkPacer,
    tcp_info,
)
from node.net.tcp import CongestionControl
from protocol.messages import Ping
from swarm.seams import TransportError

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(pacing.TCP_INFO is None, reason="no TCP_INFO on this system"),
]


def cap_of(sock: socket.socket) -> int:
    (rate,) = struct.unpack("<Q", sock.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, 8))
    return int(rate)


def gain(delay_s: float) -> float:
    """The rule as the module docstring states it, written again: 1 + (25 ms - delay) /
    100 ms, held within [0.25, 1.25]."""
    return min(1.25, max(0.25, 1 + (0.025 - delay_s) / 0.1))


def test_the_rule_paces_only_once_the_queue_passed_its_target_and_forgets_when_idle() -> None:
    rule = PaceRule()
    assert rule.pace(0.0, None, 0) is None  # nothing uploading
    assert rule.pace(0.1, 0.010, 0) is None  # uploading, but the queue is short
    # 0.4 s after the first uploading reading 600 kB were acknowledged: 1.5 MB/s, queue 125 ms
    pace = rule.pace(0.5, 0.125, 600_000)
    assert rule.pacing and rule.capacity == pytest.approx(600_000 / 0.4)
    assert pace == pytest.approx(1.5e6 * 0.25)  # 100 ms over the target: the least gain
    # the queue drained to 5 ms; goodput over the last half second (0.1 -> 0.6): 1.38 MB/s
    pace = rule.pace(0.6, 0.005, 690_000)
    assert rule.capacity == pytest.approx(1.5e6)  # the window's largest
    assert pace == pytest.approx(1.5e6 * gain(0.005))  # 1.2: probing
    pace = rule.pace(0.7, TARGET_S, 750_000)
    assert pace == pytest.approx(rule.capacity)  # at the target: the capacity itself
    # nothing uploading: the capacity is held for the next upload, then forgotten
    assert rule.pace(1.0, None, 800_000) == pytest.approx(rule.capacity)
    assert rule.pace(0.7 + FORGET_S + 0.1, None, 800_000) is None
    assert not rule.pacing and rule.capacity == 0.0


def test_goodput_counts_uploading_time_only() -> None:
    """An upload that starts between two readings is not averaged with the idle time before
    it, and one resuming after a pause keeps the capacity until it has measured anew."""
    rule = PaceRule()
    rule.pace(0.0, None, 0)
    rule.pace(0.25, None, 0)  # idle readings: nothing to measure from
    # the upload started just before 0.5; 1 MB/s from then on, the queue past its target
    assert rule.pace(0.5, 0.05, 10_000) is None  # no goodput yet: not paced
    rule.pace(0.75, 0.06, 260_000)
    assert rule.capacity == pytest.approx(1e6)  # 250 kB in 0.25 s, not 260 kB in 0.75 s
    assert rule.pacing
    rule.pace(1.0, None, 510_000)  # a pause
    rule.pace(5.0, None, 510_000)
    pace = rule.pace(5.05, 0.03, 515_000)  # uploading again, the old goodput long gone
    assert rule.capacity == pytest.approx(1e6)  # kept, not read off 0.05 s nor lost
    assert pace == pytest.approx(1e6 * gain(0.03))
    rule.pace(5.3, 0.03, 765_000)
    assert rule.capacity == pytest.approx(1e6)  # measured anew: 250 kB in 0.25 s


def test_the_gain_against_the_statement_and_a_floor_under_the_pace() -> None:
    for delay in (0.0, 0.01, 0.025, 0.05, 0.075, 0.1, 0.5, 3.0):
        rule = PaceRule()
        rule.pace(0.0, 0.2, 0)
        assert rule.pace(0.5, delay if delay > TARGET_S else 0.2, 1_000_000) is not None
        pace = rule.pace(0.6, delay, 1_000_000)  # no new bytes: the window keeps 2 MB/s
        assert pace == pytest.approx(max(MIN_RATE, 2e6 * gain(delay)))
    stalled = PaceRule()
    stalled.pace(0.0, 1.0, 0)
    assert stalled.pace(0.5, 1.0, 0) == MIN_RATE  # nothing acknowledged: still a pace


def connected_pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname(), timeout=5)
    server, _ = listener.accept()
    return listener, client, server


def test_tcp_info_reads_round_trips_and_bytes_acknowledged() -> None:
    listener, client, server = connected_pair()
    with listener, client, server:
        got = bytearray()
        reader = threading.Thread(target=lambda: got.extend(read_all(server, 4 << 20)))
        reader.start()
        client.sendall(bytes(4 << 20))
        reader.join(10)
        assert len(got) == 4 << 20
        info = tcp_info(client)
        assert info is not None
        assert info.acked >= (4 << 20) - 65536 and info.unsent == 0
        assert 0 < info.min_rtt_s <= info.srtt_s < 1.0
        assert not info.uploading
    assert tcp_info(client) is None  # closed


def read_all(sock: socket.socket, n: int) -> bytes:
    parts, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            break
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


async def test_the_pacer_caps_its_sockets_and_lifts_the_caps_when_it_forgets() -> None:
    listener, client, server = connected_pair()
    with listener, client, server:
        pacer = UplinkPacer()
        pacer.govern(client)
        pacer.tick(0.0)
        assert cap_of(client) == UNPACED and pacer.total_pace is None
        # as after an upload through a deep queue: a capacity of 1 MB/s, held
        pacer.rule.pacing, pacer.rule.capacity, pacer.rule.last_upload = True, 1e6, 0.0
        pacer.tick(1.0)
        assert pacer.total_pace == 1e6 and cap_of(client) == 1_000_000  # idle: the whole pace
        pacer.govern(server)  # a socket added while a pace is held is capped at once
        assert cap_of(server) == 1_000_000
        assert pacer.status()["sockets"] == 2 and pacer.status()["pacing"]
        pacer.tick(FORGET_S + 1.0)
        assert pacer.total_pace is None
        assert cap_of(client) == UNPACED and cap_of(server) == UNPACED
    pacer.tick(FORGET_S + 2.0)  # closed sockets are dropped
    assert pacer.status()["sockets"] == 0


def test_an_uploading_connection_gets_a_share_and_the_least_delay_counts() -> None:
    infos = [
        TcpInfo(srtt_s=0.3, min_rtt_s=0.02, in_flight=200_000, unsent=0, acked=0),
        TcpInfo(srtt_s=0.07, min_rtt_s=0.02, in_flight=100_000, unsent=10_000, acked=0),
        TcpInfo(srtt_s=0.9, min_rtt_s=0.02, in_flight=1_000, unsent=0, acked=0),  # idle
    ]
    assert [i.uploading for i in infos] == [True, True, False]
    assert min(i.queueing_s for i in infos if i.uploading) == pytest.approx(0.05)
    assert TcpInfo(srtt_s=0.1, min_rtt_s=0.0, in_flight=0, unsent=0, acked=0).queueing_s == 0


def test_auto_paces_where_the_sockets_do_not_get_bbr() -> None:
    reno = CongestionControl("reno", "auto")  # every Linux allows reno
    reno.check()
    assert reno.in_use == "reno" and reno.pacer is not None
    assert reno.status()["pacing"] == reno.pacer.status()
    missing = CongestionControl("nosuchcc", "auto")  # the system default is what counts
    missing.check()
    default = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    assert missing.in_use == default and (missing.pacer is None) == (default == "bbr")
    assert (missing.socket_factory() is None) == (default == "bbr")
    off = CongestionControl("nosuchcc", "off")
    off.check()
    assert off.pacer is None and off.status()["pacing"] is None
    bbr = CongestionControl("bbr", "auto")
    if bbr.check():
        assert bbr.in_use == "bbr" and bbr.pacer is None
    with pytest.raises(ValueError, match="net.uplink_pacing must be auto, on or off"):
        CongestionControl("bbr", "sometimes")


def test_auto_does_not_pace_where_the_system_cannot_name_the_congestion_control(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Other systems than Linux have neither ``TCP_CONGESTION`` nor ``TCP_INFO``: ``auto``
    leaves their sockets alone, ``on`` is taken at its word."""
    monkeypatch.setattr("node.net.tcp.congestion_of", lambda sock: None)
    unknown = CongestionControl("", "auto")
    unknown.check()
    assert unknown.in_use == "" and unknown.pacer is None
    forced = CongestionControl("", "on")
    forced.check()
    assert forced.pacer is not None


async def test_a_pacing_node_governs_its_own_connections_and_those_peers_open_to_it() -> None:
    from node.display import format_status

    base = {"net.listen": "127.0.0.1:0", "net.zeroconf": False, "net.uplink_pacing": "on"}
    a = Node(resolve_config(overrides=base))
    b = Node(resolve_config(overrides=base))
    try:
        await a.start_server()
        await b.start_server()
        with pytest.raises(TransportError, match="unknown_peer"):  # a round trip is all
            await a.http.request(b.state.address, Ping(sender=a.peer_id), 5)
        assert a.congestion.pacer is not None and b.congestion.pacer is not None
        assert a.congestion.pacer.status()["sockets"] == 1  # its request's connection
        assert b.congestion.pacer.status()["sockets"] == 1  # the one a opened to it
        st = a.status()["tcp_congestion"]
        assert st["pacing"]["sockets"] == 1 and not st["pacing"]["pacing"]
        format_status(a.status())  # renders
    finally:
        await a.close()
        await b.close()
