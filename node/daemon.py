"""The daemon: one node's lifecycle, request handling and microbatch hops.

Owns the start-up order (server, membership and discovery, join a stage, load its state,
serve), the aiohttp handlers, the compute queue (backward before forward, bounded), sending
each finished microbatch to its next hop with retries on other replicas, and an orderly
shutdown (tell peers, refuse new work, finish what is queued, exit within ``drain_s``).

One process, one event loop, one compute thread (``node.stage.runner``). The head stage's own
work, issuing microbatches and evaluating, lives in ``node.roles.head``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

import torch
from aiohttp import web

from node.config import Config, describe, parse_hostport
from node.identity import swarm_auth
from node.net.netem import ShapedTransport
from node.net.transport import (
    RPC_PATH,
    HttpTransport,
    frame_response,
    read_frame,
    sealed_response,
)
from node.services.balance import Balancer
from node.services.guard import RequestGuard
from node.services.recovery import RecoveryService
from node.stage.model import model_fingerprint
from node.stage.opprofile import DEFAULT_SECONDS, check_seconds, profile_compute
from node.stage.runner import StageRunner
from protocol.auth import AUTH_HEADER, Identity, Incoming, frame_digest
from protocol.errors import ProtocolError
from protocol.frames import Limits
from protocol.messages import (
    Ack,
    Backward,
    Error,
    FetchState,
    Forward,
    GossipRequest,
    HeadBackup,
    Hello,
    Hop,
    Leave,
    Message,
    PeerRecord,
    RingChunk,
    Rollback,
    StageState,
    expect,
    prepare,
)
from protocol.quant import WireTensor, encode_tensor, open_tensor
from swarm.discovery import (
    ZeroconfDiscovery,
    announce_addresses,
    local_ipv4_networks,
    outbound_address,
)
from swarm.membership import MembershipService
from swarm.peers import PeerTable
from swarm.routing import Router
from swarm.seams import MonotonicClock, Refused, Transport, TransportError

log = logging.getLogger(__name__)

Job = Callable[[], Awaitable[Callable[[], Awaitable[object]] | None]]
"""A unit of queued work: computes, then returns the network send to run after it (or None)."""

_PRIORITY = {"backward": 0, "loss": 1, "forward": 2}


class Node:
    """A swarm node serving one stage."""

    def __init__(
        self, config: Config, peer_id: str | None = None, identity: Identity | None = None
    ) -> None:
        self.config = config
        self.identity = identity or Identity.generate()
        self.auth = swarm_auth(config.net, self.identity)  # None: an open swarm
        if peer_id and self.auth is not None and peer_id != self.identity.peer_id:
            raise ValueError("in a keyed swarm a node's peer id is its identity's")
        self.peer_id = peer_id or self.identity.peer_id
        self.num_stages = config.swarm.num_block_stages + 1
        self.fingerprint = model_fingerprint(
            config.model, config.swarm.num_block_stages, config.swarm.seed
        )
        self.stage = -1
        self.stage_since = time.monotonic()
        self.ready = False
        self.leaving = False
        self._draining = False
        """Moving to another stage: backwards for our saved forwards are still taken."""
        self.address = ""
        self.started_s = time.monotonic()
        self.clock = MonotonicClock()
        self.rng = random.Random(self.peer_id)
        self.limits = Limits(max_frame_bytes=config.net.max_frame_bytes)
        self.transport = HttpTransport(self.limits, self.auth)
        net = config.net
        self.link: Transport = self.transport
        if net.inject_latency_s or net.inject_bandwidth_mbps:
            self.link = ShapedTransport(
                self.transport, net.inject_latency_s, net.inject_bandwidth_mbps * 125_000 or None
            )
        self.table = PeerTable(self.peer_id, config.membership.ttl_s, config.membership.max_peers)
        self.router = Router(self.rng)
        self.membership = MembershipService(
            config.membership,
            swarm=config.swarm.name,
            fingerprint=self.fingerprint,
            table=self.table,
            transport=self.link,
            clock=self.clock,
            self_record=self.record,
            rng=self.rng,
        )
        self.runner: StageRunner | None = None
        self.trainer: Any = None  # node.trainer.HeadTrainer on stage 0
        self.sync: Any = None  # node.sync.StageSync once joined
        self.recovery = RecoveryService(self)
        self.balancer = Balancer(self)
        self.guard = RequestGuard(self)  # admission of requests, bans of hostile peers
        self.discovery: ZeroconfDiscovery | None = None
        self.counters: Counter[str] = Counter()
        self._queue: asyncio.PriorityQueue[tuple[int, int, Job]] = asyncio.PriorityQueue()
        self._seq = 0
        self._job_bytes: dict[int, int] = {}  # tensor bytes held by each queued job, by seq
        self._busy = 0
        self._stop = asyncio.Event()
        self._tasks: asyncio.TaskGroup | None = None
        self._spawned: set[asyncio.Task[None]] = set()
        self._heartbeats: asyncio.Task[None] | None = None
        self._metrics: Any = None
        self._site_runner: web.AppRunner | None = None
        self._log_times: dict[str, float] = {}
        self._profiling = False

    # ---- identity and status ------------------------------------------------------------

    def record(self) -> PeerRecord:
        r = self.runner
        return PeerRecord(
            peer_id=self.peer_id,
            address=self.address,
            stage=self.stage,
            step=r.step if r else 0,
            throughput=r.service_rate if r else self.balancer.estimate(self.stage),
            queue=self._queue.qsize(),
            ready=self.ready and not self.leaving,
            leaving=self.leaving,
            grad_norm=r.thermo.grad_norm if r else 0.0,
            loss=self.trainer.last_loss if self.trainer else None,
            head_backup_step=self.recovery.head_backup_step,
            data_shard=self.trainer.shard if self.trainer else -1,
            movable=self.balancer.movable,
        )

    def status(self) -> dict[str, Any]:
        """This node's view of the swarm, for ``node status`` and the demo."""
        now = self.clock.now()
        peers: dict[str, list[dict[str, Any]]] = {str(s): [] for s in range(self.num_stages)}
        for p in sorted(self.table.records(), key=lambda p: (p.stage, p.peer_id)):
            peers.setdefault(str(p.stage), []).append(
                {
                    "peer_id": p.peer_id,
                    "address": p.address,
                    "step": p.step,
                    "throughput": round(p.throughput, 2),
                    "queue": p.queue,
                    "ready": p.ready,
                    "age_s": round(self.table.age_s(p.peer_id, now) or 0.0, 2),
                }
            )
        r = self.runner
        out: dict[str, Any] = {
            "peer_id": self.peer_id,
            "address": self.address,
            "swarm": self.config.swarm.name,
            "fingerprint": self.fingerprint,
            "auth": "open" if self.auth is None else "swarm_key",
            "stage": self.stage,
            "num_stages": self.num_stages,
            "ready": self.ready,
            "leaving": self.leaving,
            "uptime_s": round(time.monotonic() - self.started_s, 1),
            "step": r.step if r else 0,
            "samples": r.samples if r else 0,
            "throughput": round(r.service_rate, 2) if r else 0.0,
            "queue": self._queue.qsize(),
            "grad_norm": r.thermo.grad_norm if r else 0.0,
            "act_max": r.thermo.act_max if r else 0.0,
            "act_min": r.thermo.act_min if r else 0.0,
            "counters": self._counters_with_table(),
            "peers": peers,
        }
        if self.sync is not None:
            out["sync"] = self.sync.status()
        out["recovery"] = self.recovery.status()
        out["balance"] = self.balancer.status()
        if self.trainer is not None:
            out.update(self.trainer.status())
        return out

    def _counters_with_table(self) -> dict[str, int]:
        out = dict(self.counters)
        if self.table.num_refused_full:
            out["peers_refused_table_full"] = self.table.num_refused_full
        return out

    # ---- lifecycle ----------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()

    async def serve(self) -> None:
        """Run until ``request_stop``; then shut down in order."""
        await self.transport.start()
        await self._start_server()
        if self.config.net.metrics_port:
            from node.metrics import start_metrics_server  # prometheus_client only when asked

            self._metrics = start_metrics_server(
                self, self.config.net.metrics_host, self.config.net.metrics_port
            )
        log.info("config: %s", describe(self.config))
        if self.auth is None:
            log.warning(
                "swarm is open: no --swarm-key, so anyone who reaches %s can join, send any "
                "request and claim any peer id (see SECURITY.md)",
                self.address,
            )
        else:
            log.info("swarm key set: every request is authenticated; this is peer %s", self.peer_id)
        try:
            async with asyncio.TaskGroup() as tg:
                self._tasks = tg
                self._heartbeats = tg.create_task(self.membership.run())
                background = [self._heartbeats]
                await self._start_discovery()
                joined = tg.create_task(self._join())
                stopped = tg.create_task(self._stop.wait())
                await asyncio.wait([joined, stopped], return_when=asyncio.FIRST_COMPLETED)
                if joined.done() and not joined.exception():
                    background += [
                        tg.create_task(self._worker()),
                        tg.create_task(self._housekeeping()),
                        tg.create_task(self.recovery.run()),
                        tg.create_task(self.balancer.run()),
                    ]
                    if self.trainer is not None:
                        background.append(tg.create_task(self.trainer.run()))
                    await stopped
                joined.cancel()
                await self._shutdown()
                for task in [*background, *self._spawned]:
                    task.cancel()
        finally:
            await self._close()

    async def _start_server(self) -> None:
        app = web.Application(client_max_size=self.config.net.max_frame_bytes)
        app.router.add_post(RPC_PATH, self._handle_rpc)
        app.router.add_get("/status", self._handle_status)
        app.router.add_post("/eval", self._handle_eval)
        app.router.add_post("/profile", self._handle_profile)
        self._site_runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._site_runner.setup()
        host, port = parse_hostport(self.config.net.listen, "net.listen")
        site = web.TCPSite(self._site_runner, host, port, reuse_address=True)
        await site.start()
        bound_port = self._site_runner.addresses[0][1]
        self.address = f"{self._announce_host(host)}:{bound_port}"
        log.info(
            "node %s listening on %s:%d, announcing %s",
            self.peer_id,
            host,
            bound_port,
            self.address,
        )

    def _announce_host(self, listen_host: str) -> str:
        announce = self.config.net.announce
        if announce:
            return announce.rpartition(":")[0] if ":" in announce else announce
        if listen_host not in ("0.0.0.0", "", "::"):
            return listen_host
        # Several interfaces: take the one the kernel would use towards a bootstrap peer or,
        # on a LAN, towards the mDNS group; peers later confirm what they see (_adopt_observed).
        target = (
            parse_hostport(self.config.net.bootstrap[0])
            if self.config.net.bootstrap
            else ("224.0.0.251", 5353)
        )
        try:
            host = outbound_address(*target)
        except OSError:
            host = "127.0.0.1"
        return host if not host.startswith("127.") else announce_addresses(listen_host)[0]

    def _adopt_observed(self) -> None:
        """Take the address peers see us connect from, when it is ours and we were guessing."""
        observed = self.membership.observed_host
        host, port = self.address.rsplit(":", 1)
        listen_host, _ = parse_hostport(self.config.net.listen)
        guessing = not self.config.net.announce and listen_host in ("0.0.0.0", "", "::")
        if not guessing or not observed or observed == host:
            return
        if observed in {str(i.ip) for i in local_ipv4_networks()} and not observed.startswith(
            "127."
        ):
            log.info(
                "peers reach this node at %s, not %s: announcing %s:%s",
                observed,
                host,
                observed,
                port,
            )
            self.address = f"{observed}:{port}"

    async def _start_discovery(self) -> None:
        self.membership.add_bootstrap(list(self.config.net.bootstrap))
        if not self.config.net.zeroconf:
            return
        host, port = self.address.rsplit(":", 1)
        listen_host, _ = parse_hostport(self.config.net.listen)
        addresses = (
            [host] if listen_host not in ("0.0.0.0", "") else announce_addresses(listen_host)
        )
        self.discovery = ZeroconfDiscovery(
            swarm=self.config.swarm.name,
            fingerprint=self.fingerprint,
            peer_id=self.peer_id,
            port=int(port),
            addresses=addresses,
            interfaces=list(self.config.net.zeroconf_interfaces) or None,
            on_sighting=lambda s: self.membership.add_address(s.best_address()),
        )
        try:
            await self.discovery.start()
        except OSError as e:
            log.warning("zeroconf unavailable (%s); relying on bootstrap addresses", e)
            self.discovery = None

    async def _join(self) -> None:
        """Listen for the swarm, pick a stage, get its weights, start serving."""
        t0 = time.monotonic()
        await self.balancer.measure()  # while we listen for peers
        await asyncio.sleep(max(0.0, self.config.node.join_wait_s - (time.monotonic() - t0)))
        self._adopt_observed()
        if self.config.node.stage == "auto":
            self.stage = self.balancer.choose()
        else:
            self.stage = int(self.config.node.stage)
        await self._take_stage(self.stage)

    async def _take_stage(self, stage: int) -> None:
        """Build ``stage``'s runner, get its weights (copy, rebuild or seed), start serving it."""
        from node.roles.head import HeadTrainer
        from node.services.sync import StageSync

        known_rate = 0.0  # a mover keeps its measured speed, scaled if stages differ in cost
        if self.runner is not None and self.balancer.estimate(self.stage) > 0:
            known_rate = self.runner.service_rate * (
                self.balancer.estimate(stage) / self.balancer.estimate(self.stage)
            )
        self.stage = stage
        self.stage_since = time.monotonic()
        self.runner = StageRunner(self.config, stage)
        await self.runner.start()
        if stage > 0:  # publish a rate at once: what we served before, else the benchmark
            self.runner.seed_rate(known_rate or self.balancer.estimate(stage))
        if stage == 0:
            self.trainer = HeadTrainer(self)
            await self.trainer.prepare()
        if not await self._fetch_state() and any(p.step > 0 for p in self.table.records()):
            # The swarm has trained and this stage has no replica left: it was lost.
            await self.recovery.rebuild(stage)
        self.sync = StageSync(self)
        self.ready = True
        log.info("serving stage %d (step %d)", self.stage, self.runner.step)

    async def move_to(self, stage: int) -> None:
        """Leave this block stage for ``stage``: stop taking work, drain, switch, rebuild."""
        assert self.runner is not None and self.stage != 0, "head nodes do not move"
        old = self.runner
        self.ready = False  # peers stop routing to us; new forwards are refused with not_ready
        self._draining = True  # ...but the backwards of forwards we already made are taken
        deadline = time.monotonic() + self.config.node.drain_s
        while (
            self._queue.qsize() or self._busy or self.sync._running or old.num_saved
        ) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._draining = False
        if old.num_saved:
            self.counters["backwards_lost_on_move"] += old.num_saved
        while not self._queue.empty():
            self._queue.get_nowait()
            self.counters["jobs_dropped_on_move"] += 1
        await self._take_stage(stage)
        old.close()

    async def _fetch_state(self) -> bool:
        """Copy the weights of the most advanced live replica of our stage, if there is one."""
        assert self.runner is not None
        sources = sorted(self.table.replicas(self.stage), key=lambda p: -p.step)
        for peer in sources:
            if self.router.is_quarantined(peer.peer_id, self.clock.now()):
                continue  # it sent poisoned weights before
            try:
                reply = await self.link.request(
                    peer.address, FetchState(stage=self.stage), 60.0, peer.peer_id
                )
                state = expect(reply, StageState)
                if not await self.recovery.screen_source(peer.peer_id, state.tensors):
                    continue  # poisoned: refused and banned
                await self.runner.run(self.runner.load, state.tensors, state.step, state.samples)
            except (TransportError, ValueError) as e:
                log.warning("state fetch from %s failed: %s", peer.peer_id[:8], e)
                self.router.finished(peer.peer_id, False, self.clock.now())  # likely dead: ban
                continue
            log.info(
                "copied stage %d state (step %d) from %s", self.stage, state.step, peer.peer_id[:8]
            )
            return True
        if self.config.node.init_dir:  # a new swarm from an export: load this stage's slice
            from node.stage.export import init_stage

            await self.runner.run(init_stage, self.runner, self.config.node.init_dir)
            log.info(
                "no live replica of stage %d: starting from the model in %s",
                self.stage,
                self.config.node.init_dir,
            )
            return False
        log.info(
            "no live replica of stage %d: starting from the seed's initial weights", self.stage
        )
        return False

    async def _shutdown(self) -> None:
        log.info("leaving the swarm")
        self.leaving = True
        if self._heartbeats is not None:
            self._heartbeats.cancel()  # a goodbye followed by a heartbeat would re-add us
        await self.membership.leave_all(timeout_s=1.0)
        deadline = time.monotonic() + self.config.node.drain_s
        while self._unfinished() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._unfinished():
            log.warning("exiting with %d jobs or sends unfinished", self._unfinished())

    def _unfinished(self) -> int:
        return self._queue.qsize() + self._busy + len(self._spawned)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task owned by the node: drained, then cancelled, at shutdown."""
        assert self._tasks is not None
        task = self._tasks.create_task(coro)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)

    async def _close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
        if self.discovery is not None:
            await self.discovery.stop()
        await self.transport.close()
        if self._site_runner is not None:
            await self._site_runner.cleanup()
        if self.runner is not None:
            self.runner.close()

    # ---- the compute queue --------------------------------------------------------------

    def enqueue(self, kind: str, job: Job, nbytes: int = 0) -> None:
        """Queue ``job``, which holds ``nbytes`` of tensors; ``busy`` or ``overloaded`` if full."""
        if self._queue.qsize() >= self.config.train.max_queue:
            raise Refused("busy", f"queue full ({self._queue.qsize()} jobs)", 503)
        if self._queue.empty():
            self._job_bytes.clear()  # jobs dropped unrun (a stage move) hold nothing any more
        queued = sum(self._job_bytes.values())
        if nbytes and queued + nbytes > self.config.net.max_queued_bytes:
            raise Refused(
                "overloaded",
                f"{queued} bytes of work queued, {nbytes} more would pass the "
                f"{self.config.net.max_queued_bytes}-byte limit",
                503,
            )
        self._seq += 1
        self._job_bytes[self._seq] = nbytes
        self._queue.put_nowait((_PRIORITY[kind], self._seq, job))

    async def _worker(self) -> None:
        """Run queued jobs one at a time; their sends overlap with the next computation."""
        while True:
            _, seq, job = await self._queue.get()
            self._job_bytes.pop(seq, None)
            self._busy += 1
            try:
                send = await job()
                if send is not None:
                    self.spawn(self._guard(send))
                self.sync.poll()
                self.recovery.poll()
            except Exception:
                self.counters["job_errors"] += 1
                log.exception("job failed")
            finally:
                self._busy -= 1

    async def _guard(self, send: Callable[[], Awaitable[object]]) -> None:
        try:
            await send()
        except Exception:
            self.counters["send_errors"] += 1
            log.exception("send failed")

    async def _housekeeping(self) -> None:
        assert self.runner is not None
        while True:
            await asyncio.sleep(1.0)
            self._adopt_observed()
            self.sync.forget_stale_rounds()
            freed = await self.runner.run(self.runner.expire_saved, time.monotonic())
            if freed:
                self.counters["activations_expired"] += freed
                log.info("freed %d saved activations whose gradient never came", freed)

    # ---- handlers -----------------------------------------------------------------------

    async def _handle_rpc(self, request: web.Request) -> web.Response:
        peer_host = request.remote or "?"
        try:
            incoming = self._authenticate(request)
            msg = await read_frame(request, self.limits, incoming)
            if incoming is not None:
                incoming.check_sender(msg)
            reply = await self._dispatch(msg, peer_host)
        except ProtocolError as e:
            return self._refuse(e.code, str(e), e.http_status, peer_host)
        except Refused as e:
            return self._refuse(e.code, e.message, e.http_status, peer_host)
        except Exception as e:  # unforeseen input must not take the daemon down: refuse it
            log.debug("request from %s raised", peer_host, exc_info=True)
            return self._refuse("internal_error", f"{type(e).__name__}: {e}", 500, peer_host)
        return await sealed_response(reply, incoming)

    def _authenticate(self, request: web.Request) -> Incoming | None:
        """A keyed swarm's cheap checks of a request's proof, before its body is read."""
        if self.auth is None:
            return None
        header = request.headers.get(AUTH_HEADER)
        return self.auth.accept(header, request.method, request.path, time.time())

    def _refuse(self, code: str, message: str, status: int, peer_host: str) -> web.Response:
        self.counters[f"rejected_{code}"] += 1
        self.log_limited(
            code, logging.WARNING, "refused request from %s: %s: %s", peer_host, code, message
        )
        return frame_response(Error(code=code, message=message), status=status)

    async def _dispatch(self, msg: Message, peer_host: str) -> Message:
        self.guard.admit(msg, peer_host)  # banned, unknown, rate-limited, duplicate
        if isinstance(msg, Hello):
            return self.membership.handle_hello(msg, peer_host)
        if isinstance(msg, Leave):
            self.membership.handle_leave(msg)
            self.router.forget(msg.peer_id)
            return Ack()
        if isinstance(msg, Forward):
            return self._on_forward(msg)
        if isinstance(msg, Backward):
            return self._on_backward(msg)
        if isinstance(msg, FetchState):
            return await self._on_fetch_state(msg)
        if isinstance(msg, GossipRequest):
            self._check_serving()
            return await self.sync.on_gossip(msg)
        if isinstance(msg, RingChunk):
            self._check_serving()
            self.sync.on_ring_chunk(msg)
            return Ack()
        if isinstance(msg, HeadBackup):
            self._check_serving()
            self.recovery.on_head_backup(msg)
            return Ack()
        if isinstance(msg, Rollback):
            self._check_serving()
            await self.recovery.on_rollback(msg)
            return Ack()
        raise Refused("unexpected_message", f"{msg.TYPE!r} is not a request", 400)

    def _check_serving(self) -> None:
        if self.leaving:
            raise Refused("leaving", "this node is shutting down", 503)
        if not self.ready:
            raise Refused("not_ready", "this node has not finished joining", 503)

    def _activation(self, tensors: Mapping[str, torch.Tensor], meta: dict[str, Any]) -> WireTensor:
        """Check an incoming activation or gradient, [B, T, d_model] and finite, as it came:
        the compute job decodes it (``WireTensor``), so the event loop runs no conversion."""
        x = open_tensor(tensors, meta)
        d = self.config.model.d_model
        shape = x.shape
        if len(shape) != 3 or shape[2] != d or not 0 < shape[1] <= self.config.model.max_seq_len:
            raise Refused(
                "bad_shape",
                f"expected [batch, seq<={self.config.model.max_seq_len}, {d}], got {list(shape)}",
                400,
            )
        if not x.finite():
            raise Refused("non_finite", "tensor contains NaN or infinite values", 400)
        return x

    def _on_forward(self, msg: Forward) -> Ack:
        self._check_serving()
        if msg.target_stage != self.stage:
            raise Refused(
                "wrong_stage", f"this node serves stage {self.stage}, not {msg.target_stage}"
            )
        if not msg.path or msg.path[0].stage != 0:
            raise Refused("bad_path", "a forward's path must start at its head node", 400)
        block_stages = list(range(1, self.num_stages))
        route = msg.route or block_stages
        hop = len(msg.path) - 1
        if sorted(route) != block_stages or (
            self.stage != 0 and (hop >= len(route) or route[hop] != self.stage)
        ):
            raise Refused(
                "bad_route",
                f"route {msg.route} does not bring hop {hop} to stage {self.stage}",
                400,
            )
        x = self._activation(msg.tensors, msg.meta)
        nbytes = 4 * math.prod(x.shape)  # float32 once decoded
        if self.stage == 0:
            self.enqueue("loss", self.trainer.loss_job(msg, x), nbytes)
        else:
            self.enqueue("forward", self._forward_job(msg, x), nbytes)
        self.guard.accepted(msg)
        return Ack()

    def _on_backward(self, msg: Backward) -> Ack:
        if not (self._draining and self.runner is not None and self.runner.has_saved(msg.mb_id)):
            self._check_serving()
        if not 0 <= msg.index < len(msg.path) or msg.path[msg.index].peer_id != self.peer_id:
            raise Refused(
                "not_on_path", f"this node is not hop {msg.index} of microbatch {msg.mb_id}", 400
            )
        g = self._activation(msg.tensors, msg.meta)
        nbytes = 4 * math.prod(g.shape)
        if self.stage == 0:
            self.enqueue("backward", self.trainer.backward_job(msg, g), nbytes)
            self.guard.accepted(msg)
            return Ack()
        assert self.runner is not None
        if not self.runner.has_saved(msg.mb_id):
            raise Refused(
                "unknown_microbatch",
                f"no saved activations for {msg.mb_id} (expired or never seen)",
                410,
            )
        self.enqueue("backward", self._backward_job(msg, g), nbytes)
        self.guard.accepted(msg)
        return Ack()

    async def _on_fetch_state(self, msg: FetchState) -> StageState:
        self._check_serving()
        backup = self.recovery.head_backup
        if msg.stage == 0 and self.stage != 0 and backup is not None:
            return StageState(stage=0, step=backup[0], samples=0, tensors=backup[1])
        if msg.stage != self.stage:
            raise Refused("wrong_stage", f"this node serves stage {self.stage}, not {msg.stage}")
        assert self.runner is not None
        tensors, step, samples = await self.runner.run(self.runner.snapshot)
        return StageState(stage=self.stage, step=step, samples=samples, tensors=tensors)

    async def _handle_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status())

    def _operator_refusal(self, request: web.Request) -> web.Response | None:
        """For the operator's endpoints that cost the node work (``/eval``, ``/profile``): in
        a keyed swarm, the refusal of a request without a valid proof over its empty body."""
        try:
            incoming = self._authenticate(request)
            if incoming is not None:
                incoming.verify(frame_digest([]))
        except ProtocolError as e:
            return self._json_refusal(e.code, str(e), e.http_status, request)
        return None

    def _json_refusal(
        self, code: str, message: str, status: int, request: web.Request
    ) -> web.Response:
        """Count and log a refused operator request; answer it in JSON."""
        self._refuse(code, message, status, request.remote or "?")
        return web.json_response({"error": f"{code}: {message}"}, status=status)

    async def _handle_eval(self, request: web.Request) -> web.Response:
        refused = self._operator_refusal(request)
        if refused is not None:
            return refused
        if self.trainer is None or not self.ready:
            return web.json_response(
                {"error": "only a ready head-stage node evaluates"}, status=409
            )
        loss = await self.trainer.evaluate()
        return web.json_response(
            {"eval_loss": loss, "step": self.runner.step if self.runner else 0}
        )

    async def _handle_profile(self, request: web.Request) -> web.Response:
        """``POST /profile?seconds=S``: the compute thread's torch operators over the next
        S seconds of training (``node.stage.opprofile``); one profile at a time."""
        refused = self._operator_refusal(request)
        if refused is not None:
            return refused
        try:
            seconds = check_seconds(float(request.query.get("seconds", DEFAULT_SECONDS)))
        except ValueError as e:
            return self._json_refusal("bad_request", f"profile: {e}", 400, request)
        runner = self.runner
        if runner is None or not self.ready:
            return self._json_refusal("not_ready", "no stage to profile yet", 409, request)
        if self._profiling:
            return self._json_refusal(
                "profile_running", "a profile is already running", 409, request
            )
        self._profiling = True
        try:
            summary = await profile_compute(runner, seconds)
        except RuntimeError:  # the runner closed under the profile
            message = f"the node left stage {runner.stage} during the profile"
            return self._json_refusal("stage_changed", message, 409, request)
        finally:
            self._profiling = False
        log.info("profiled the compute thread for %.1fs", seconds)
        return web.json_response({"peer_id": self.peer_id, "stage": runner.stage, **summary})

    # ---- block-stage jobs ---------------------------------------------------------------

    def _forward_job(self, msg: Forward, x: WireTensor) -> Job:
        runner = self.runner
        assert runner is not None
        codec = self.config.train.wire_codec

        path = [*msg.path, Hop(self.stage, self.peer_id, self.address)]
        route = msg.route or list(range(1, self.num_stages))
        hop = len(msg.path) - 1  # our position in the route
        nxt = route[hop + 1] if hop + 1 < len(route) else 0

        def compute() -> Forward:
            out = runner.block_forward(msg.mb_id, x.decode(), train=not msg.eval)
            tensors, meta = encode_tensor(out, codec, name="h")
            return prepare(
                Forward(
                    mb_id=msg.mb_id,
                    target_stage=nxt,
                    path=path,
                    eval=msg.eval,
                    meta=meta,
                    tensors=tensors,
                    route=msg.route,
                )
            )

        async def job() -> Callable[[], Awaitable[bool]]:
            out = await runner.run(compute)
            if nxt == 0:
                return lambda: self.send_to(path[0], out)
            return lambda: self.send_to_stage(nxt, out)

        return job

    def _backward_job(self, msg: Backward, g: WireTensor) -> Job:
        runner = self.runner
        assert runner is not None
        codec = self.config.train.wire_codec

        def compute() -> Backward:
            grad = runner.block_backward(msg.mb_id, g.decode())
            tensors, meta = encode_tensor(grad, codec, name="g")
            return prepare(
                Backward(
                    mb_id=msg.mb_id, index=msg.index - 1, path=msg.path, meta=meta, tensors=tensors
                )
            )

        async def job() -> Callable[[], Awaitable[bool]]:
            back = await runner.run(compute)
            return lambda: self.send_to(msg.path[msg.index - 1], back)

        return job

    # ---- sending hops -------------------------------------------------------------------

    async def send_to(self, hop: Hop, msg: Message) -> bool:
        """Send to one fixed peer (a microbatch's way home or back); False if it failed."""
        if await self._request(hop.peer_id, hop.address, msg) is None:
            return True
        self.counters["hops_dropped"] += 1
        return False

    async def send_to_stage(self, stage: int, msg: Message) -> bool:
        """Send to a replica of ``stage`` drawn by the router, retrying others on failure."""
        tried: set[str] = set()
        for attempt in range(self.config.train.hop_retries + 1):
            peer = await self._pick(stage, tried)
            if peer is None:
                break
            error = await self._request(peer.peer_id, peer.address, msg)
            if error is None:
                return True
            self.counters["hop_retries"] += 1
            if error != "busy":
                tried.add(peer.peer_id)
            await asyncio.sleep(0.05 * 2**attempt)
        self.counters["hops_dropped"] += 1
        self.log_limited(
            f"drop{stage}",
            logging.WARNING,
            "no replica of stage %d took a microbatch; dropped",
            stage,
        )
        return False

    async def _pick(self, stage: int, tried: set[str]) -> PeerRecord | None:
        """A replica of ``stage``; waits up to one hop timeout for one to appear."""
        deadline = time.monotonic() + self.config.train.hop_timeout_s
        while True:
            peer = self.router.choose(self.table.replicas(stage), self.clock.now(), exclude=tried)
            if peer is not None or time.monotonic() > deadline or self.leaving:
                return peer
            await asyncio.sleep(0.2)

    async def _request(self, peer_id: str, address: str, msg: Message) -> str | None:
        """Send one hop; ``None`` when the peer accepted it, else the error code."""
        self.router.started(peer_id)
        t0 = time.monotonic()
        timeout_s = self.config.train.hop_timeout_s
        try:
            try:
                reply = await self.link.request(address, msg, timeout_s, peer_id)
            except TransportError as e:
                # a peer that has not heard of us yet: introduce ourselves, then ask once more
                if e.code != "unknown_peer" or not await self.membership.contact(address):
                    raise
                reply = await self.link.request(address, msg, timeout_s, peer_id)
            expect(reply, Ack)
        except (TransportError, ValueError) as e:
            code = e.code if isinstance(e, TransportError) else "bad_reply"
            if code == "duplicate_microbatch":  # it reached that peer by another route already
                self.router.finished(peer_id, True, self.clock.now())
                return None
            self.router.finished(peer_id, False, self.clock.now())
            self.counters[f"send_failed_{code}"] += 1
            self.log_limited(
                f"send{peer_id}", logging.WARNING, "%s to %s failed: %s", msg.TYPE, peer_id[:8], e
            )
            return code
        self.router.finished(peer_id, True, self.clock.now(), time.monotonic() - t0)
        return None

    def log_limited(self, key: str, level: int, fmt: str, *args: Any) -> None:
        """Log at most once per 5 s per ``key`` (hostile or broken peers must not flood logs)."""
        now = time.monotonic()
        if now - self._log_times.get(key, -1e9) >= 5.0:
            self._log_times[key] = now
            log.log(level, fmt, *args)
