"""A microbatch between two nodes: the compute queue, and sending a hop to its next peer.

Owns two things every stage role uses the same way:

- ``WorkQueue``: the compute jobs this node accepted, run one at a time (backward before
  loss before forward, so gradients are never stuck behind new work; SWARM, arXiv
  2301.11913, section 3), bounded by jobs (``train.max_queue``, then ``busy``) and by the
  tensor bytes they hold (``net.max_queued_bytes``, then ``overloaded``). A job computes on
  the compute thread and returns the send to run after it; the send runs as a task of its
  own, so it overlaps with the next computation.
- ``HopSender``: a finished microbatch's way onward. ``send_to_stage`` draws a replica of
  the next stage with the router (``swarm.routing``) and retries others when one fails or
  is busy (``train.hop_retries``); ``send_to`` sends to one fixed peer (a microbatch's way
  home, or a gradient's way back along its path). A send that no replica takes is counted
  as a dropped hop; a block role then has ``tell_head`` send the head that issued the
  microbatch a ``Dropped`` notice, and the head re-issues it at once (failing that, when its
  deadline passes). It also picks the wire codec the roles encode in (``train.wire_codec =
  auto``: by the arrival rates its receivers put in their acks, or for a relayed receiver,
  which reports none, by this node's own clock). Once one upload takes longer than
  ``TURNS_SEND_S`` at that rate, its uploads take the uplink in turns, gradients first
  (``node.net.uplink``); one that waited and could no longer end within the hop's deadline
  when its turn comes is not sent. Before it knows any rate, its timeable uploads take turns
  too: the first one alone measures the link.

Does not own what a job computes (``node.roles``) nor what the server accepts
(``node.server``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from node.context import NodeContext
from node.logs import RateLimitedLog
from node.net.uplink import UplinkTurns
from protocol.messages import Ack, Dropped, Hop, Message, PeerRecord, expect
from swarm.seams import Refused, TransportError
from swarm.window import MIN_SIZE
from swarm.wirecodec import MIN_TIMED_BYTES, CodecChoice, UploadLoad, payload_bytes, spare_bytes_s

log = logging.getLogger(__name__)

THIN_WARNING_EVERY_S = 300.0
"""How often a node whose uplink is too thin for its microbatches says so."""
THIN_HOLD_S = 30.0
"""How long the uplink must have been too thin before the node says so in its log: at the
start a hop that timed out bounds the rate alone (``CodecChoice.observe_timeout``), and the
first receivers' reports lift it again where the link is fine (a 2 Mbit/s node was warned
11 s into a run it then trained through)."""

Send = Callable[[], Awaitable[object]]
"""The network part of a job, run after its computation."""
Job = Callable[[], Awaitable[Send | None]]
"""A unit of queued work: computes, then returns the send to run after it (or None)."""

PRIORITY = {"backward": 0, "loss": 1, "forward": 2}
"""Job kinds, most urgent first."""

TURNS_SEND_S = 1.0
"""Uploads take the uplink in turns (``node.net.uplink``) once one takes longer than this
at the rate receivers report. Where this node's uplink is the narrow part, turns cost no
throughput: the first of several ends seconds sooner, and a few that would miss a hop's
deadline together when shared (four of 2.5 s at the default 10 s) do not. Below a second
the order hardly matters, and a slow receiver should not hold the others up.

