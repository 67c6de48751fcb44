"""The node's HTTP face: ``/rpc`` and the relay's endpoints for peers, three for operators.

Owns the aiohttp application and what happens to a request before a service works on it:

- ``POST /rpc``: one frame in, one frame out (``node.net.transport``). In a keyed swarm the
  request's proof is checked before its body is read and its sender before it is
  dispatched (``protocol.auth``); the guard (``node.services.guard``) admits it (bans,
  unknown peers, rate limits, duplicates); then it goes to its handler: membership for
  ``Hello``, ``Ping``, ``Probe`` and ``Leave``; the stage role's jobs, queued, for
  ``Forward`` and ``Backward`` (after their route and activations are checked); the head
  role for a replica's ``Dropped`` notice; the runner for ``FetchState``; the sync
  service for gossip and ring chunks; recovery for head backups and rollbacks; the
  balancer for a replica's request to leave or join the stage; the reachability check for
  dial-backs and their probes.
- A frame a relay brings for this node over its WebSocket (``node.net.relay``) is served the
  same way (``serve_relayed``), proof and all; only dial-backs are refused that way, but for
  the relay's own, whose host is the one this node connected to.
- ``GET /relay`` and ``POST /relay/<peer id>``: this node relaying for nodes that cannot be
  dialled (``node.net.relay.RelayHub``).
- ``GET /status``: the node's view of the swarm, as JSON; ``GET /``: a page drawing it
  (``node/page.html``: stages as columns, the loss curve, sync rounds, recoveries).
- ``POST /eval`` (a ready head node evaluates now) and ``POST /profile?seconds=S`` (the
  compute thread's torch operators, ``node.stage.opprofile``): they cost the node work, so
  a keyed swarm wants a proof over the empty body.

Every refusal is an ``Error`` frame (or JSON for operators) with a stable code and HTTP
status, counted as ``rejected_<code>`` and logged at most once per 5 s per code; a request
that raises anything unforeseen is refused as ``internal_error`` and the node goes on.

Does not own the services' rules, the compute queue (``node.pipeline``) or the lifecycle.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from node.config import parse_hostport
from node.context import NodeContext
from node.logs import RateLimitedLog
from node.net.relay import RelayHub
from node.net.tcp import CongestionControl
from node.net.transport import (
    RELAY_PATH,
    RPC_PATH,
    Served,
    StaleSeals,
    frame_response,
    open_frame,
    read_body,
    response_frame,
    sealed_response,
    server_stats,
)
from node.pipeline import WorkQueue
from node.roles.base import StageRole
from node.roles.head import HeadRole
from node.services.balance import Balancer
from node.services.guard import RequestGuard
from node.services.reachability import ReachabilityService
from node.services.recovery import RecoveryService
from node.services.sync import StageSync
from node.stage.opprofile import DEFAULT_SECONDS, check_seconds, profile_compute
from protocol.auth import AUTH_HEADER, Incoming, SwarmAuth, frame_digest
from protocol.errors import AuthStale, ProtocolError
from protocol.frames import Limits
from protocol.messages import (
    Ack,
    Backward,
    DialBack,
    DialProbe,
    Dropped,
    Error,
    FetchState,
    Forward,
    GossipFollow,
    GossipRequest,
    HeadBackup,
    Hello,
    Leave,
    Message,
    MoveRequest,
    Ping,
    Probe,
    RingChunk,
    Rollback,
    StageState,
)
from protocol.quant import WireTensor, open_tensor
from swarm.membership import MembershipService
from swarm.seams import Refused
from swarm.wirecodec import arrival_rate

log = logging.getLogger(__name__)

PAGE = (Path(__file__).parent / "page.html").read_text(encoding="utf-8")
"""The swarm's page (``GET /``): stages, replicas, the loss curve, sync rounds, recoveries;
it reads ``/status`` every 3 s, so it shows nothing ``/status`` does not."""


class NodeServer:
    """Serves one node's endpoints; the daemon starts and closes it."""

    def __init__(
        self,
        ctx: NodeContext,
        *,
        auth: SwarmAuth | None,
        limits: Limits,
        guard: RequestGuard,
        membership: MembershipService,
        recovery: RecoveryService,
        balancer: Balancer,
        reachability: ReachabilityService,
        relay_hub: RelayHub,
        work: WorkQueue,
        role: Callable[[], StageRole | None],
        sync: Callable[[], StageSync | None],
        status: Callable[[], dict[str, Any]],
        congestion: CongestionControl,
    ) -> None:
        """``role()`` and ``sync()``: the current stage's (they change when the node moves);
        ``status()``: the node's status for ``GET /status``."""
        self.ctx = ctx
        self.auth = auth
        self.limits = limits
        self.guard = guard
        self.membership = membership
        self.recovery = recovery
        self.balancer = balancer
        self.reachability = reachability
        self.relay_hub = relay_hub
        self.work = work
        self.role = role
        self.sync = sync
        self.status = status
        self.congestion = congestion
        self.app = web.Application(client_max_size=ctx.config.net.max_frame_bytes)
        if congestion.pacer is not None:  # not a call per response where nothing is paced
            # the connections peers open to this node carry its answers: paced as its own are
            self.app.on_response_prepare.append(self._govern)
        self.app.router.add_post(RPC_PATH, self._handle_rpc)
        self.app.router.add_get(RELAY_PATH, relay_hub.handle_attach)
        self.app.router.add_post(RELAY_PATH + "/{peer}", relay_hub.handle_forward)
        self.app.router.add_get("/status", self._handle_status)
        self.app.router.add_get("/", self._handle_page)
        self.app.router.add_post("/eval", self._handle_eval)
        self.app.router.add_post("/profile", self._handle_profile)
        self._runner: web.AppRunner | None = None
        self.socket: socket.socket | None = None
        """The listening socket, once started."""
        self._profiling = False
        self._log = RateLimitedLog(log)
        self._stale_seals = StaleSeals(auth)

    async def start(self) -> int:
        """Listen on ``net.listen``; returns the port bound."""
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        host, port = parse_hostport(self.ctx.config.net.listen, "net.listen")
        self.socket = self.congestion.listening_socket(host, port)
        site = web.SockSite(self._runner, self.socket)
        await site.start()
        bound: int = self._runner.addresses[0][1]
        return bound

    async def _govern(self, request: web.Request, _: web.StreamResponse) -> None:
        if request.transport is not None:
            self.congestion.govern(request.transport.get_extra_info("socket"))

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # ---- /rpc ---------------------------------------------------------------------------

    async def _handle_rpc(self, request: web.Request) -> web.Response:
        async def body() -> tuple[bytes | bytearray, float]:
            t0 = time.perf_counter()  # the headers are in: what follows is the transfer
            raw = await read_body(request, self.limits)
            return raw, arrival_rate(len(raw), time.perf_counter() - t0)

        header = request.headers.get(AUTH_HEADER)
        return await self._serve(header, body, request.remote or "?", hearsay=False)

    async def serve_relayed(
        self, header: str | None, frame: bytes, origin: str, firsthand: bool
    ) -> Served:
        """A frame a relay brought (``node.net.relay``), served as ``/rpc`` serves one; its
        sender's host ``origin`` is the relay's word unless ``firsthand`` (the relay's own
        request: the host this node connected to)."""

        async def body() -> tuple[bytes, float]:
            return frame, 0.0  # the relay read it: no time of the sender's link to report

        resp = await self._serve(header, body, origin, hearsay=not firsthand)
        return resp.status, resp.headers.get(AUTH_HEADER), response_frame(resp)

    async def _serve(
        self,
        header: str | None,
        body: Callable[[], Awaitable[tuple[bytes | bytearray, float]]],
        peer_host: str,
        hearsay: bool,
    ) -> web.Response:
        """One frame in, one frame out: the proof's cheap checks before the body is read.
        ``body()``: the frame and the rate it arrived at (``swarm.wirecodec.arrival_rate``)."""
        try:
            incoming = self._authenticate(header)
            raw, rate = await body()
            msg = await open_frame(raw, self.limits, incoming, server_stats(self.app))
            if incoming is not None:
                incoming.check_sender(msg)
            reply = await self._dispatch(msg, peer_host, hearsay)
            if rate and isinstance(msg, Forward | Backward) and isinstance(reply, Ack):
                reply = replace(reply, rate=rate)  # the sender chooses its wire codec by it
        except AuthStale as e:  # sealed with this node's time, so a far-off clock can learn it
            return self._refuse(e.code, str(e), e.http_status, peer_host, stale_proof=header)
        except ProtocolError as e:
            return self._refuse(e.code, str(e), e.http_status, peer_host)
        except Refused as e:
            return self._refuse(e.code, e.message, e.http_status, peer_host)
        except Exception as e:  # unforeseen input must not take the daemon down: refuse it
            log.debug("request from %s raised", peer_host, exc_info=True)
            return self._refuse("internal_error", f"{type(e).__name__}: {e}", 500, peer_host)
        return await sealed_response(reply, incoming)

    def _authenticate(self, header: str | None) -> Incoming | None:
        """A keyed swarm's cheap checks of a ``POST /rpc`` proof, before the body is read."""
        if self.auth is None:
            return None
        return self.auth.accept(header, "POST", RPC_PATH, time.time())

    def _refuse(
        self,
        code: str,
        message: str,
        status: int,
        peer_host: str,
        stale_proof: str | None = None,
    ) -> web.Response:
        """Count, log and answer a refusal; one of a request as stale (its proof's header,
        ``stale_proof``) is sealed with this node's time (``StaleSeals``)."""
        self.ctx.counters[f"rejected_{code}"] += 1
        self._log.log(
            code, logging.WARNING, "refused request from %s: %s: %s", peer_host, code, message
        )
        reply = Error(code=code, message=message)
        headers = None if stale_proof is None else self._stale_seals.headers(stale_proof, reply)
        return frame_response(reply, status=status, headers=headers)

    async def _dispatch(self, msg: Message, peer_host: str, hearsay: bool) -> Message:
        """``hearsay``: ``peer_host`` is a relay's word, not a socket's."""
        sender = self.guard.admit(msg, peer_host)  # banned, unknown, rate-limited, duplicate
        if sender is not None and sender != self.ctx.peer_id:
            self.ctx.router.heard(sender, self.ctx.clock.now())  # alive, whatever our hops met
        if isinstance(msg, Hello):
            return self.membership.handle_hello(msg, peer_host)
        if isinstance(msg, Ping):
            return self.membership.handle_ping(msg)
        if isinstance(msg, Probe):
            return await self.membership.handle_probe(msg)
        if isinstance(msg, Leave):
            self.membership.handle_leave(msg)
            self.ctx.router.forget(msg.peer_id)
            return Ack()
        if isinstance(msg, Forward):
            return self._on_forward(msg)
        if isinstance(msg, Backward):
            return self._on_backward(msg)
        if isinstance(msg, FetchState):
            return await self._on_fetch_state(msg)
        if isinstance(msg, DialBack):
            if hearsay:  # the host it came from is only the relay's word: dial nobody
                raise Refused("relayed", "dial-backs are not answered through a relay", 400)
            return await self.reachability.on_dial_back(msg, peer_host)
        if isinstance(msg, DialProbe):
            return self.reachability.on_probe(msg)
        self.ctx.state.check_serving()
        if isinstance(msg, Dropped):
            return self._on_dropped(msg)
        if isinstance(msg, GossipRequest):
            return await self._current_sync().on_gossip(msg)
        if isinstance(msg, GossipFollow):
            return await self._current_sync().on_follow(msg)
        if isinstance(msg, RingChunk):
            self._current_sync().on_ring_chunk(msg)
            return Ack()
        if isinstance(msg, HeadBackup):
            self.recovery.on_head_backup(msg)
            return Ack()
        if isinstance(msg, Rollback):
            await self.recovery.on_rollback(msg)
            return Ack()
        if isinstance(msg, MoveRequest):
            return self.balancer.on_request(msg)
        raise Refused("unexpected_message", f"{msg.TYPE!r} is not a request", 400)

    def _current_sync(self) -> StageSync:
        sync = self.sync()
        assert sync is not None, "a serving node synchronises"
        return sync

    def _current_role(self) -> StageRole:
        role = self.role()
        assert role is not None, "a serving node has a role"
        return role

    # ---- a microbatch arrives -----------------------------------------------------------

    def _on_forward(self, msg: Forward) -> Ack:
        state = self.ctx.state
        state.check_serving()
        if msg.target_stage != state.stage:
            raise Refused(
                "wrong_stage", f"this node serves stage {state.stage}, not {msg.target_stage}"
            )
        self._check_route(msg)
        x = self._activation(msg.tensors, msg.meta)
        role = self._current_role()
        self.work.put(role.forward_kind, role.forward_job(msg, x), 4 * math.prod(x.shape))
        self.guard.accepted(msg)
        return self._work_ack()

    def _check_route(self, msg: Forward) -> None:
        """A forward's path starts at its head, and its route brings this hop to us."""
        if not msg.path or msg.path[0].stage != 0:
            raise Refused("bad_path", "a forward's path must start at its head node", 400)
        stage = self.ctx.stage
        block_stages = list(range(1, self.ctx.num_stages))
        route = msg.route or block_stages
        hop = len(msg.path) - 1
        if sorted(route) != block_stages or (
            stage != 0 and (hop >= len(route) or route[hop] != stage)
        ):
            raise Refused(
                "bad_route", f"route {msg.route} does not bring hop {hop} to stage {stage}", 400
            )

    def _on_backward(self, msg: Backward) -> Ack:
        state = self.ctx.state
        runner = state.runner
        if not (state.draining and runner is not None and runner.has_saved(msg.mb_id)):
            state.check_serving()  # a draining node still takes backwards of its forwards
        if not 0 <= msg.index < len(msg.path) or msg.path[msg.index].peer_id != self.ctx.peer_id:
            raise Refused(
                "not_on_path", f"this node is not hop {msg.index} of microbatch {msg.mb_id}", 400
            )
        g = self._activation(msg.tensors, msg.meta)
        job = self._current_role().backward_job(msg, g)
        self.work.put("backward", job, 4 * math.prod(g.shape))
        self.guard.accepted(msg)
        return self._work_ack()

    def _on_dropped(self, msg: Dropped) -> Ack:
        role = self._current_role()
        if not isinstance(role, HeadRole):
            stage = self.ctx.state.stage
            raise Refused("wrong_stage", f"this node serves stage {stage}, not the head's", 409)
        return role.on_dropped(msg)

    def _work_ack(self) -> Ack:
        """A microbatch's ack: our jobs queued or running (it included) and compute rate of
        the moment, by which its sender's router weighs us (``swarm.routing``). The job
        running counts: on a slow replica it is most of the wait."""
        runner = self.ctx.state.runner
        rate = runner.service_rate if runner is not None else 0.0
        return Ack(queue=self.work.unfinished(), service_rate=rate)

    def _activation(self, tensors: Mapping[str, torch.Tensor], meta: dict[str, Any]) -> WireTensor:
        """Check an incoming activation or gradient, [B, T, d_model] and finite, as it came:
        the compute job decodes it (``WireTensor``), so the event loop runs no conversion."""
        x = open_tensor(tensors, meta)
        model = self.ctx.config.model
        shape = x.shape
        if len(shape) != 3 or shape[2] != model.d_model or not 0 < shape[1] <= model.max_seq_len:
            raise Refused(
                "bad_shape",
                f"expected [batch, seq<={model.max_seq_len}, {model.d_model}], got {list(shape)}",
                400,
            )
        if not x.finite():
            raise Refused("non_finite", "tensor contains NaN or infinite values", 400)
        return x

    async def _on_fetch_state(self, msg: FetchState) -> StageState:
        state = self.ctx.state
        state.check_serving()
        backup = self.recovery.head_backup
        if msg.stage == 0 and state.stage != 0 and backup is not None:
            return StageState(stage=0, step=backup[0], samples=0, tensors=backup[1])
        if msg.stage != state.stage:
            raise Refused("wrong_stage", f"this node serves stage {state.stage}, not {msg.stage}")
        runner = state.the_runner()
        tensors, step, samples = await runner.compute(runner.snapshot)
        return StageState(stage=state.stage, step=step, samples=samples, tensors=tensors)

    # ---- operators ----------------------------------------------------------------------

    async def _handle_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status())

    async def _handle_page(self, request: web.Request) -> web.Response:
        """``GET /``: the swarm's page, drawn in the browser from ``/status`` (no CDN)."""
        return web.Response(text=PAGE, content_type="text/html", charset="utf-8")

    def _operator_refusal(self, request: web.Request) -> web.Response | None:
        """For the operator's endpoints that cost the node work (``/eval``, ``/profile``): in
        a keyed swarm, the refusal of a request without a valid proof over its empty body."""
        try:
            incoming = None
            if self.auth is not None:
                header = request.headers.get(AUTH_HEADER)
                incoming = self.auth.accept(header, request.method, request.path, time.time())
            if incoming is not None:
                incoming.verify(frame_digest([]))
        except ProtocolError as e:
            return self._json_refusal(e.code, str(e), e.http_status, request)
        return None

    def _json_refusal(
        self, code: str, message: str, status: int, request: web.Request
    ) -> web.Response:
        """Count and log a refused operator request; answer it in JSON (a refusal as stale
        with the time this node's proofs follow, for the operator's one retry)."""
        self._refuse(code, message, status, request.remote or "?")
        answer: dict[str, Any] = {"error": f"{code}: {message}"}
        if code == AuthStale.code and self.auth is not None:
            answer["proof_time"] = time.time() + self.auth.clock_offset_s
        return web.json_response(answer, status=status)

    async def _handle_eval(self, request: web.Request) -> web.Response:
        refused = self._operator_refusal(request)
        if refused is not None:
            return refused
        role = self.role()
        if not isinstance(role, HeadRole) or not self.ctx.state.ready:
            return web.json_response(
                {"error": "only a ready head-stage node evaluates"}, status=409
            )
        loss = await role.evaluate()
        return web.json_response({"eval_loss": loss, "step": role.runner.step})

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
        runner = self.ctx.state.runner
        if runner is None or not self.ctx.state.ready:
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
        return web.json_response({"peer_id": self.ctx.peer_id, "stage": runner.stage, **summary})
