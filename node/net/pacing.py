"""Uplink pacing where BBR is not allowed: uploads keep the router's queue short themselves.

``node.net.tcp`` asks for BBR so that a node's uploads do not fill its home router's deep
queue. Most distributions do not let an unprivileged process choose BBR, and then the
system's loss-based congestion control (CUBIC) fills that queue to the brim on every upload:
each small message the node sends meanwhile waits a second behind it
(``bench/uplink_bloat.py``). This module does, in the daemon, what a delay-based
congestion control does in the kernel, with what Linux gives any process: it reads each
connection's round-trip times (``TCP_INFO``) and caps the rate at which the kernel sends
(``SO_MAX_PACING_RATE``, which turns on the kernel's own per-socket pacing).

The rule (``docs/algorithms.md`` section 12), the daemon's own but built from two published
ideas:

- **The signal is queueing delay**, as in LEDBAT (RFC 6817, "Low Extra Delay Background
  Transport"): a connection's smoothed round trip less the least it has seen (the kernel's
  windowed ``min_rtt``) is the time its packets wait in queues. The uplink's queue is
  shared by every connection the node has, so the node takes the *least* delay over the
  connections that are uploading: a queue on one peer's side (its downlink) shows on that
  connection only and does not throttle the others.
- **The rate follows the bottleneck's measured delivery rate**, as BBR's does (Cardwell et
  al., ACM Queue 14(5), 2016): the largest goodput (bytes acknowledged over ``GOODPUT_S``,
  summed over the node's connections) of the last ``WINDOW_S`` seconds is the uplink's
  capacity ``C``. (The kernel's own ``delivery_rate`` read 20 times the bottleneck behind a
  token bucket, acknowledgements arriving in bursts; goodput over half a second does not.)
  Goodput is measured over uploading time only: a reading with nothing uploading starts
  the measurement afresh, so an upload that begins between two readings is not averaged
  with the idle time before it (which read a 1 Mbit/s uplink as 0.4 when a pipeline's
  uploads came and went). While no goodput of the last ``WINDOW_S`` is at hand (an upload
  resuming after a pause), ``C`` stays what it was.
  The node paces at ``C * gain``, with ``gain = 1 + (TARGET_S - delay) / DRAIN_S`` held
  within [``MIN_GAIN``, ``MAX_GAIN``]: above ``C`` while the queue is shorter than
  ``TARGET_S`` (probing for more), below it while the queue is longer (draining it within
  about ``DRAIN_S``). So the queue settles near ``TARGET_S`` and the upload runs at the
  capacity. The pace is split evenly between the connections that are uploading.

Pacing starts only once an upload has pushed the delay past ``TARGET_S``: a node without a
deep queue on its path is never paced. While nothing uploads, every connection stays capped
at ``C`` (pacing spaces packets, it does not hold back a small message's first one), so an
upload starting between two readings cannot burst into the queue; ``FORGET_S`` after the
last upload the capacity is forgotten and every cap lifted.

Owns: the pacing rule (``PaceRule``, pure, explicit ``now``), reading ``TCP_INFO``
(``tcp_info``), and the sockets it paces (``UplinkPacer``). Does not own the sockets
(``node.net.transport``, ``node.server``, ``node.net.relay``), or the choice of congestion
control (``node.net.tcp``, which turns pacing on where BBR is not to be had).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
"""Linux's socket option (``asm-generic/socket.h``); Python's module names it only lately."""
UNPACED = (1 << 64) - 1
"""``SO_MAX_PACING_RATE``'s value for no cap."""
TCP_INFO = getattr(socket, "TCP_INFO", None)
TCP_INFO_BYTES = 152
"""Enough of ``struct tcp_info`` for the fields read (``min_rtt`` ends at 152)."""

TARGET_S = 0.025
"""The queueing delay the pace aims at: a small message waits about this long."""
DRAIN_S = 0.1
"""How fast a longer queue is drained: 50 ms over the target halves the pace."""
MIN_GAIN = 0.25
MAX_GAIN = 1.25
GOODPUT_S = 0.5
"""The goodput is bytes acknowledged over this long."""
WINDOW_S = 2.0
"""How long a measured goodput counts toward the capacity."""
FORGET_S = 10.0
"""How long after the last upload the capacity is kept for the next."""
UPLOADING_BYTES = 64 * 1024
"""A connection with this much unsent or unacknowledged counts as uploading."""
MIN_RATE = 64 * 1024
"""The least pace, bytes a second: a stalled measurement must not stop uploads."""
TICK_S = 0.05
"""How often the sockets are read while anything is paced or uploading (so that an upload's
goodput is measured from soon after it starts)."""
IDLE_TICK_S = 0.25