Before any rate is known, every upload of ``MIN_TIMED_BYTES`` or more (one its receiver
can time) takes a turn as well: the first then crosses the uplink alone and its receiver's
report, or its timeout, gives the rate the rest are judged by. Sent together, the first
uploads of a node on a thin uplink all missed their deadline (two bf16 outputs of 8 s each
at 0.5 Mbit/s), and the node learnt its rate only from their timeouts, 25 s in. On a fast
link the first turn ends within a round trip and costs the second upload that much once."""


class WorkQueue:
    """This node's compute jobs, run one at a time in order of urgency."""

    def __init__(self, ctx: NodeContext, after_job: Callable[[], None]) -> None:
        """``after_job`` runs after every job (an outer round or a backup may be due)."""
        self.ctx = ctx
        self.after_job = after_job
        self._queue: asyncio.PriorityQueue[tuple[int, int, Job]] = asyncio.PriorityQueue()
        self._seq = 0
        self._job_bytes: dict[int, int] = {}  # tensor bytes held by each queued job, by seq
        self.busy = 0
        """Jobs running now (0 or 1)."""

    def qsize(self) -> int:
        return self._queue.qsize()

    def unfinished(self) -> int:
        """Jobs queued or running (their sends are tasks the node owns)."""
        return self._queue.qsize() + self.busy

    def put(self, kind: str, job: Job, nbytes: int = 0) -> None:
        """Queue ``job``, which holds ``nbytes`` of tensors; ``busy`` or ``overloaded`` if full."""
        config = self.ctx.config
        if self._queue.qsize() >= config.train.max_queue:
            raise Refused("busy", f"queue full ({self._queue.qsize()} jobs)", 503)
        if self._queue.empty():
            self._job_bytes.clear()  # jobs dropped unrun (a stage move) hold nothing any more
        queued = sum(self._job_bytes.values())
        if nbytes and queued + nbytes > config.net.max_queued_bytes:
            raise Refused(
                "overloaded",
                f"{queued} bytes of work queued, {nbytes} more would pass the "
                f"{config.net.max_queued_bytes}-byte limit",
                503,
            )
        self._seq += 1
        self._job_bytes[self._seq] = nbytes
        self._queue.put_nowait((PRIORITY[kind], self._seq, job))

    def drop_all(self) -> int:
        """Forget every queued job (the node moves to another stage); returns how many."""
        num = 0
        while not self._queue.empty():
            self._queue.get_nowait()
            num += 1
        return num

    async def run(self) -> None:
        """Run queued jobs one at a time until cancelled; their sends overlap the next job."""
        while True:
            _, seq, job = await self._queue.get()
            self._job_bytes.pop(seq, None)
            self.busy += 1
            try:
                send = await job()
                if send is not None:
                    self.ctx.spawn(self._send(send))
                self.after_job()
            except Exception:
                self.ctx.counters["job_errors"] += 1
                log.exception("job failed")
            finally:
                self.busy -= 1

    async def _send(self, send: Send) -> None:
        try:
            await send()
        except Exception:
            self.ctx.counters["send_errors"] += 1
            log.exception("send failed")


