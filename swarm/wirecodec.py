"""Which encoding a node's activations and gradients travel in, chosen by its link.

SWARM Parallelism (Ryabinin et al., ICML 2023, arXiv 2301.11913) compresses activations to
8 bits because volunteers' links are thin; on a LAN the compression only costs CPU.
``bench/wan.py`` measured it on a 20 Mbit/s uplink at 50 ms: bf16 activations carried 3,344
tokens/s, blockwise int8 6,396 (and the eval loss of int8 matched fp32's in ``bench/perf.py``,
+0.04 %). With ``train.wire_codec = auto`` (the default) a node picks by its own link, as
its receivers measure it:

- every receiver of a microbatch times how long the request's body took to arrive (from
  its headers to its last byte: the transfer, not the round trip) and reports the rate in
  its ``Ack`` (``Ack.rate``, bytes per second; 0 for bodies under ``MIN_TIMED_BYTES``,
  which arrive with their headers, and for relayed ones);
- the sender keeps a moving average ``r`` of those rates: what its payloads actually get,
  its share of its uplink when several are in flight at once; a request that timed out
  bounds it (``observe_timeout``: its bytes over the timeout), so a link on which no
  transfer finishes in time still leaves the most precise codec; an upload whose receiver
  reports nothing (a relayed one) is timed by the sender's own clock instead
  (``observe_trip``: its bytes over the whole round trip, a lower bound of the rate), so a
  node whose receivers are all relayed still learns its rate, and a timeout's bound is
  lifted again by the uploads that arrive after it, as reports lift it for everyone else;
- a link keeps up when sending one job's output takes no longer than computing it (the
  pipeline's slowest part sets its pace; SWARM's throughput model counts both): the node
  takes the most precise codec ``k`` of ``CANDIDATES`` whose payload ``n_k`` satisfies
  ``n_k / r <= c``, ``c`` its compute seconds per job; when none does, the most compact.
  It moves back to a more precise codec only when that one would take at most half of
  ``c`` (``UP_MARGIN``): the rate is measured under the current codec, and sending twice
  the bytes makes sends overlap and each one's share smaller, so without the margin a node
  on the edge would flip at every measurement. The rule compares a node's sending time
  with its own compute time, not with the pipeline's pace: the pace is set by the link
  itself when the link is the bottleneck, so it cannot tell. A node whose jobs are short
  (the head: an embedding lookup, a loss) therefore takes int8 sooner than it must, which
  costs no measurable loss.

"Per link" here means per node: the scarce link of a volunteer is its own uplink, which
every hop it sends shares, so one choice per node serves all its links; a receiver decodes
whatever codec a frame declares, so nodes that chose differently still interoperate.
A receiver that lies about rates can only move its sender between bf16 and int8 (reports
that are not positive finite numbers are ignored). fp32 is not a candidate (bf16 lost
nothing against it in ``bench/perf.py``); a fixed ``train.wire_codec`` bypasses this policy.
Measured in ``bench/README.md``: at 20 Mbit/s ``auto`` carried 0.99 of fixed int8's
tokens/s (1.99x bf16's), at 100 Mbit/s 1.09x bf16's; on loopback every node keeps bf16.

Outer synchronisation (``sync.codec = auto``) chooses by the same rate with another test
(``sync_codec``): a NoLoCo contribution or a ring chunk has no compute time to hide behind;
it must reach its receiver before the receiver stops waiting for it (``swarm.gossip``,
``swarm.allreduce``: a fixed timeout plus its size at the slowest link waited for). So the
node takes the most precise of ``SYNC_CANDIDATES`` whose payload crosses its uplink within
that allowance, fp32 while its rate is unknown (the published rules exchange full-precision
weights), the most compact when none does. It reads the rate that one timeout does not
lower (``CodecChoice.settled_bytes_s``): the activations' codec is chosen at every hop and
recovers at the next report, but a round's codec holds for the whole round, and on a busy
machine a single timed-out 512 kB hop bounded a fast link to 0.4 Mbit/s, which would send
that round's contribution in int8. As for the hops, a more precise codec than the last
round's is taken back only within ``UP_MARGIN`` of its allowance. It is the default: on
every link that carries fp32 in time it changes nothing, and on one that does not the fp32
contribution arrives too late to be averaged at all (``bench/gossip_thin.py``).

An outer sync's transfer crosses the uplink while the hops keep using it: the node reads
its rate as what the hops leave of the link (``spare_bytes_s``), at least half of it, the
hops' own traffic measured over the last ``LOAD_WINDOW_S`` (``UploadLoad``). Read as the
whole link, a contribution announced 10.6 s of upload behind a 2 Mbit/s uplink and its
partner waited 20.6 s for a reply that took longer: the pairing was one-sided in half the
rounds (``bench/gossip_thin.py``).

Pure policy: numbers in, a codec name out; the clock comes in as an explicit ``now``
(rates come with their samples).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from protocol.quant import bytes_per_value

CANDIDATES: tuple[str, ...] = ("bf16", "int8")
"""Codecs ``auto`` chooses from, most precise first."""
MIN_TIMED_BYTES = 64 * 1024
"""Bodies smaller than this arrive with their headers: their time says nothing of the link."""
SYNC_CANDIDATES: tuple[str, ...] = ("fp32", "bf16", "int8")
"""Codecs ``sync.codec = auto`` chooses from, most precise first."""
SETTLED_TIMEOUTS = 3
"""Timed-out requests in a row, with no measurement between, after which the rate an outer
sync's codec is chosen by is their bound (``CodecChoice.settled_bytes_s``)."""
LOAD_WINDOW_S = 30.0
"""The hops' traffic is averaged over this many seconds (``UploadLoad``): about a thin
uplink's contribution upload, the time it shares the link with them."""
UP_MARGIN = 0.5
"""A more precise codec is taken back only when its payload would take this fraction of a
job's compute time or less (an outer sync's: of the time its receiver waits for it)."""


