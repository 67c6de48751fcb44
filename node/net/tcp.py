"""TCP congestion control for the daemon's sockets: a bulk upload must not bury small messages.

A volunteer's uplink is thin and its home router's queue is deep (a second or more of
traffic is common: "bufferbloat"). A loss-based congestion control (Linux's default, CUBIC,
or Reno) grows its window until that queue overflows, so while a node uploads its weights
every small message it sends meanwhile (an answer to a proposal, a ping, an ack) waits
behind a full queue. BBR (Cardwell et al., "BBR: Congestion-Based Congestion Control", ACM
Queue 14(5), 2016) paces at the bottleneck's measured rate and keeps about one
bandwidth-delay product in flight, so the queue stays nearly empty and the upload takes as
long. ``bench/uplink_bloat.py`` measures it behind a real router namespace with a 1 s queue.

The daemon asks for ``net.tcp_congestion`` (``bbr`` by default) on every socket it opens:
the server's listening socket (accepted connections inherit it), the transport's and the
relay link's client sockets. Linux lets an unprivileged process choose only a congestion
control listed in ``net.ipv4.tcp_allowed_congestion_control``; where the kernel has no BBR,
or does not allow it, the system default stays, and the node says so once at start, with
what to run. Other systems have no ``TCP_CONGESTION``: nothing is set, nothing is said.

Where the sockets do not get BBR (``net.uplink_pacing = "auto"``, the default), the node
paces its uploads itself (``node.net.pacing``): ``CongestionControl`` hands every connection
it makes or is given to an ``UplinkPacer``, whose task the daemon runs.

Owns: choosing the congestion control of a socket, and whether uploads are paced
(``CongestionControl``). Does not own the sockets (``node.net.transport``,
``node.net.relay``, ``node.server``) or the pacing rule (``node.net.pacing``).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any

from node.net.pacing import SocketLike, UplinkPacer

log = logging.getLogger(__name__)

TCP_CONGESTION: int | None = getattr(socket, "TCP_CONGESTION", None)
"""The socket option (Linux only)."""


def congestion_of(sock: socket.socket) -> str | None:
    """The congestion control a TCP socket uses, or None where the system cannot say."""
    if TCP_CONGESTION is None:
        return None
    raw = sock.getsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, 16)
    return raw.split(b"\0", 1)[0].decode("ascii", "replace")


class CongestionControl:
    """The congestion control ``name`` for this node's sockets, where the system allows it,
    and the node's own pacing of its uploads where they do not get BBR.

    ``name`` empty: the system default, untouched. Otherwise ``check`` tries it once on a
    scratch socket: ``active`` tells whether every later socket gets it, ``why`` why not.
    ``pacing``: ``auto`` (pace where the sockets use a congestion control other than BBR;
    not where the system cannot say, as on other systems than Linux), ``on`` or ``off``;
    ``check`` makes ``pacer`` when pacing.
    """

    def __init__(self, name: str, pacing: str = "off") -> None:
        if pacing not in ("auto", "on", "off"):
            raise ValueError(f"net.uplink_pacing must be auto, on or off, not {pacing!r}")
        self.name = name
        self.pacing = pacing
        self.active = False
        self.why = "" if name else "net.tcp_congestion is empty: the system default"
        self.in_use = ""
        """The congestion control the node's sockets get (``check``; empty: unknown)."""
        self.pacer: UplinkPacer | None = None

    def check(self) -> bool:
        """Try ``name`` on a scratch socket (log once if it cannot be used), and decide on
        pacing. Returns ``active``."""
        self._choose()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            self.apply(probe)
            self.in_use = congestion_of(probe) or ""
        # auto: where the kernel names a congestion control and it is not BBR (a system that
        # cannot say has no TCP_INFO either, which the pacer reads)
        if self.pacing == "on" or (self.pacing == "auto" and self.in_use not in ("", "bbr")):
            self.pacer = UplinkPacer()
            log.info(
                "uploads are paced by the node (net.uplink_pacing=%s; the sockets use %s)",
                self.pacing,
                self.in_use or "the system's congestion control",
            )
        return self.active

    def _choose(self) -> None:
        if not self.name:
            return
        if TCP_CONGESTION is None:
            self.why = "this system has no TCP_CONGESTION socket option"
            return
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.setsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, self.name.encode())
            except OSError as e:
                self.why = f"{e.strerror or e}"
                log.info(
                    "TCP congestion control %r is not available here (%s): this node's "
                    "uploads use the system default%s; to allow it: "
                    "modprobe tcp_%s && sysctl -w net.ipv4.tcp_allowed_congestion_control="
                    '"$(sysctl -n net.ipv4.tcp_allowed_congestion_control) %s"',
                    self.name,
                    self.why,
                    ", which the node paces itself"
                    if self.pacing != "off"
                    else (
                        ", and on a thin uplink with a deep router queue its small messages "
                        "wait behind them"
                    ),
                    self.name,
                    self.name,
                )
                return
        self.active = True

    def apply(self, sock: socket.socket) -> None:
        """Set it on ``sock`` (a TCP socket, before it connects or listens) when active."""
        if self.active and TCP_CONGESTION is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, self.name.encode())
            except OSError as e:  # allowed at start, not now (the sysctl changed): say once
                self.active, self.why = False, f"{e.strerror or e}"
                log.warning("TCP congestion control %r refused: %s", self.name, self.why)

    def govern(self, sock: SocketLike) -> None:
        """Pace the connection ``sock`` when pacing (an accepted one too: ``node.server``)."""
        if self.pacer is not None:
            self.pacer.govern(sock)

    def socket_factory(self) -> Callable[[Any], socket.socket] | None:
        """For ``aiohttp.TCPConnector(socket_factory=...)``: each client socket with it set,
        and paced when pacing (None when neither: aiohttp's own)."""
        if not self.active and self.pacer is None:
            return None

        def make(addr_info: Any) -> socket.socket:
            family, type_, proto, _, _ = addr_info
            sock = socket.socket(family=family, type=type_, proto=proto)
            self.apply(sock)
            self.govern(sock)
            return sock

        return make

    def listening_socket(self, host: str, port: int, backlog: int = 128) -> socket.socket:
        """A non-blocking TCP socket listening on ``host:port`` (address reuse on, as
        aiohttp's sites set it), with this congestion control, which the connections it
        accepts inherit."""
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        # a name with both families ("localhost"): IPv4, as the swarm announces and browses
        family, type_, proto, _, address = next(
            (f for f in found if f[0] == socket.AF_INET), found[0]
        )
        sock = socket.socket(family, type_, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.apply(sock)
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from e
        return sock

    def status(self) -> dict[str, Any]:
        return {
            "wanted": self.name,
            "active": self.active,
            "why": "" if self.active else self.why,
            "in_use": self.in_use,
            "pacing": None if self.pacer is None else self.pacer.status(),
        }
