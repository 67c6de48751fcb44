"""``node.net.tcp``: the daemon's sockets use the congestion control it asks for, where the
kernel allows it, and say so where it does not. Real sockets on loopback; the congestion
control is read back from the kernel (``TCP_CONGESTION``)."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from node.config import resolve_config
from node.daemon import Node
from node.net.tcp import TCP_CONGESTION, CongestionControl, congestion_of
from protocol.messages import Ping
from swarm.seams import TransportError

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(TCP_CONGESTION is None, reason="no TCP_CONGESTION on this system"),
]

SYSCTL = Path("/proc/sys/net/ipv4")


def another_allowed() -> str:
    """A congestion control this process may choose that is not the system default (so a
    socket that has it was set, not defaulted); skips where there is none."""
    default = (SYSCTL / "tcp_congestion_control").read_text().strip()
    allowed = (SYSCTL / "tcp_allowed_congestion_control").read_text().split()
    others = [name for name in ("reno", *allowed) if name != default]
    if not others:
        pytest.skip(f"only {default} is allowed here")
    return others[0]


def test_what_a_listening_socket_accepts_inherits_its_congestion_control() -> None:
    name = another_allowed()
    cc = CongestionControl(name)
    assert cc.check()
    assert cc.status() == {
        "wanted": name,
        "active": True,
        "why": "",
        "in_use": name,
        "pacing": None,
    }
    listener = cc.listening_socket("127.0.0.1", 0)
    try:
        assert congestion_of(listener) == name
        with socket.create_connection(listener.getsockname(), timeout=5) as client:
            listener.setblocking(True)
            accepted, _ = listener.accept()
            with accepted:
                assert congestion_of(accepted) == name
            assert congestion_of(client) != name  # a plain socket: the system default
        made = cc.socket_factory()
        assert made is not None
        with made((socket.AF_INET, socket.SOCK_STREAM, 0, "", ("127.0.0.1", 0))) as sock:
            assert congestion_of(sock) == name
    finally:
        listener.close()


def test_a_port_in_use_is_named_in_the_error() -> None:
    cc = CongestionControl("")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: Address"):
            cc.listening_socket("127.0.0.1", port)


def test_one_the_kernel_does_not_have_leaves_the_default_and_says_what_to_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cc = CongestionControl("nosuchcc")
    with caplog.at_level(logging.INFO, logger="node.net.tcp"):
        assert not cc.check()
    assert not cc.active and cc.why and cc.socket_factory() is None
    assert "modprobe tcp_nosuchcc" in caplog.text and "system default" in caplog.text
    with socket.socket() as sock:
        default = congestion_of(sock)
        cc.apply(sock)  # inactive: untouched
        assert congestion_of(sock) == default
    empty = CongestionControl("")
    assert not empty.check() and "system default" in empty.status()["why"]


async def test_node_status_says_when_it_could_not_have_it() -> None:
    from node.display import format_status

    base = {"net.listen": "127.0.0.1:0", "net.zeroconf": False}
    node = Node(resolve_config(overrides={**base, "net.tcp_congestion": "nosuchcc"}))
    try:
        await node.start_server()  # the server still listens, with the system default
        st = node.status()
        assert st["tcp_congestion"]["wanted"] == "nosuchcc" and not st["tcp_congestion"]["active"]
        assert "TCP congestion control nosuchcc not available" in format_status(st)
    finally:
        await node.close()


async def test_a_node_asks_for_it_on_its_server_and_its_requests() -> None:
    """Two nodes: the one set to ``name`` listens with it and sends with it; the other,
    with ``net.tcp_congestion`` empty, keeps the system default."""
    name = another_allowed()
    base = {"net.listen": "127.0.0.1:0", "net.zeroconf": False}
    a = Node(resolve_config(overrides={**base, "net.tcp_congestion": name}))
    b = Node(resolve_config(overrides={**base, "net.tcp_congestion": ""}))
    try:
        await a.start_server()
        await b.start_server()
        assert a.status()["tcp_congestion"]["active"]
        assert a.server.socket is not None and congestion_of(a.server.socket) == name
        assert b.server.socket is not None and congestion_of(b.server.socket) != name
        with pytest.raises(TransportError, match="unknown_peer"):  # a round trip is all
            await a.http.request(b.state.address, Ping(sender=a.peer_id), 5)
        sockets = [
            proto.transport.get_extra_info("socket")
            for conns in a.http._session._connector._conns.values()  # type: ignore[union-attr]
            for proto, _ in conns
        ]
        assert sockets and all(congestion_of(s) == name for s in sockets)
    finally:
        await a.close()
        await b.close()