def payload_bytes(codec: str, numel: int) -> float:
    """Bytes a tensor of ``numel`` values takes on the wire in ``codec`` (headers aside)."""
    return bytes_per_value(codec) * numel


def arrival_rate(nbytes: int, seconds: float) -> float:
    """What a receiver reports for a body of ``nbytes`` read in ``seconds``: bytes per
    second, or 0 when the body is too small to time (or the clock saw no time pass)."""
    if nbytes < MIN_TIMED_BYTES or not seconds > 0:
        return 0.0
    return nbytes / seconds


def is_rate(rate_bytes_s: float) -> bool:
    """Whether a reported rate is a measurement: a positive finite number."""
    return math.isfinite(rate_bytes_s) and rate_bytes_s > 0


@dataclass
class CodecChoice:
    """A node's current wire codec and the link rate it was chosen by."""

    codec: str = CANDIDATES[0]
    rate_bytes_s: float | None = None
    """Moving average of the rates receivers reported; None before the first."""
    ema: float = 0.3
    """Weight of each new report."""
    num_switches: int = 0
    measured_bytes_s: float | None = None
    """Moving average of the measurements alone (reports and timed round trips), which
    timeouts' bounds do not lower; None before the first."""
    timeouts_in_a_row: int = 0
    """Timeouts since the last measurement."""

    def observe_upload(self, reported: float, nbytes: int, trip_s: float) -> None:
        """An answered upload of ``nbytes``, ``trip_s`` from its start to its answer: its
        receiver's report (``Ack.rate``) where that is a measurement, else the sender's own
        clock (``observe_trip``)."""
        if is_rate(reported):
            self.observe(reported)
        else:
            self.observe_trip(nbytes, trip_s)

    def observe(self, rate_bytes_s: float) -> None:
        """A receiver's report (``Ack.rate``); zero, negative or non-finite ones are not
        measurements and are ignored."""
        if not is_rate(rate_bytes_s):
            return
        self.rate_bytes_s = self._averaged(self.rate_bytes_s, rate_bytes_s)
        self.measured_bytes_s = self._averaged(self.measured_bytes_s, rate_bytes_s)
        self.timeouts_in_a_row = 0

    def _averaged(self, prev: float | None, new: float) -> float:
        return new if prev is None else prev + self.ema * (new - prev)

    def observe_trip(self, nbytes: int, seconds: float) -> None:
        """An upload of ``nbytes`` whose receiver reported no rate (a relayed one never
        does) was answered ``seconds`` after it began, by the sender's own clock: its bytes
        over that round trip enter the average like a report. The round trip holds more
        than the transfer (a relay's hops, the answer's way back), so this is a lower bound
        of the rate, and a relayed receiver's sender may take int8 a little sooner than it
        must. Bodies too small to time say nothing."""
        self.observe(arrival_rate(nbytes, seconds))

    def observe_timeout(self, nbytes: int, seconds: float) -> None:
        """A request carrying ``nbytes`` that had no answer within ``seconds``: its payload
        got at most ``nbytes / seconds``, and the estimate drops to that bound if it was
        higher (a bound, not a measurement, so it never raises it). On an uplink too thin
        for any transfer to finish in time no receiver ever reports a rate; without this
        the node would keep its most precise codec for good. Bodies too small to time say
        nothing. A timeout with a fast link and a dead receiver lowers the estimate too;
        the next reports raise it back at the moving average's pace."""
        if nbytes < MIN_TIMED_BYTES or not seconds > 0:
            return
        bound = nbytes / seconds
        self.timeouts_in_a_row += 1
        if self.rate_bytes_s is None or self.rate_bytes_s > bound:
            self.rate_bytes_s = bound

    @property
    def settled_bytes_s(self) -> float | None:
        """The rate for a choice made once a round (an outer sync's codec): the
        measurements' average, which one timeout does not move (a dead receiver or a
        machine busy for a moment times a request out on a fast link too, and the bound
        would hold a whole round's transfer in int8); the bound (``rate_bytes_s``) once
        ``SETTLED_TIMEOUTS`` requests in a row timed out, or while nothing was measured, so
        an uplink that became thin, or on which no transfer ever finishes, still reads as
        thin."""
        if self.measured_bytes_s is None or self.timeouts_in_a_row >= SETTLED_TIMEOUTS:
            return self.rate_bytes_s
        return self.measured_bytes_s

    def choose(self, numel: int, compute_s: float) -> str:
        """The codec for the next tensor of ``numel`` values, from a node that computes a
        job in ``compute_s`` seconds (the current one while either is unknown)."""
        rate = self.rate_bytes_s
        if rate is None or not compute_s > 0 or numel <= 0:
            return self.codec
        here = CANDIDATES.index(self.codec) if self.codec in CANDIDATES else 0
        want = len(CANDIDATES) - 1  # the most compact, unless a more precise one keeps up
        for i, codec in enumerate(CANDIDATES):
            budget = compute_s * (UP_MARGIN if i < here else 1.0)
            if payload_bytes(codec, numel) / rate <= budget:
                want = i
                break
        if CANDIDATES[want] != self.codec:
            self.codec = CANDIDATES[want]
            self.num_switches += 1
        return self.codec


