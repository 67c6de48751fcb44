"""The daemon: one node's parts, built and wired, and its lifecycle.

Owns the order of a node's life: build its parts; start the server, membership and
discovery; join a stage (listen for peers, measure its own speed, choose a stage, copy or
rebuild its weights) and serve it; move to another stage when rebalancing or recovery says
so (stop taking work, drain, switch, rebuild); and shut down in order (tell peers, refuse
new work, finish what is queued, exit within ``node.drain_s``). Also composes the node's
record (what peers see in heartbeats) and its status (``node status``, the metrics).

Parts are built here and receive what they use (``node.context``), never the node:

- ``node.server``: the HTTP endpoints and message dispatch;
- ``node.pipeline``: the compute queue and hop sending;
- ``node.roles``: the stage role, head (``HeadRole``) or block (``BlockRole``);
- ``node.services``: the guard, outer sync, recovery, balancing and state copying;
- ``node.stage.runner``: the stage's weights on the compute thread.

One process, one event loop, one compute thread.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Coroutine
from typing import Any

from node.config import Config, describe, parse_hostport
from node.context import NodeContext, NodeState
from node.identity import swarm_auth
from node.loopwatch import LoopWatch
from node.metrics import MetricsServer, start_metrics_server
from node.net.addresses import ANY_HOST, DIRECT, UNKNOWN, announce_host, observed_address
from node.net.netem import shaped
from node.net.relay import RelayClient, RelayHub, RelayRoutes
from node.net.swarmtime import SwarmTime
from node.net.tcp import CongestionControl
from node.net.transport import HttpTransport, TrafficStats, server_stats
from node.pipeline import HopSender, WorkQueue
from node.roles.base import StageRole
from node.roles.block import BlockRole
from node.roles.head import HeadRole
from node.server import NodeServer
from node.services.balance import Balancer
from node.services.guard import RequestGuard
from node.services.reachability import ReachabilityService
from node.services.recovery import RecoveryService
from node.services.statefetch import StateFetcher
from node.services.sync import StageSync
from node.stage.export import init_stage
from node.stage.model import model_fingerprint
from node.stage.runner import StageRunner
from protocol.auth import Identity
from protocol.frames import Limits
from protocol.messages import PeerRecord, StageState
from swarm.balance import SETTLE_ROUNDS
from swarm.discovery import ZeroconfDiscovery, announce_addresses
from swarm.membership import IntroducingTransport, MembershipService
from swarm.peers import Neighbourhood, PeerTable
from swarm.routing import Router
from swarm.seams import MonotonicClock

log = logging.getLogger(__name__)


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
        self.started_s = time.monotonic()
        self.state = NodeState()
        self.clock = MonotonicClock(config.node.debug_clock_skew_s)
        self.rng = random.Random(self.peer_id)
        limits = Limits(max_frame_bytes=config.net.max_frame_bytes)
        # BBR where allowed, else (by default) the node paces its uploads itself
        self.congestion = CongestionControl(config.net.tcp_congestion, config.net.uplink_pacing)
        self.congestion.check()
        self.http = HttpTransport(limits, self.auth, self.congestion)
        # a keyed swarm's proofs are stamped with the time most members seal (a clock hours
        # off still joins); None in an open swarm
        self.swarm_time = SwarmTime(self.auth) if self.auth is not None else None
        if self.swarm_time is not None:
            self.http.sealed_time = self.swarm_time.observe
        link = shaped(self.http, config.net)  # the testbeds' emulated latency and uplink
        members = config.membership
        # CheckFree+'s swapped routes hop two stages at a time (1 -> 3, N-2 -> N, N-1 -> head)
        radius = 2 if config.recovery.method == "checkfree+" else 1
        scope = (
            Neighbourhood(self.num_stages, radius) if members.tables == "neighbourhood" else None
        )
        self.table = PeerTable(self.peer_id, members.ttl_s, members.max_peers, scope=scope)
        # a failed peer that spoke to us in the last two heartbeats is alive (Router.unresponsive)
        self.router = Router(
            self.rng, silent_s=2 * members.heartbeat_s, cutoff=config.train.route_cutoff
        )
        self.router.samples = float(config.data.batch_size)
        self.membership = MembershipService(
            config.membership,
            swarm=config.swarm.name,
            fingerprint=self.fingerprint,
            table=self.table,
            transport=link,
            clock=self.clock,
            self_record=self.record,
            rng=self.rng,
            first_incarnation=int(time.time() * 1000),  # above any of an earlier life's
        )
        self.counters: Counter[str] = Counter()
        self.loop_watch = LoopWatch(self.counters)
        self.discovery: ZeroconfDiscovery | None = None
        self._stop = asyncio.Event()
        self._tasks: asyncio.TaskGroup | None = None
        self._spawned: set[asyncio.Task[None]] = set()
        self._heartbeats: asyncio.Task[None] | None = None
        self._metrics: MetricsServer | None = None
        self.ctx = NodeContext(
            config=config,
            peer_id=self.peer_id,
            num_stages=self.num_stages,
            state=self.state,
            clock=self.clock,
            rng=self.rng,
            table=self.table,
            stages=self.membership.view,
            router=self.router,
            transport=IntroducingTransport(link, self.membership.introduce, self.clock),
            counters=self.counters,
            spawn=self.spawn,
        )
        self._build_parts(limits)

    def _build_parts(self, limits: Limits) -> None:
        """The parts that serve the node, each given the context and the callables it uses."""
        self.guard = RequestGuard(self.ctx)  # admission of requests, bans of hostile peers
        self.states = StateFetcher(self.ctx, self.guard)
        net = self.config.net
        self.relays = RelayClient(  # what relays bring is served as /rpc serves it
            peer_id=self.peer_id,
            auth=self.auth,
            max_frame_bytes=net.max_frame_bytes,
            want=net.relays,
            serve=lambda *relayed: self.server.serve_relayed(*relayed),
            congestion=self.congestion,
        )
        self.relay_hub = RelayHub(
            peer_id=self.peer_id,
            auth=self.auth,
            max_frame_bytes=net.max_frame_bytes,
            capacity=net.relay_capacity,
            max_bytes_per_s=net.relay_max_bytes_per_s,
            tamper=net.debug_relay_tamper,
        )
        self.reachability = ReachabilityService(self.ctx, self.relays, self.relay_hub.attached)
        self.relay_hub.on_attach = lambda _peer_id: self.reachability.attach_seen()
        # a node relays once peers can dial it (or nobody has said they cannot)
        self.relay_hub.enabled = lambda: (
            not net.force_relay and self.reachability.state in (DIRECT, UNKNOWN)
        )
        self.http.routes = RelayRoutes(self.relay_hub, self.table.records).route
        self.balancer = Balancer(self.ctx, record=self.record, move_to=self.move_to)
        self.recovery = RecoveryService(
            self.ctx,
            states=self.states,
            record=self.record,
            move_to=self.move_to,
            in_transit=self.balancer.in_transit,
        )
        self.work = WorkQueue(self.ctx, after_job=self._after_job)
        self.hops = HopSender(self.ctx)
        self.role: StageRole | None = None
        self.sync: StageSync | None = None
        self.server = NodeServer(
            self.ctx,
            auth=self.auth,
            limits=limits,
            guard=self.guard,
            membership=self.membership,
            recovery=self.recovery,
            balancer=self.balancer,
            reachability=self.reachability,
            relay_hub=self.relay_hub,
            work=self.work,
            role=lambda: self.role,
            sync=lambda: self.sync,
            status=self.status,
            congestion=self.congestion,
        )

    @property
    def runner(self) -> StageRunner | None:
        return self.state.runner

    # ---- identity and status ------------------------------------------------------------

    def record(self) -> PeerRecord:
        """This node as its heartbeats describe it to peers."""
        r, state = self.state.runner, self.state
        head = self.role if isinstance(self.role, HeadRole) else None
        return PeerRecord(
            peer_id=self.peer_id,
            address=state.address,
            stage=state.stage,
            step=r.step if r else 0,
            throughput=r.service_rate if r else self.balancer.estimate(state.stage),
            queue=self.work.qsize(),
            ready=state.serving,
            leaving=state.leaving,
            grad_norm=r.thermo.grad_norm if r else 0.0,
            loss=head.last_loss if head else None,
            head_backup_step=self.recovery.head_backup_step,
            data_shard=head.shard if head else -1,
            movable=self.balancer.movable,
            step_s=r.step_s if r else 0.0,
            round_s=self.sync.round_s if self.sync else 0.0,
            relays=self.relays.addresses,
            relay_slots=self.relay_hub.slots(),
            settling=state.settling,
        )

    def _published_step_s(self) -> float:
        """This replica's seconds per inner step as its record last told its peers."""
        published = self.membership.published()
        return published.step_s if published else 0.0

    def _left_out(self, stages: list[int], now: float) -> set[str]:
        """The replicas of ``stages`` our hops' draws leave out now (``train.route_cutoff``;
        none while it is off). Only a stage with a replica we have sent to is asked: the cut
        needs our own acknowledged figures."""
        if self.router.cutoff <= 0:
            return set()
        stats, out = self.router.stats, set()
        for s in stages:
            replicas = self.table.replicas(s)
            if any(p.peer_id in stats for p in replicas):
                out |= self.router.left_out(replicas, now)
        return out

    def status(self) -> dict[str, Any]:
        """This node's view of the swarm, for ``node status`` and the demo."""
        now = self.clock.now()
        held = [s for s in range(self.num_stages) if self.table.covers(s)]
        peers: dict[str, list[dict[str, Any]]] = {str(s): [] for s in held}
        left_out = self._left_out(held, now)
        for p in sorted(self.table.records(), key=lambda p: (p.stage, p.peer_id)):
            peers.setdefault(str(p.stage), []).append(
                {
                    "peer_id": p.peer_id,
                    "address": p.address,
                    "step": p.step,
                    "throughput": round(p.throughput, 2),
                    "queue": p.queue,
                    "ready": p.ready,
                    "relayed": bool(p.relays),
                    "left_out": p.peer_id in left_out,
                    "age_s": round(self.table.age_s(p.peer_id, now) or 0.0, 2),
                }
            )
        r, state = self.state.runner, self.state
        out: dict[str, Any] = {
            "peer_id": self.peer_id,
            "address": state.address,
            "swarm": self.config.swarm.name,
            "fingerprint": self.fingerprint,
            "auth": "open" if self.auth is None else "swarm_key",
            "stage": state.stage,
            "relay_only": self.relay_only,
            "num_stages": self.num_stages,
            "ready": state.ready,
            "leaving": state.leaving,
            "uptime_s": round(time.monotonic() - self.started_s, 1),
            "step": r.step if r else 0,
            "samples": r.samples if r else 0,
            "compute_busy_s": round(r.compute_s, 3) if r else 0.0,
            "forwards": r.num_forwards if r else 0,
            "throughput": round(r.service_rate, 2) if r else 0.0,
            "queue": self.work.qsize(),
            "grad_norm": r.thermo.grad_norm if r else 0.0,
            "act_max": r.thermo.act_max if r else 0.0,
            "act_min": r.thermo.act_min if r else 0.0,
            "grad_norm_preclip": r.thermo.grad_norm_preclip if r else 0.0,
            "attn_logit_max": {str(k): v for k, v in r.thermo.attn_logit_max.items()} if r else {},
            "steps_skipped": r.grad_guard.num_spikes if r else 0,
            "grad_delay_steps": round(r.predictor.delay, 2) if r else 0.0,
            "lr_scale": r.current_lr_scale() if r else 1.0,
            "lr": r.current_lr() if r else 0.0,
            "schedule_step": round(r.schedule_step, 1) if r else 0.0,
            "counters": self._counters_with_table(),
            "loop": self.loop_watch.status(),
            "peers": peers,
            "stages": {  # every stage known: counted from the table, or a peer's summary
                str(s.stage): {
                    "replicas": s.replicas,
                    "ready": s.ready,
                    "throughput": round(s.throughput, 2),
                    "step": s.step,
                    "age_s": round(s.age_s, 1),
                    "held": str(s.stage) in peers,
                    "contact": s.contact,  # a replica to ask, for a stage not held
                }
                for s in self.membership.view().values()
            },
        }
        if self.sync is not None:
            out["sync"] = self.sync.status()
        if self.swarm_time is not None:
            out["swarm_time"] = self.swarm_time.status()
        out["wire"] = self.hops.wire_status()
        out["tcp_congestion"] = self.congestion.status()
        out["reachability"] = self.reachability.status()
        out["relay"] = {
            "via": self.relays.status(),
            "served": dict(self.relays.served),
            **self.relay_hub.status(),
        }
        out["membership"] = self.membership.status()
        out["recovery"] = self.recovery.status()
        out["balance"] = self.balancer.status()
        if isinstance(self.role, HeadRole):
            out.update(self.role.status())
        return out

    def traffic(self) -> tuple[TrafficStats, TrafficStats]:
        """What this node's transport sent (client side) and its server received."""
        return self.http.stats, server_stats(self.server.app)

    def _counters_with_table(self) -> dict[str, int]:
        out = dict(self.counters)
        if self.table.num_refused_full:
            out["peers_refused_table_full"] = self.table.num_refused_full
        if self.membership.num_buried:
            out["peers_buried"] = self.membership.num_buried
        if self.membership.clocks.steps:
            out["clock_steps"] = self.membership.clocks.steps
        if self.membership.clocks.peer_steps:
            out["peer_clock_steps"] = self.membership.clocks.peer_steps
        if self.router.num_left_out:
            out["route_left_out"] = self.router.num_left_out
        return out

    # ---- lifecycle ----------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()

    async def serve(self) -> None:
        """Run until ``request_stop``; then shut down in order."""
        await self.start_server()
        if self.config.net.metrics_port:
            net = self.config.net
            self._metrics = start_metrics_server(self, net.metrics_host, net.metrics_port)
        self._log_start()
        try:
            async with asyncio.TaskGroup() as tg:
                self._tasks = tg
                self._heartbeats = tg.create_task(self.membership.run())
                background = [self._heartbeats, tg.create_task(self.loop_watch.run())]
                if self.congestion.pacer is not None:
                    background.append(tg.create_task(self.congestion.pacer.run()))
                await self._start_discovery()
                joined = tg.create_task(self._join())
                stopped = tg.create_task(self._stop.wait())
                await asyncio.wait([joined, stopped], return_when=asyncio.FIRST_COMPLETED)
                if joined.done() and not joined.exception() and self.relay_only:
                    background.append(tg.create_task(self._relaying()))
                    await stopped
                elif joined.done() and not joined.exception():
                    background += [
                        tg.create_task(self.work.run()),
                        tg.create_task(self._housekeeping()),
                        tg.create_task(self.recovery.run()),
                        tg.create_task(self.balancer.run()),
                    ]
                    if isinstance(self.role, HeadRole):
                        background.append(tg.create_task(self.role.run()))
                    await stopped
                joined.cancel()
                await self._shutdown()
                for task in [*background, *self._spawned]:
                    task.cancel()
        finally:
            await self.close()

    async def start_server(self) -> None:
        """Start the transport and the HTTP server; learn the address to announce."""
        await self.http.start()
        port = await self.server.start()
        host, _ = parse_hostport(self.config.net.listen, "net.listen")
        self.state.address = f"{announce_host(self.config.net, host)}:{port}"
        self.router.here = self.state.address
        log.info(
            "node %s listening on %s:%d, announcing %s; its page: http://%s:%d/",
            self.peer_id,
            host,
            port,
            self.state.address,
            "127.0.0.1" if host in ANY_HOST else host,  # this machine's browser
            port,
        )

    def _log_start(self) -> None:
        log.info("config: %s", describe(self.config))
        if self.auth is None:
            log.warning(
                "swarm is open: no --swarm-key, so anyone who reaches %s can join, send any "
                "request and claim any peer id (see SECURITY.md)",
                self.state.address,
            )
        else:
            log.info("swarm key set: every request is authenticated; this is peer %s", self.peer_id)

    async def _start_discovery(self) -> None:
        self.membership.add_bootstrap(list(self.config.net.bootstrap))
        if not self.config.net.zeroconf:
            return
        host, port = self.state.address.rsplit(":", 1)
        listen_host, _ = parse_hostport(self.config.net.listen)
        addresses = [host] if listen_host not in ANY_HOST else announce_addresses(listen_host)
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

    def _adopt_observed(self) -> None:
        """Take the address peers see us connect from, when it is ours and we were guessing."""
        seen = observed_address(self.config.net, self.state.address, self.membership.observed_host)
        if seen is not None:
            self.state.address = self.router.here = seen

    @property
    def relay_only(self) -> bool:
        """``--stage relay``: a reachable node that serves no stage, only relays."""
        return self.config.node.stage == "relay"

    async def _join(self) -> None:
        """Listen for the swarm, pick a stage, get its weights, start serving."""
        if self.relay_only:
            await asyncio.sleep(self.config.node.join_wait_s)
            self._adopt_observed()
            await self.reachability.keep()
            log.info(
                "relaying only (no stage): for up to %d nodes that cannot be dialled",
                self.config.net.relay_capacity,
            )
            return
        t0 = time.monotonic()
        await self.balancer.measure()  # while we listen for peers
        await asyncio.sleep(max(0.0, self.config.node.join_wait_s - (time.monotonic() - t0)))
        self._adopt_observed()
        await self.reachability.until_servable(self._adopt_observed)
        if self.config.node.stage == "auto":
            stage = await self._settle()
        else:
            stage = int(self.config.node.stage)
        await self.take_stage(stage)

    async def _settle(self) -> int:
        """A ``--stage auto`` node's stage. Nodes started together all see the same table,
        and each alone would take the one stage that looks weakest to it; so a node
        announces its choice, waits ``node.settle_s`` past the last announcement it sees,
        and takes the stage only if its turn among the nodes that announced the same stage
        gives that stage again, else it announces the new answer and asks again
        (``swarm.balance.settle_join``; at most ``SETTLE_ROUNDS`` rounds). Each choice
        follows a whole-table exchange with a member (``MembershipService.refresh``): a
        NATed joiner misses the news pushed before its relay came (seen: four NATed joiners
        split 3, 1, one counting a stage empty that a fellow had taken 5 s before)."""
        wait = self.config.node.settle_s
        if wait > 0:  # each choice on a whole table, not the news that reached us
            await self.membership.refresh()
        stage, rounds = self.balancer.choose(), 0
        while wait > 0 and rounds < SETTLE_ROUNDS:
            rounds += 1
            self.state.stage, self.state.settling = stage, True
            self.membership.own()  # an essential change: pushed to peers at once
            await self._quiet(wait)
            await self.membership.refresh()
            again = self.balancer.choose(announced=stage)
            if again == stage:
                break
            stage = again
        self.state.settling = False  # published when we take the stage: count us there
        log.info("stage auto: joining stage %d (after %d round(s) of announcing)", stage, rounds)
        return stage

    async def _quiet(self, wait: float) -> None:
        """Until no new announcement came for ``wait`` seconds (at most three times that):
        nodes announcing in one burst then all look after it, over the same joiners. So a
        peer that keeps changing its announcement delays a join by at most
        ``SETTLE_ROUNDS`` times three ``wait``s (24 s by default)."""
        start = quiet = time.monotonic()
        seen = self._settling()
        while time.monotonic() - quiet < wait and time.monotonic() - start < 3 * wait:
            await asyncio.sleep(0.1)
            if not (now := self._settling()) <= seen:
                seen, quiet = seen | now, time.monotonic()

    def _settling(self) -> set[tuple[str, int]]:
        """Peers that announced a stage and may still change it, with the stage."""
        return {
            (r.peer_id, r.stage) for rs in self.ctx.everyone().values() for r in rs if r.settling
        }

    async def take_stage(self, stage: int) -> None:
        """Build ``stage``'s runner and role, get its weights (copy, rebuild or seed), serve."""
        state, old = self.state, self.state.runner
        known_rate = 0.0  # a mover keeps its measured speed, scaled if stages differ in cost
        if old is not None and self.balancer.estimate(state.stage) > 0:
            known_rate = old.service_rate * (
                self.balancer.estimate(stage) / self.balancer.estimate(state.stage)
            )
        state.stage, state.stage_since = stage, time.monotonic()
        # a table of neighbourhoods now holds other stages: meet their replicas first
        await self.membership.arrive(2 * self.config.membership.ttl_s)
        runner = StageRunner(self.config, stage)
        if stage > 0:  # a rate from the first heartbeat, sent while the module builds:
            runner.seed_rate(known_rate or self.balancer.estimate(stage))  # served, else bench
        state.runner = runner
        await runner.start()
        if stage > 0:
            self.role = BlockRole(self.ctx, runner, self.hops)
        else:
            head = HeadRole(self.ctx, runner, self.hops)
            await head.prepare()
            self.role = head
        trained = any(s.step > 0 for s in self.membership.view().values())
        if not await self._copy_state(runner) and trained:
            # The swarm has trained and this stage has no replica left: it was lost.
            await self.recovery.rebuild(stage)
        self.sync = StageSync(
            self.ctx,
            runner,
            self.guard,
            clock_offset=lambda: self.membership.stage_offset_s(stage),
            published_step_s=self._published_step_s,
            uplink_bytes_s=self.hops.sync_bytes_s,
        )
        state.ready = True
        log.info("serving stage %d (step %d)", stage, runner.step)

    async def _copy_state(self, runner: StageRunner) -> bool:
        """Copy the state of the most advanced live replica of the stage, if there is one;
        else start a new swarm's stage from ``--init`` or the seed. True if copied."""

        async def load(state: StageState) -> None:
            await runner.compute(runner.load, state.tensors, state.step, state.samples)

        if await self.states.fetch(runner.stage, load) is not None:
            return True
        init_dir = self.config.node.init_dir
        if init_dir:  # a new swarm from an export: load this stage's slice
            await runner.compute(init_stage, runner, init_dir)
            log.info(
                "no live replica of stage %d: starting from the model in %s", runner.stage, init_dir
            )
        else:
            log.info(
                "no live replica of stage %d: starting from the seed's initial weights",
                runner.stage,
            )
        return False

    async def move_to(self, stage: int) -> None:
        """Leave this block stage for ``stage``: stop taking work, drain, switch, rebuild."""
        state, old = self.state, self.state.the_runner()
        assert state.stage != 0, "head nodes do not move"
        state.ready = False  # peers stop routing to us; new forwards are refused with not_ready
        state.draining = True  # ...but the backwards of forwards we already made are taken
        deadline = time.monotonic() + self.config.node.drain_s
        while (
            self.work.unfinished() or (self.sync is not None and self.sync.running) or old.num_saved
        ) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        state.draining = False
        if old.num_saved:
            self.counters["backwards_lost_on_move"] += old.num_saved
        self.counters["jobs_dropped_on_move"] += self.work.drop_all()
        await self.take_stage(stage)
        # off the loop: closing waits for a job the old stage's thread may still be running
        await asyncio.to_thread(old.close)

    def _after_job(self) -> None:
        """After each compute job: start an outer round or a backup if one is due."""
        if self.sync is not None:
            self.sync.poll()
        self.recovery.poll()

    async def _relaying(self) -> None:
        """A relay-only node's housekeeping: its address and reachability (it relays while
        peers can dial it)."""
        while True:
            await asyncio.sleep(1.0)
            self._adopt_observed()
            await self.reachability.keep()

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self._adopt_observed()
            await self.reachability.keep()
            if self.sync is not None:
                self.sync.forget_stale_rounds()
                # a clock round is a wall-clock event: a replica that gets no work (routing
                # banned it after a failed hop, the head is gone) must still meet its
                # partners at the boundary, within a second here, or their rounds fail
                self.sync.poll()
            runner = self.state.the_runner()
            freed = await runner.compute(runner.expire_saved, time.monotonic())
            if freed:
                self.counters["activations_expired"] += freed
                log.info("freed %d saved activations whose gradient never came", freed)

    async def _shutdown(self) -> None:
        log.info("leaving the swarm")
        self.state.leaving = True
        if self._heartbeats is not None:
            self._heartbeats.cancel()  # a goodbye followed by a heartbeat would re-add us
        await self.membership.leave_all(timeout_s=1.0)
        deadline = time.monotonic() + self.config.node.drain_s
        while self._unfinished() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._unfinished():
            log.warning("exiting with %d jobs or sends unfinished", self._unfinished())

    def _unfinished(self) -> int:
        return self.work.unfinished() + len(self._spawned)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task owned by the node: drained, then cancelled, at shutdown."""
        assert self._tasks is not None
        task = self._tasks.create_task(coro)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)

    async def close(self) -> None:
        """Release what the node holds: metrics, discovery, transport, server, runner."""
        if self._metrics is not None:
            self._metrics.close()
        if self.discovery is not None:
            await self.discovery.stop()
        await self.relays.close()
        await self.relay_hub.close()
        await self.http.close()
        await self.server.close()
        if self.state.runner is not None:
            self.state.runner.close()