class HopSender:
    """Sends finished microbatches onward: to a drawn replica of a stage, or to one peer;
    and says which wire codec they travel in (``codec``: as configured, or with
    ``train.wire_codec = auto`` by the rates its receivers report, ``swarm.wirecodec``), and
    whether the uplink is too thin for them (``too_thin``: in ``node status`` and the
    metrics, and logged once it has held ``THIN_HOLD_S``)."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self._log = RateLimitedLog(log)
        self._thin_log = RateLimitedLog(log, THIN_WARNING_EVERY_S)
        self.wire = CodecChoice()
        self.send_s: float | None = None
        """Seconds the last tensor would take to send at the rate payloads get (None: no
        rate known yet)."""
        self._thin_since: float | None = None
        """Since when the uplink has been too thin, without a break (None: it is not)."""
        self.turns = UplinkTurns()
        self.load = UploadLoad()
        """The hops' upload traffic: what an outer sync's transfer shares the uplink with."""

    def codec(self, numel: int, job_s: float) -> str:
        """The codec for a tensor of ``numel`` values from a node that computes a job in
        ``job_s`` seconds."""
        fixed = self.ctx.config.train.wire_codec
        codec = fixed if fixed != "auto" else self._choose(numel, job_s)
        self._watch_uplink(codec, numel)
        return codec

    def _watch_uplink(self, codec: str, numel: int) -> None:
        """Note how long a ``codec`` tensor of ``numel`` values takes to send at the rate
        payloads get, and say so in the log once the uplink has been too thin for
        ``THIN_HOLD_S``."""
        nbytes = payload_bytes(codec, numel)
        send_s = self._send_s(nbytes)
        if send_s is None:
            return
        self.send_s = send_s
        now = time.monotonic()
        if not self.too_thin():
            self._thin_since = None
        elif self._thin_since is None:
            self._thin_since = now
        elif now - self._thin_since >= THIN_HOLD_S:
            self._thin_log.log(
                "thin",
                logging.WARNING,
                "this node's uplink is too thin for the swarm's microbatches: its payloads "
                "get %.2f Mbit/s, so one %s tensor takes %.1f s to send and two in flight "
                "miss a hop's %g s deadline (train.hop_timeout_s); its peers will time out "
                "and re-issue its work. Serve from a faster uplink, or keep other "
                "uploads off this one",
                nbytes / send_s * 8 / 1e6,
                codec,
                send_s,
                self.ctx.config.train.hop_timeout_s,
            )

    def too_thin(self) -> bool:
        """Whether one tensor takes more than half a hop's deadline to send: the adaptive
        window keeps at least two (``MIN_SIZE``) in flight, so then they miss it."""
        deadline = self.ctx.config.train.hop_timeout_s
        return self.send_s is not None and self.send_s > deadline / MIN_SIZE

    def _choose(self, numel: int, job_s: float) -> str:
        """``train.wire_codec = auto``: the codec the link's rate calls for (logged when it
        changes)."""
        before = self.wire.codec
        codec = self.wire.choose(numel, job_s)
        if codec != before:
            rate = self.wire.rate_bytes_s or 0.0
            log.info(
                "wire codec %s -> %s: payloads arrive at %.1f Mbit/s, a job computes in %.0f ms",
                before,
                codec,
                rate * 8 / 1e6,
                job_s * 1e3,
            )
        return codec

    def sync_bytes_s(self) -> float | None:
        """The rate an outer sync's upload gets beside the hops: the settled rate their
        receivers report less the hops' own traffic, at least half of it (None: not
        measured; ``swarm.wirecodec.spare_bytes_s``)."""
        return spare_bytes_s(self.wire.settled_bytes_s, self.load.bytes_s(time.monotonic()))

    def wire_status(self) -> dict[str, Any]:
        """What ``node status`` shows of the wire codec."""
        rate = self.wire.rate_bytes_s
        auto = self.ctx.config.train.wire_codec == "auto"
        return {
            "codec": self.wire.codec if auto else self.ctx.config.train.wire_codec,
            "auto": auto,
            "link_mbps": None if rate is None else round(rate * 8 / 1e6, 2),
            "switches": self.wire.num_switches,
            "send_s": None if self.send_s is None else round(self.send_s, 1),
            "too_thin": self.too_thin(),
            "uplink_waiting": self.turns.waiting,
            "load_mbps": round(self.load.bytes_s(time.monotonic()) * 8 / 1e6, 2),
        }

    async def send_to(self, hop: Hop, msg: Message) -> str | None:
        """Send to one fixed peer (a microbatch's way home or back): None when it took the
        hop, else why not (the error code)."""
        error = await self._request(hop.peer_id, hop.address, msg)
        if error is not None:
            self.ctx.counters["hops_dropped"] += 1
        return error

    async def send_to_stage(self, stage: int, msg: Message) -> str | None:
        """Send to a replica of ``stage`` drawn by the router, retrying others on failure:
        None when one took the hop, else why not (``no_replica`` when none was found, or the
        last one's error code)."""
        tried: set[str] = set()
        error: str | None = "no_replica"
        for attempt in range(self.ctx.config.train.hop_retries + 1):
            peer = await self._pick(stage, tried)
            if peer is None:
                break
            error = await self._request(peer.peer_id, peer.address, msg)
            if error is None:
                return None
            if error == "uplink_busy":  # logged; another replica is behind the same uplink
                self.ctx.counters["hops_dropped"] += 1
                return error
            self.ctx.counters["hop_retries"] += 1
            if error != "busy":
                tried.add(peer.peer_id)
            await asyncio.sleep(0.05 * 2**attempt)
        self.ctx.counters["hops_dropped"] += 1
        self._log.log(
            f"drop{stage}",
            logging.WARNING,
            "no replica of stage %d took a microbatch; dropped",
            stage,
        )
        return error

    async def tell_head(self, head: Hop, mb_id: str, stage: int) -> None:
        """Tell ``head``, which issued microbatch ``mb_id``, that its hop from ``stage`` here
        went nowhere, so that it re-issues it now and its window slot is free again
        (``HeadRole.on_dropped``). Best effort: its deadline still stands behind it."""
        ctx = self.ctx
        notice = Dropped(mb_id=mb_id, stage=stage, sender=ctx.peer_id)
        timeout_s = ctx.config.train.hop_timeout_s
        try:
            expect(await ctx.transport.request(head.address, notice, timeout_s, head.peer_id), Ack)
        except (TransportError, ValueError) as e:
            ctx.counters["drop_notices_failed"] += 1
            self._log.log(
                "notice",
                logging.INFO,
                "could not tell head %s that microbatch %s was dropped: %s",
                head.peer_id[:8],
                mb_id,
                e,
            )
            return
        ctx.counters["drop_notices_sent"] += 1

    async def _pick(self, stage: int, tried: set[str]) -> PeerRecord | None:
        """A replica of ``stage``; waits up to one hop timeout for one to appear."""
        ctx = self.ctx
        deadline = time.monotonic() + ctx.config.train.hop_timeout_s
        while True:
            peer = ctx.router.choose(ctx.table.replicas(stage), ctx.clock.now(), exclude=tried)
            if peer is not None or time.monotonic() > deadline or ctx.state.leaving:
                return peer
            await asyncio.sleep(0.2)

    async def _request(self, peer_id: str, address: str, msg: Message) -> str | None:
        """Send one hop; ``None`` when the peer accepted it, else the error code. A long
        upload first waits for its turn on the uplink, and one that waited is not sent
        (``uplink_busy``; the router is not told, the peer did nothing wrong) if the hop's
        deadline would pass before it could end (at the rate known when its turn comes): it
        would only delay the uploads behind it. One that found the uplink free is always
        sent: the rate that calls an upload long is only measured by sending (a timed-out
        hop bounds it at its bytes over the deadline, which would otherwise hold every later
        upload back for good). Before any rate is known, a timeable upload is long."""
        ctx = self.ctx
        deadline_s = ctx.config.train.hop_timeout_s
        nbytes = sum(t.nbytes for t in msg.tensors.values())
        send_s = self._send_s(nbytes)
        t0 = time.monotonic()
        long = nbytes >= MIN_TIMED_BYTES if send_s is None else send_s > TURNS_SEND_S
        if long:
            waits = self.turns.held
            got = await self.turns.acquire(PRIORITY.get(msg.TYPE, 1), deadline_s)
            left_s = deadline_s - (time.monotonic() - t0)
            send_s = self._send_s(nbytes)  # the upload ahead may have measured the link
            if not got or (waits and send_s is not None and send_s > left_s):
                if got:
                    self.turns.release()
                ctx.counters["send_failed_uplink_busy"] += 1
                why = (
                    f"{max(0.0, left_s):.1f} s of the hop's {deadline_s:g} s deadline were "
                    "left when its turn came"
                    if got
                    else f"its turn did not come within the hop's {deadline_s:g} s deadline"
                )
                self._log.log(
                    "uplink_busy",
                    logging.WARNING,
                    "%s to %s not sent: it takes %s on this node's thin uplink, and %s",
                    msg.TYPE,
                    peer_id[:8],
                    "an unmeasured time" if send_s is None else f"{send_s:.1f} s",
                    why,
                )
                return "uplink_busy"
            try:
                return await self._upload(peer_id, address, msg, nbytes, left_s)
            finally:
                self.turns.release()
        return await self._upload(peer_id, address, msg, nbytes, deadline_s)

    def _send_s(self, nbytes: float) -> float | None:
        """Seconds ``nbytes`` take at the rate payloads get (``self.wire``); None before
        any rate is known."""
        rate = self.wire.rate_bytes_s
        return None if rate is None else nbytes / rate

    async def _upload(
        self, peer_id: str, address: str, msg: Message, nbytes: int, timeout_s: float
    ) -> str | None:
        """The request itself, its tensors ``nbytes``, within ``timeout_s``; ``_request``'s
        result."""
        ctx = self.ctx
        ctx.router.started(peer_id)
        t0 = time.monotonic()
        try:
            reply = await ctx.transport.request(address, msg, timeout_s, peer_id)
            ack = expect(reply, Ack)
        except (TransportError, ValueError) as e:
            code = e.code if isinstance(e, TransportError) else "bad_reply"
            if code == "duplicate_microbatch":  # it reached that peer by another route already
                ctx.router.finished(peer_id, True, ctx.clock.now())
                return None
            ctx.router.finished(peer_id, False, ctx.clock.now())
            ctx.counters[f"send_failed_{code}"] += 1
            if code == "timeout":  # the payload got at most its bytes over the deadline
                self.wire.observe_timeout(nbytes, timeout_s)
                self.load.record(time.monotonic(), nbytes)  # it held the uplink meanwhile
            self._log.log(
                f"send{peer_id}", logging.WARNING, "%s to %s failed: %s", msg.TYPE, peer_id[:8], e
            )
            return code
        trip_s = time.monotonic() - t0
        self.wire.observe_upload(ack.rate, nbytes, trip_s)
        self.load.record(t0 + trip_s, nbytes)
        ctx.router.finished(peer_id, True, ctx.clock.now(), trip_s, ack.queue, ack.service_rate)
        return None
