"""Prometheus metrics: a node's state exported at scrape time on ``--metrics-port``.

Owns the ``murmur_*`` metric names and labels and the metrics HTTP endpoint. A custom
collector reads the node's state when Prometheus scrapes (``Node.status()``, the transport's
traffic statistics, ``Node.traffic()``) instead of calls sprinkled through the algorithm code, into a registry
of its own (several nodes may share a process in tests). Labels are of low cardinality only:
``stage``, ``kind`` (wire message type), ``outcome``, ``code``, ``direction``; never a peer id.

The endpoint is prometheus_client's threaded HTTP server. A scrape runs on that thread and
takes its snapshot of the node on the event loop (``run_coroutine_threadsafe``), so state
owned by the loop is never read while the loop changes it and the loop never waits for a
scrape. Does not own the state it exports, nor decide what is counted.

Thermometers (YaLM-100B practice; ``docs/algorithms.md`` section 9): per stage the latest maximum and
minimum output activation and the post-clip gradient norm, so a runaway shows before the
loss explodes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from node.net.addresses import REACHABILITY_STATES
from node.net.transport import TrafficStats
from swarm.schedule import MAX_ROUND_MULTIPLE

log = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT_S = 5.0
"""How long a scrape waits for the event loop to hand over a snapshot."""

_NAMED_COUNTERS = {
    "hop_retries": ("murmur_hop_retries", "Hops retried on another replica."),
    "hops_dropped": ("murmur_hops_dropped", "Hops no replica took (the microbatch is lost there)."),
    "activations_expired": (
        "murmur_activations_expired",
        "Saved activations freed because their gradient never came.",
    ),
    "job_errors": ("murmur_job_errors", "Queued compute jobs that raised."),
    "send_errors": ("murmur_send_errors", "Sends that raised after their computation."),
    "non_finite_loss": ("murmur_non_finite_loss", "Microbatches whose loss was NaN or infinite."),
    "loop_stalls": (
        "murmur_loop_stalls",
        "Times the event loop was held up 2 s or more: the node answered nothing meanwhile "
        "(its log names the code that held it).",
    ),
    "loss_spikes_skipped": (
        "murmur_loss_spikes_skipped",
        "Microbatches not trained on: their loss spiked or was not finite (counted as dropped).",
    ),
    "stages_seen_empty": (
        "murmur_stages_seen_empty",
        "Times this node saw a stage lose its last live replica (a refill may follow).",
    ),
    "route_left_out": (
        "murmur_route_left_out",
        "Replicas left out of a hop's draw (train.route_cutoff): expected to take more than "
        "the cutoff times the best replica's time; one per draw each.",
    ),
    "peers_banned": ("murmur_peers_banned", "Peers banned for sending poisoned weights."),
    "peers_refused_table_full": (
        "murmur_peers_refused_table_full",
        "New peers ignored because the peer table held membership.max_peers already.",
    ),
    "peers_buried": (
        "murmur_peers_buried",
        "Members this node found gone: no probe, direct or through others, reached them for ttl_s.",
    ),
    "clock_steps": (
        "murmur_clock_steps",
        "Times this machine's wall clock was seen set (a jump against its monotonic clock): "
        "its clock samples of peers were dropped.",
    ),
    "peer_clock_steps": (
        "murmur_peer_clock_steps",
        "Times a peer's wall clock was seen set (a ping's reading no round trip explains): "
        "that peer's older clock samples were dropped.",
    ),
}
"""``Node.counters`` keys with a family of their own (prefix families are handled apart)."""


@dataclass
class Snapshot:
    """What one scrape exports, copied on the event loop."""

    status: dict[str, Any]
    client: TrafficStats = field(default_factory=TrafficStats)
    server: TrafficStats = field(default_factory=TrafficStats)


def _copy_stats(stats: TrafficStats) -> TrafficStats:
    return TrafficStats(
        sent_bytes=Counter(stats.sent_bytes),
        received_bytes=Counter(stats.received_bytes),
        requests=Counter(stats.requests),
        latency_s={k: replace(h, counts=list(h.counts)) for k, h in stats.latency_s.items()},
    )


class Observed(Protocol):
    """What the collector reads of a node (``node.daemon.Node``, or a test's stand-in)."""

    def status(self) -> dict[str, Any]: ...

    def traffic(self) -> tuple[TrafficStats, TrafficStats]:
        """Client-side and server-side traffic statistics."""
        ...


def take_snapshot(node: Observed) -> Snapshot:
    """Read ``node``; call on its loop."""
    client, server = node.traffic()
    return Snapshot(status=node.status(), client=_copy_stats(client), server=_copy_stats(server))


class NodeCollector(Collector):
    """Exports one node's state; ``loop``: the node's event loop (None: read directly)."""

    def __init__(self, node: Observed, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._node = node
        self._loop = loop

    def describe(self) -> Iterable[Metric]:
        return []  # names are only known at scrape time; registering must not take a snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        st = snap.status
        yield from _node_families(st)
        if st["stage"] >= 0:
            yield from _stage_families(st)
        yield from _counter_families(st["counters"], head=st["stage"] == 0)
        yield from _peer_families(st)
        yield from _reachability_family(st)
        yield from _pacing_families(st)
        if isinstance(st.get("swarm_time"), dict):
            yield from _swarm_time_families(st["swarm_time"])
        if st["stage"] == 0 and "tokens" in st:
            yield from _head_families(st)
        if isinstance(st.get("sync"), dict):
            yield from _sync_families(st["sync"])
        if isinstance(st.get("recovery"), dict):
            yield from _recovery_families(st["recovery"])
        if isinstance(st.get("balance"), dict):
            yield from _balance_families(st["balance"])
        if isinstance(st.get("wire"), dict):
            yield from _wire_families(st["wire"])
        yield from _traffic_families(snap.client, snap.server)

    def _snapshot(self) -> Snapshot:
        loop = self._loop
        if loop is None or _on_loop(loop):
            return take_snapshot(self._node)

        async def on_loop() -> Snapshot:
            return take_snapshot(self._node)

        # blocks only this scrape thread; the loop runs the snapshot between its own callbacks
        return asyncio.run_coroutine_threadsafe(on_loop(), loop).result(SNAPSHOT_TIMEOUT_S)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _gauge(name: str, doc: str, value: float, stage: str | None = None) -> GaugeMetricFamily:
    if stage is None:
        return GaugeMetricFamily(name, doc, value=value)
    g = GaugeMetricFamily(name, doc, labels=["stage"])
    g.add_metric([stage], value)
    return g


def _counter(name: str, doc: str, value: float, stage: str | None = None) -> CounterMetricFamily:
    if stage is None:
        return CounterMetricFamily(name, doc, value=value)
    c = CounterMetricFamily(name, doc, labels=["stage"])
    c.add_metric([stage], value)
    return c


def _outcomes(name: str, doc: str, counts: dict[str, int]) -> CounterMetricFamily:
    """A counter by outcome, ``ok`` shown (at 0) before anything happened."""
    c = CounterMetricFamily(name, doc, labels=["outcome"])
    for outcome, n in {"ok": 0, **counts}.items():
        c.add_metric([outcome], n)
    return c


def _num(value: Any) -> float:
    """A status value as a float; None (not measured yet) becomes NaN."""
    return float("nan") if value is None else float(value)


def _node_families(st: dict[str, Any]) -> Iterator[Metric]:
    info = InfoMetricFamily("murmur_node", "The swarm this node belongs to.")
    info.add_metric([], {"swarm": str(st["swarm"]), "fingerprint": str(st["fingerprint"])})
    yield info
    yield _gauge("murmur_node_stage", "Stage this node serves (-1 while joining).", st["stage"])
    yield _gauge(
        "murmur_node_stages", "Stages of the model (head + block stages).", st["num_stages"]
    )
    yield _gauge("murmur_node_ready", "1 once the node serves its stage.", float(bool(st["ready"])))
    yield _gauge("murmur_node_leaving", "1 while the node shuts down.", float(bool(st["leaving"])))
    yield _gauge("murmur_node_uptime_seconds", "Seconds since the node started.", st["uptime_s"])


def _stage_families(st: dict[str, Any]) -> Iterator[Metric]:
    """The node's own stage: work done, speed, backlog and the thermometers."""
    s = str(st["stage"])
    yield _counter("murmur_inner_steps", "Inner optimizer steps of this replica.", st["step"], s)
    yield _counter("murmur_samples", "Samples this replica has trained on.", st["samples"], s)
    yield _gauge(
        "murmur_throughput_samples_per_second",
        "This replica's measured service rate (samples/s, moving average).",
        st["throughput"],
        s,
    )
    yield _gauge("murmur_queued_jobs", "Compute jobs waiting in this node's queue.", st["queue"], s)
    yield _gauge(
        "murmur_grad_norm", "Latest gradient norm after clipping (thermometer).", st["grad_norm"], s
    )
    yield _gauge(
        "murmur_grad_norm_preclip",
        "Latest gradient norm before clipping (thermometer: a runaway shows here).",
        _num(st.get("grad_norm_preclip", 0.0)),
        s,
    )
    yield _gauge(
        "murmur_gradient_delay_steps",
        "Inner steps between a microbatch's forward and its backward on this replica "
        "(moving average): the pipeline's staleness.",
        _num(st.get("grad_delay_steps", 0.0)),
        s,
    )
    yield _counter(
        "murmur_inner_steps_skipped",
        "Inner steps skipped: their gradient norm spiked or was not finite.",
        st.get("steps_skipped", 0),
        s,
    )
    yield _gauge(
        "murmur_learning_rate",
        "Inner learning rate the next step takes (the schedule at this replica's place).",
        st.get("lr", 0.0),
        s,
    )
    yield _gauge(
        "murmur_lr_scale",
        "Learning-rate multiplier now (CheckFree's boost).",
        st.get("lr_scale", 1.0),
        s,
    )
    logits = GaugeMetricFamily(
        "murmur_attention_logit_max",
        "Largest pre-softmax attention score per block, sampled (thermometer).",
        labels=["stage", "block"],
    )
    for block, value in sorted(st.get("attn_logit_max", {}).items(), key=lambda kv: int(kv[0])):
        logits.add_metric([s, str(block)], _num(value))
    yield logits
    yield _gauge(
        "murmur_activation_max", "Latest maximum output activation (thermometer).", st["act_max"], s
    )
    yield _gauge(
        "murmur_activation_min", "Latest minimum output activation (thermometer).", st["act_min"], s
    )


def _counter_families(counters: dict[str, int], head: bool) -> Iterator[Metric]:
    """``Node.counters``: prefixed keys become one family with a label, the rest their own."""
    mb = CounterMetricFamily(
        "murmur_microbatches",
        "Microbatches issued by this head node that ended as completed, retried or dropped.",
        labels=["outcome"],
    )
    issued = CounterMetricFamily("murmur_microbatches_issued", "Microbatches issued (head nodes).")
    rejected = CounterMetricFamily(
        "murmur_rejected_requests", "Requests this node refused, by error code.", labels=["code"]
    )
    failed = CounterMetricFamily(
        "murmur_send_failures", "Hops a peer did not accept, by error code.", labels=["code"]
    )
    other = CounterMetricFamily("murmur_events", "Other counted events, by name.", labels=["event"])
    poisoned = CounterMetricFamily(
        "murmur_weights_refused",
        "Peer weights refused as poisoned, by source (gossip, recovery) and reason.",
        labels=["source", "reason"],
    )
    named = {key: 0 for key in _NAMED_COUNTERS}
    head = head or any(k.startswith("microbatches_") for k in counters)
    outcomes = dict.fromkeys(("completed", "retried", "dropped"), 0) if head else {}
    for key, value in sorted(counters.items()):
        if key == "microbatches_issued":
            continue
        if key.startswith("microbatches_"):
            outcomes[key.removeprefix("microbatches_")] = value
        elif key.startswith("rejected_"):
            rejected.add_metric([key.removeprefix("rejected_")], value)
        elif key.startswith("send_failed_"):
            failed.add_metric([key.removeprefix("send_failed_")], value)
        elif key.startswith("weights_refused:"):
            _, source, reason = (key.split(":") + ["", ""])[:3]
            poisoned.add_metric([source, reason], value)
        elif key in named:
            named[key] = value
        else:
            other.add_metric([key], value)
    for outcome, value in outcomes.items():
        mb.add_metric([outcome], value)
    if head:
        issued.add_metric([], counters.get("microbatches_issued", 0))
        yield issued
    yield from (mb, rejected, failed, other, poisoned)
    for key, value in named.items():
        name, doc = _NAMED_COUNTERS[key]
        yield _counter(name, doc, value)


def _swarm_time_families(swarm_time: dict[str, Any]) -> Iterator[Metric]:
    """A keyed swarm's proof clock (``node.net.swarmtime``)."""
    yield _gauge(
        "murmur_proof_clock_offset_seconds",
        "Seconds added to this machine's clock when it stamps and checks proofs: the time "
        "most swarm members seal, where this clock disagrees with them (0 when it agrees).",
        swarm_time["offset_s"],
    )
    yield _counter(
        "murmur_proof_clock_corrections",
        "Times the proofs' clock offset changed by a second or more.",
        swarm_time["corrections"],
    )


def _pacing_families(st: dict[str, Any]) -> Iterator[Metric]:
    """The node's own pacing of its uploads (``node.net.pacing``), where it paces."""
    pacing = (st.get("tcp_congestion") or {}).get("pacing")
    if not isinstance(pacing, dict):
        return
    yield GaugeMetricFamily(
        "murmur_uplink_pace_bytes_per_second",
        "The pace this node's uploads are held to (0: not paced now).",
        value=pacing["pace_bytes_per_s"] or 0.0,
    )
    yield GaugeMetricFamily(
        "murmur_uplink_capacity_bytes_per_second",
        "The uplink's capacity as the node measured it while uploading (0: not measured).",
        value=pacing["capacity_bytes_per_s"],
    )
    yield GaugeMetricFamily(
        "murmur_uplink_queueing_seconds",
        "The queueing delay the node's last upload met (least over its connections).",
        value=pacing["queueing_ms"] / 1e3,
    )


def _reachability_family(st: dict[str, Any]) -> Iterator[Metric]:
    """Whether peers can dial this node (1 for its current state)."""
    reach = st.get("reachability")
    if not isinstance(reach, dict):
        return
    family = GaugeMetricFamily(
        "murmur_reachability",
        "1 for this node's reachability as peers found it: direct, relayed, unreachable or "
        "unknown.",
        labels=["state"],
    )
    for state in REACHABILITY_STATES:
        family.add_metric([state], float(reach.get("state") == state))
    yield family
    relay = st.get("relay")
    if not isinstance(relay, dict):
        return
    yield GaugeMetricFamily(
        "murmur_relays_used",
        "Relays this node, which peers cannot dial, is attached to (0: dialled directly).",
        value=len(relay.get("via", [])),
    )
    yield GaugeMetricFamily(
        "murmur_relay_nodes",
        "Nodes that cannot be dialled this node relays for now.",
        value=len(relay.get("nodes", [])),
    )
    yield GaugeMetricFamily(
        "murmur_relay_capacity",
        "Nodes this node may relay for (net.relay_capacity; 0 while it is relayed itself).",
        value=relay.get("capacity", 0),
    )
    moved = CounterMetricFamily(
        "murmur_relay_bytes",
        "Frame bytes this node relayed, to the relayed nodes (requests) and from them.",
        labels=["direction"],
    )
    for direction in ("to_node", "from_node"):
        moved.add_metric([direction], relay.get("bytes", {}).get(direction, 0))
    yield moved
    yield _outcomes(
        "murmur_relay_requests",
        "Requests this node relayed, by outcome: ok or the refusal's code (relay_gone, "
        "relay_busy, timeout, auth_*).",
        relay.get("requests", {}),
    )
    yield _outcomes(
        "murmur_relay_attaches",
        "Nodes that attached to this relay (ok; more than it relays for: their links drop "
        "and they come back), or were refused, by code (relay_busy, auth_*).",
        relay.get("attaches", {}),
    )


def _peer_families(st: dict[str, Any]) -> Iterator[Metric]:
    """This node's view of the swarm, per stage: peers known, live replicas, capacity."""
    known = GaugeMetricFamily(
        "murmur_peers_known",
        "Peers in this node's table, by their stage (-1: still joining).",
        labels=["stage"],
    )
    replicas = GaugeMetricFamily(
        "murmur_stage_replicas",
        "Ready replicas of each stage as this node sees them (itself included).",
        labels=["stage"],
    )
    rate = GaugeMetricFamily(
        "murmur_stage_throughput_samples_per_second",
        "Sum of the published service rates of each stage's replicas (itself included).",
        labels=["stage"],
    )
    own = st["stage"]
    own_ready = bool(st["ready"]) and not st["leaving"]
    for key, peers in sorted(st["peers"].items(), key=lambda kv: int(kv[0])):
        mine = int(key) == own
        known.add_metric([key], len(peers))
        if int(key) < 0:
            continue  # peers still joining (stage -1) are no stage's replicas
        replicas.add_metric([key], sum(bool(p["ready"]) for p in peers) + (mine and own_ready))
        total = sum(float(p["throughput"]) for p in peers) + (st["throughput"] if mine else 0.0)
        rate.add_metric([key], total)
    yield from (known, replicas, rate)


def _head_families(st: dict[str, Any]) -> Iterator[Metric]:
    """Head-stage nodes: the loss, evaluation and the pipeline as the head drives it."""
    if st.get("loss") is not None:
        yield _gauge("murmur_loss", "Latest training loss (head nodes).", _num(st["loss"]))
    if st.get("loss_ema") is not None:
        yield _gauge("murmur_loss_ema", "Training loss, moving average.", _num(st["loss_ema"]))
    if st.get("eval_loss") is not None:
        yield _gauge("murmur_eval_loss", "Latest held-out loss.", _num(st["eval_loss"]))
    yield _counter("murmur_evals", "Evaluations run on the held-out split.", len(st["evals"]))
    yield _counter("murmur_tokens", "Tokens whose loss this head node computed.", st["tokens"])
    yield _gauge(
        "murmur_tokens_per_second",
        "Training tokens per second (recent window).",
        st["tokens_per_s"],
    )
    yield _counter(
        "murmur_train_seconds", "Seconds since this head started training.", st["train_s"]
    )
    yield _gauge(
        "murmur_in_flight_microbatches", "Microbatches in the pipeline now.", st["in_flight"]
    )
    yield _gauge(
        "murmur_pipeline_complete",
        "1 while every stage has a ready replica.",
        float(bool(st["pipeline_complete"])),
    )
    window = st.get("window")
    if isinstance(window, dict):
        yield _gauge(
            "murmur_in_flight_window",
            "Microbatches the head may keep in flight now (train.max_in_flight, or the "
            "adaptive window).",
            window.get("size", 0),
        )
        trip = GaugeMetricFamily(
            "murmur_round_trip_seconds",
            "A microbatch's round trip, head to head: base (the smallest lately, nothing "
            "queued) and mean (over the adaptive window's last adjustment).",
            labels=["kind"],
        )
        for kind, key in (("base", "base_rtt_ms"), ("mean", "rtt_ms")):
            ms = window.get(key)
            if ms is not None:
                trip.add_metric([kind], ms / 1e3)
        yield trip


def _sync_families(sync: dict[str, Any]) -> Iterator[Metric]:
    """The outer synchronisation of replicas (NoLoCo gossip, DiLoCo or all-reduce)."""
    info = InfoMetricFamily("murmur_sync", "How replicas of a stage synchronise.")
    info.add_metric([], {"method": str(sync.get("method", "none"))})
    yield info
    yield _counter("murmur_outer_steps", "Outer steps taken.", sync.get("outer_steps", 0))
    rounds = CounterMetricFamily(
        "murmur_sync_rounds", "Outer-step exchanges by outcome.", labels=["outcome"]
    )
    for outcome, n in sorted(sync.get("rounds", {}).items()):
        rounds.add_metric([outcome], n)
    yield rounds
    yield _summary(
        "murmur_sync_duration_seconds",
        "Time spent in outer-step exchanges.",
        sync.get("seconds_count", 0),
        sync.get("seconds_sum", 0.0),
    )
    moved = CounterMetricFamily(
        "murmur_sync_bytes", "Bytes of outer-step exchanges.", labels=["direction"]
    )
    moved.add_metric(["sent"], sync.get("bytes_sent", 0))
    moved.add_metric(["received"], sync.get("bytes_received", 0))
    yield moved
    yield _counter(
        "murmur_sync_promises_lapsed",
        "NoLoCo proposals accepted whose contribution never came (the proposer died or "
        "misbehaves; its proposals are refused for the rest of the round).",
        sync.get("promises_lapsed", 0),
    )
    yield _counter(
        "murmur_sync_followers_answered",
        "Replicas that followed this one in a NoLoCo round: each was sent this replica's "
        "contribution to the round and sent none back (it spans rounds; sync.follow).",
        sync.get("followers_answered", 0),
    )
    yield _counter(
        "murmur_sync_places_clamped",
        "Outer steps (a NoLoCo pair, or a DiLoCo ring sharing places) whose mean place in "
        "the learning-rate schedule lay more than half PLACE_ROUNDS rounds' steps from ours: "
        "moved only that far.",
        sync.get("places_clamped", 0),
    )
    yield _counter(
        "murmur_sync_clock_restarts",
        "Times outer rounds restarted from a stage clock that stayed set back (a replica's "
        "wall clock was set back; with two replicas each moves halfway).",
        sync.get("clock_restarts", 0),
    )
    if "in_progress" in sync:
        yield _gauge(
            "murmur_sync_in_progress",
            "1 while an outer-step exchange runs.",
            float(bool(sync["in_progress"])),
        )
    if "clock_offset_s" in sync:
        yield _gauge(
            "murmur_clock_offset_seconds",
            "The stage's clock (the median of its replicas') minus this machine's wall clock, "
            "as measured on membership pings; outer rounds follow the stage's clock.",
            _num(sync["clock_offset_s"]),
        )
    if "uplink_too_thin" in sync:
        yield _gauge(
            "murmur_sync_uplink_too_thin",
            "1 when this replica's last NoLoCo contribution takes longer to upload, at the rate "
            "its hops leave it, than a partner waits for it, or its exchange longer than "
            f"{MAX_ROUND_MULTIPLE} of the stage's rounds: its rounds end solo.",
            1.0 if sync["uplink_too_thin"] else 0.0,
        )
    if "round_multiple" in sync:
        yield _gauge(
            "murmur_sync_round_multiple",
            "How many of the stage's clock rounds one of this replica's NoLoCo rounds spans: "
            "more than 1 where its exchange outlasts the stage's round (it exchanges in every "
            "such round it takes, and follows a partner in those between: sync.follow).",
            float(sync["round_multiple"]),
        )
    if sync.get("spread_rms") is not None:
        yield _gauge(
            "murmur_replica_spread_rms",
            "RMS distance of this replica's slow weights to its last partner's.",
            _num(sync["spread_rms"]),
        )


def _wire_families(wire: dict[str, Any]) -> Iterator[Metric]:
    """The codec activations and gradients leave in, and the link rate it was chosen by."""
    info = InfoMetricFamily("murmur_wire", "Codec of this node's activations and gradients.")
    info.add_metric([], {"codec": str(wire["codec"]), "auto": str(bool(wire["auto"])).lower()})
    yield info
    if wire.get("link_mbps") is not None:
        yield _gauge(
            "murmur_wire_link_bytes_per_second",
            "Rate this node's microbatch payloads arrive at, as its receivers time them "
            "(moving average).",
            wire["link_mbps"] * 1e6 / 8,
        )
    if wire.get("send_s") is not None:
        yield _gauge(
            "murmur_wire_send_seconds",
            "Seconds one of this node's activation or gradient tensors takes to send at that rate.",
            wire["send_s"],
        )
    yield _gauge(
        "murmur_wire_uplink_too_thin",
        "1 when a tensor takes over half a hop's deadline to send: two in flight miss it.",
        1.0 if wire.get("too_thin") else 0.0,
    )
    yield _gauge(
        "murmur_wire_uplink_waiting",
        "Uploads waiting for their turn on this node's uplink (a long one goes alone).",
        float(wire.get("uplink_waiting", 0)),
    )
    yield _counter(
        "murmur_wire_codec_switches",
        "Times train.wire_codec = auto changed this node's codec.",
        wire["switches"],
    )


def _balance_families(bal: dict[str, Any]) -> Iterator[Metric]:
    yield _counter(
        "murmur_balance_moves", "Stage changes this node made to rebalance.", bal["moves"]
    )
    yield _counter(
        "murmur_balance_yields",
        "Moves planned for this node that it gave up: another replica moved first.",
        bal["yielded"],
    )
    answers = CounterMetricFamily(
        "murmur_balance_answers",
        "Other replicas' requests to leave or join this node's stage, by its answer.",
        labels=["answer"],
    )
    for answer, n in bal["answers"].items():
        answers.add_metric([answer], n)
    yield answers
    yield _gauge(
        "murmur_balance_own_block_rate",
        "This node's start-up benchmark: samples/s through one block stage.",
        bal["own_block_rate"],
    )


def _recovery_families(rec: dict[str, Any]) -> Iterator[Metric]:
    done = CounterMetricFamily(
        "murmur_recoveries", "Recoveries of lost stages, by kind.", labels=["kind"]
    )
    for kind, n in sorted(rec.get("recoveries", {}).items()):
        done.add_metric([kind], n)
    yield done
    yield _summary(
        "murmur_recovery_duration_seconds",
        "Seconds from a stage being seen empty to this node serving it again, per recovery.",
        rec.get("seconds_count", 0),
        rec.get("seconds_sum", 0.0),
    )
    sources = GaugeMetricFamily(
        "murmur_recovery_source_weight",
        "The last rebuild's source stages and their weights in the average (CheckFree).",
        labels=["source_stage"],
    )
    for src in (rec.get("last") or {}).get("sources", []):
        sources.add_metric([str(src["stage"])], float(src["weight"]))
    yield sources
    yield GaugeMetricFamily(
        "murmur_stages_empty",
        "Stages this node currently sees with no live replica.",
        value=len(rec.get("empty_stages", [])),
    )


def _summary(name: str, doc: str, count: int, total: float) -> SummaryMetricFamily:
    return SummaryMetricFamily(name, doc, count_value=count, sum_value=total)


def _traffic_families(client: TrafficStats, server: TrafficStats) -> Iterator[Metric]:
    """Bytes on the wire by message kind (both sides), requests and their latency (client)."""
    moved = CounterMetricFamily(
        "murmur_wire_bytes",
        "Frame bytes sent and received, by message kind (requests and replies).",
        labels=["direction", "kind"],
    )
    for direction, counts in (
        ("sent", client.sent_bytes + server.sent_bytes),
        ("received", client.received_bytes + server.received_bytes),
    ):
        for kind, n in sorted(counts.items()):
            moved.add_metric([direction, kind], n)
    yield moved
    requests = CounterMetricFamily(
        "murmur_requests",
        "Requests this node sent, by kind and outcome (ok or the error code).",
        labels=["kind", "outcome"],
    )
    for (kind, outcome), n in sorted(client.requests.items()):
        requests.add_metric([kind, outcome], n)
    yield requests
    latency = HistogramMetricFamily(
        "murmur_request_duration_seconds",
        "Seconds from sending a request to its reply, by request kind.",
        labels=["kind"],
    )
    for kind, h in sorted(client.latency_s.items()):
        buckets = [(floatToGoString(b), float(n)) for b, n in h.cumulative()]
        latency.add_metric([kind], buckets, sum_value=h.sum)
    yield latency


class MetricsServer:
    """The running endpoint: prometheus_client's HTTP server on a daemon thread."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    def close(self) -> None:
        """Stop serving (blocks up to the server's 0.5 s poll interval)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=2.0)


def start_metrics_server(node: Observed, host: str, port: int) -> MetricsServer:
    """Serve ``node``'s metrics on ``host:port`` (0: a free port, see ``.port``)."""
    try:
        loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(node, loop))
    ProcessCollector(registry=registry)
    server, thread = start_http_server(port, host, registry)
    metrics = MetricsServer(server, thread)
    log.info("metrics on http://%s:%d/metrics", host, metrics.port)
    return metrics