class UploadLoad:
    """The bytes a node's hops uploaded over the last ``window_s`` seconds, per second."""

    def __init__(self, window_s: float = LOAD_WINDOW_S) -> None:
        self.window_s = window_s
        self._sent: deque[tuple[float, int]] = deque()
        self._total = 0

    def record(self, now: float, nbytes: int) -> None:
        """An upload of ``nbytes`` that crossed the link (or timed out on it) at ``now``."""
        self._sent.append((now, nbytes))
        self._total += nbytes
        self._forget(now)

    def bytes_s(self, now: float) -> float:
        """Bytes per second uploaded in the window that ends at ``now`` (a node that began
        less than a window ago reads low: its window is not full)."""
        self._forget(now)
        return self._total / self.window_s

    def _forget(self, now: float) -> None:
        while self._sent and self._sent[0][0] <= now - self.window_s:
            self._total -= self._sent.popleft()[1]


def spare_bytes_s(rate_bytes_s: float | None, load_bytes_s: float) -> float | None:
    """What an upload that keeps sending gets from an uplink of ``rate_bytes_s`` (None: not
    measured) that also carries ``load_bytes_s`` of other traffic: the rate that traffic
    leaves, and at least half the link, since TCP shares a bottleneck about evenly among the
    connections that keep it busy (with turns, ``node.net.uplink``, the hops hold one)."""
    if rate_bytes_s is None:
        return None
    return max(rate_bytes_s - max(0.0, load_bytes_s), rate_bytes_s / 2)


def sync_codec_unmeasured(setting: str) -> str:
    """The codec of ``sync.codec = setting`` on a node with no rate measured (or no link:
    a simulation): the setting itself when it is fixed, fp32 for ``auto``."""
    return SYNC_CANDIDATES[0] if setting == "auto" else setting


def sync_codec(
    numel: int,
    rate_bytes_s: float | None,
    allowed_s: Callable[[float], float],
    current: str | None = None,
) -> str:
    """The codec for an outer-sync transfer of ``numel`` values from a node whose uploads
    get ``rate_bytes_s`` (None: not measured yet): the most precise of ``SYNC_CANDIDATES``
    whose payload ``n`` arrives in time, ``n / rate <= allowed_s(n)`` (what the receiver
    waits for ``n`` bytes); the most compact when none does; fp32 while the rate is unknown.
    A codec more precise than ``current`` (the last round's) must arrive within
    ``UP_MARGIN`` of its allowance: the rate is read beside the hops, whose load moves from
    round to round, so a codec that only just fits would be taken one round and arrive too
    late the next."""
    if rate_bytes_s is None or not is_rate(rate_bytes_s):
        return SYNC_CANDIDATES[0]
    here = SYNC_CANDIDATES.index(current) if current in SYNC_CANDIDATES else 0
    for i, codec in enumerate(SYNC_CANDIDATES):
        n = payload_bytes(codec, numel)
        if n / rate_bytes_s <= allowed_s(n) * (UP_MARGIN if i < here else 1.0):
            return codec
    return SYNC_CANDIDATES[-1]