@dataclass(frozen=True)
class TcpInfo:
    """What the pacer reads of a connection's ``TCP_INFO``."""

    srtt_s: float
    min_rtt_s: float
    in_flight: int
    """Bytes sent and not yet acknowledged (segments times the sender's MSS)."""
    unsent: int
    acked: int
    """Bytes acknowledged over the connection's life."""

    @property
    def queueing_s(self) -> float:
        return max(0.0, self.srtt_s - self.min_rtt_s) if self.min_rtt_s > 0 else 0.0

    @property
    def uploading(self) -> bool:
        return self.in_flight + self.unsent >= UPLOADING_BYTES


class SocketLike(Protocol):
    def fileno(self) -> int: ...
    def getsockopt(self, level: int, option: int, buflen: int) -> bytes: ...
    def setsockopt(self, level: int, option: int, value: bytes) -> None: ...


def tcp_info(sock: SocketLike) -> TcpInfo | None:
    """The connection's round trips, bytes in flight, unsent and acknowledged; None where
    the system has no ``TCP_INFO`` or too old a one, or the socket is closed."""
    if TCP_INFO is None or not _open(sock):
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, TCP_INFO, TCP_INFO_BYTES)
    except OSError:
        return None
    if len(raw) < TCP_INFO_BYTES:
        return None
    snd_mss, unacked = struct.unpack_from("<I4xI", raw, 16)
    (rtt_us,) = struct.unpack_from("<I", raw, 68)
    unsent, min_rtt_us = struct.unpack_from("<II", raw, 144)
    (acked,) = struct.unpack_from("<Q", raw, 120)
    return TcpInfo(
        srtt_s=rtt_us / 1e6,
        min_rtt_s=min_rtt_us / 1e6 if min_rtt_us != 0xFFFFFFFF else 0.0,
        in_flight=unacked * snd_mss,
        unsent=unsent,
        acked=acked,
    )


class PaceRule:
    """The node's upload pace from its connections' readings (the module's rule).

    ``pace(now, delay_s, acked)`` takes the least queueing delay over the uploading
    connections (None: nothing uploading) and the bytes acknowledged so far over all of them,
    and returns the total pace in bytes a second, or None for no cap.
    """

    def __init__(self) -> None:
        self.capacity = 0.0
        self._acked: deque[tuple[float, int]] = deque()
        """(time, bytes acknowledged so far) over the last ``GOODPUT_S``."""
        self._goodput: deque[tuple[float, float]] = deque()
        """(time, goodput) over the last ``WINDOW_S``: the capacity's window."""
        self.pacing = False
        self.uploading = False
        """Whether the last reading saw an upload."""
        self.last_upload = float("-inf")
        self.delay_s = 0.0

    def pace(self, now: float, delay_s: float | None, acked: int) -> float | None:
        self.uploading = delay_s is not None
        if delay_s is None:  # the goodput measured next starts with the next upload
            self._acked.clear()
            if self.pacing and now - self.last_upload > FORGET_S:
                self.pacing, self.capacity = False, 0.0
                self._goodput.clear()
            return max(MIN_RATE, self.capacity) if self.pacing else None
        self._acked.append((now, acked))
        while len(self._acked) > 2 and now - self._acked[1][0] >= GOODPUT_S:
            self._acked.popleft()
        self.last_upload, self.delay_s = now, delay_s
        (t0, a0) = self._acked[0]
        if now - t0 >= GOODPUT_S / 2:
            self._goodput.append((now, (acked - a0) / (now - t0)))
        while self._goodput and now - self._goodput[0][0] > WINDOW_S:
            self._goodput.popleft()
        if self._goodput:
            self.capacity = max(g for _, g in self._goodput)
        if not self.pacing:
            if delay_s <= TARGET_S or not self._goodput:
                return None
            self.pacing = True
        gain = min(MAX_GAIN, max(MIN_GAIN, 1.0 + (TARGET_S - delay_s) / DRAIN_S))
        return max(MIN_RATE, self.capacity * gain)


class UplinkPacer:
    """Paces the sockets it is given (``govern``) by ``PaceRule``, from a task of its own
    (``run``).

    The pace is split evenly between the connections that are uploading; an idle one is
    capped at the whole pace, so that one starting an upload between two readings cannot
    burst past it, and a small message on it is not held back (pacing spaces packets, it
    does not delay the first)."""

    def __init__(self) -> None:
        self.rule = PaceRule()
        self._sockets: dict[int, SocketLike] = {}
        """The governed sockets by id (held until closed: ids stay unique)."""
        self._caps: dict[int, int] = {}
        """The cap set on each governed socket, by id (absent: none)."""
        self.total_pace: float | None = None
        self._acked = 0
        """Bytes acknowledged over the governed connections since the pacer began."""
        self._last_acked: dict[int, int] = {}
        self._wake = asyncio.Event()

    def govern(self, sock: SocketLike) -> None:
        """Pace ``sock`` (a TCP socket) from now on, until it closes; again: nothing more."""
        if id(sock) in self._sockets or not _open(sock):
            return
        self._prune()
        self._sockets[id(sock)] = sock
        if self.total_pace is not None:
            self._set(sock, int(self.total_pace))
        self._wake.set()

    def tick(self, now: float) -> None:
        """Read the sockets, apply the rule, set or lift each socket's cap."""
        self._prune()
        read = [(s, tcp_info(s)) for s in self._sockets.values()]
        up = [i for _, i in read if i is not None and i.uploading]
        for s, info in read:
            if info is not None:
                self._acked += info.acked - self._last_acked.get(id(s), info.acked)
                self._last_acked[id(s)] = info.acked
        delay = min((i.queueing_s for i in up), default=None)
        was_pacing = self.rule.pacing
        pace = self.total_pace = self.rule.pace(now, delay, self._acked)
        if self.rule.pacing and not was_pacing:
            log.info(
                "an upload queued %.0f ms in the network: pacing uploads at about %.1f Mbit/s "
                "(uplink measured), to keep small messages from waiting behind them",
                1e3 * self.rule.delay_s,
                self.rule.capacity * 8 / 1e6,
            )
        n_up = len(up)
        for s, info in read:
            if info is None:
                continue
            if pace is None:
                cap = UNPACED
            elif info.uploading:
                cap = int(pace / n_up)
            else:
                cap = int(pace)
            if cap != self._caps.get(id(s), UNPACED) and not _close(cap, self._caps.get(id(s))):
                self._set(s, cap)

    def _prune(self) -> None:
        """Drop the closed sockets."""
        open_ = [s for s in self._sockets.values() if _open(s)]
        if len(open_) != len(self._sockets):
            self._sockets = {id(s): s for s in open_}
            self._caps = {k: v for k, v in self._caps.items() if k in self._sockets}
            self._last_acked = {k: v for k, v in self._last_acked.items() if k in self._sockets}

    def _set(self, sock: SocketLike, rate: int) -> None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("<Q", rate))
        except OSError:  # closed meanwhile, or a system without pacing: nothing to cap
            return
        if rate == UNPACED:
            self._caps.pop(id(sock), None)
        else:
            self._caps[id(sock)] = rate

    async def run(self) -> None:
        """Read and pace, every ``TICK_S`` while a pace is held or anything uploads, else
        every ``IDLE_TICK_S`` (and at once when a socket is added)."""
        loop = asyncio.get_running_loop()
        while True:
            self.tick(loop.time())
            self._wake.clear()
            try:
                busy = self.total_pace is not None or self._caps or self.rule.uploading
                wait = TICK_S if busy else IDLE_TICK_S
                await asyncio.wait_for(self._wake.wait(), wait)
            except TimeoutError:
                pass

    def status(self) -> dict[str, Any]:
        return {
            "pacing": self.total_pace is not None,
            "pace_bytes_per_s": self.total_pace,
            "capacity_bytes_per_s": self.rule.capacity,
            "queueing_ms": 1e3 * self.rule.delay_s,
            "sockets": len(self._sockets),
        }


def _open(sock: SocketLike) -> bool:
    try:
        return sock.fileno() >= 0
    except (OSError, ValueError):
        return False


def _close(cap: int, old: int | None) -> bool:
    """Within 2 % of the cap already set: not worth a system call."""
    return old is not None and cap != UNPACED and abs(cap - old) <= 0.02 * old
