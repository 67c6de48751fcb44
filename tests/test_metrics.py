"""Unit tests of ``node.metrics`` and the transport's traffic statistics.

The collector runs on a node state built here (every field ``Node.status()`` has, plus the
``sync`` and ``recovery`` sections), so each family's name, type, labels and values are
checked without a daemon; the endpoint and the transport statistics run for real on
127.0.0.1.
"""

from __future__ import annotations

import asyncio
import math
import socket
import threading
import urllib.request
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from node.display import format_status
from node.metrics import NodeCollector, start_metrics_server
from node.net.transport import (
    Histogram,
    HttpTransport,
    TrafficStats,
    frame_response,
    read_frame,
    server_stats,
)
from protocol.frames import Limits
from protocol.messages import Ack, Error, Leave
from swarm.seams import TransportError
from tests.helpers import rpc_app

pytestmark = pytest.mark.timeout(60)

PEER_IDS = ["a1b2c3d4e5f60718", "0badc0ffee123456", "feedfacecafebeef", "1234567890abcdef"]

# family (as the text format names it) -> (type, label names)
EXPECTED: dict[str, tuple[str, set[str]]] = {
    "murmur_node_info": ("gauge", {"swarm", "fingerprint"}),  # info: a gauge in text
    "murmur_node_stage": ("gauge", set()),
    "murmur_node_stages": ("gauge", set()),
    "murmur_node_ready": ("gauge", set()),
    "murmur_node_leaving": ("gauge", set()),
    "murmur_node_uptime_seconds": ("gauge", set()),
    "murmur_inner_steps": ("counter", {"stage"}),
    "murmur_samples": ("counter", {"stage"}),
    "murmur_throughput_samples_per_second": ("gauge", {"stage"}),
    "murmur_queued_jobs": ("gauge", {"stage"}),
    "murmur_grad_norm": ("gauge", {"stage"}),
    "murmur_activation_max": ("gauge", {"stage"}),
    "murmur_activation_min": ("gauge", {"stage"}),
    "murmur_microbatches_issued": ("counter", set()),
    "murmur_microbatches": ("counter", {"outcome"}),
    "murmur_rejected_requests": ("counter", {"code"}),
    "murmur_send_failures": ("counter", {"code"}),
    "murmur_events": ("counter", {"event"}),
    "murmur_hop_retries": ("counter", set()),
    "murmur_hops_dropped": ("counter", set()),
    "murmur_activations_expired": ("counter", set()),
    "murmur_job_errors": ("counter", set()),
    "murmur_send_errors": ("counter", set()),
    "murmur_non_finite_loss": ("counter", set()),
    "murmur_loop_stalls": ("counter", set()),
    "murmur_loss_spikes_skipped": ("counter", set()),
    "murmur_grad_norm_preclip": ("gauge", {"stage"}),
    "murmur_inner_steps_skipped": ("counter", {"stage"}),
    "murmur_gradient_delay_steps": ("gauge", {"stage"}),
    "murmur_lr_scale": ("gauge", {"stage"}),
    "murmur_learning_rate": ("gauge", {"stage"}),
    "murmur_attention_logit_max": ("gauge", {"stage", "block"}),
    "murmur_stages_seen_empty": ("counter", set()),
    "murmur_route_left_out": ("counter", set()),
    "murmur_peers_banned": ("counter", set()),
    "murmur_peers_refused_table_full": ("counter", set()),
    "murmur_peers_buried": ("counter", set()),
    "murmur_clock_steps": ("counter", set()),
    "murmur_peer_clock_steps": ("counter", set()),
    "murmur_proof_clock_offset_seconds": ("gauge", set()),
    "murmur_proof_clock_corrections": ("counter", set()),
    "murmur_weights_refused": ("counter", {"source", "reason"}),
    "murmur_peers_known": ("gauge", {"stage"}),
    "murmur_reachability": ("gauge", {"state"}),
    "murmur_relays_used": ("gauge", set()),
    "murmur_uplink_pace_bytes_per_second": ("gauge", set()),
    "murmur_uplink_capacity_bytes_per_second": ("gauge", set()),
    "murmur_uplink_queueing_seconds": ("gauge", set()),
    "murmur_relay_nodes": ("gauge", set()),
    "murmur_relay_capacity": ("gauge", set()),
    "murmur_relay_bytes": ("counter", {"direction"}),
    "murmur_relay_requests": ("counter", {"outcome"}),
    "murmur_relay_attaches": ("counter", {"outcome"}),
    "murmur_stage_replicas": ("gauge", {"stage"}),
    "murmur_stage_throughput_samples_per_second": ("gauge", {"stage"}),
    "murmur_loss": ("gauge", set()),
    "murmur_loss_ema": ("gauge", set()),
    "murmur_eval_loss": ("gauge", set()),
    "murmur_evals": ("counter", set()),
    "murmur_tokens": ("counter", set()),
    "murmur_tokens_per_second": ("gauge", set()),
    "murmur_train_seconds": ("counter", set()),
    "murmur_in_flight_microbatches": ("gauge", set()),
    "murmur_pipeline_complete": ("gauge", set()),
    "murmur_in_flight_window": ("gauge", set()),
    "murmur_round_trip_seconds": ("gauge", {"kind"}),
    "murmur_wire_info": ("gauge", {"codec", "auto"}),
    "murmur_wire_link_bytes_per_second": ("gauge", set()),
    "murmur_wire_codec_switches": ("counter", set()),
    "murmur_wire_send_seconds": ("gauge", set()),
    "murmur_wire_uplink_too_thin": ("gauge", set()),
    "murmur_wire_uplink_waiting": ("gauge", set()),
    "murmur_sync_info": ("gauge", {"method"}),
    "murmur_outer_steps": ("counter", set()),
    "murmur_sync_rounds": ("counter", {"outcome"}),
    "murmur_sync_duration_seconds": ("summary", set()),
    "murmur_sync_bytes": ("counter", {"direction"}),
    "murmur_sync_in_progress": ("gauge", set()),
    "murmur_sync_promises_lapsed": ("counter", set()),
    "murmur_sync_followers_answered": ("counter", set()),
    "murmur_sync_places_clamped": ("counter", set()),
    "murmur_sync_clock_restarts": ("counter", set()),
    "murmur_sync_uplink_too_thin": ("gauge", set()),
    "murmur_sync_round_multiple": ("gauge", set()),
    "murmur_replica_spread_rms": ("gauge", set()),
    "murmur_clock_offset_seconds": ("gauge", set()),
    "murmur_recoveries": ("counter", {"kind"}),
    "murmur_recovery_duration_seconds": ("summary", set()),
    "murmur_recovery_source_weight": ("gauge", {"source_stage"}),
    "murmur_stages_empty": ("gauge", set()),
    "murmur_balance_moves": ("counter", set()),
    "murmur_balance_yields": ("counter", set()),
    "murmur_balance_answers": ("counter", {"answer"}),
    "murmur_balance_own_block_rate": ("gauge", set()),
    "murmur_wire_bytes": ("counter", {"direction", "kind"}),
    "murmur_requests": ("counter", {"kind", "outcome"}),
    "murmur_request_duration_seconds": ("histogram", {"kind"}),
}


def peer(i: int, stage: int, throughput: float, ready: bool = True) -> dict[str, Any]:
    return {
        "peer_id": PEER_IDS[i],
        "address": f"10.0.0.{i + 2}:7070",
        "step": 40,
        "throughput": throughput,
        "queue": 1,
        "ready": ready,
        "age_s": 0.4,
    }


def head_status(**changes: Any) -> dict[str, Any]:
    """What ``Node.status()`` of a head node returns, with ``sync`` and ``recovery``."""
    st: dict[str, Any] = {
        "peer_id": "9999999999999999",
        "address": "10.0.0.1:7070",
        "swarm": "murmuration",
        "fingerprint": "8e2d0d49e2173d63",
        "stage": 0,
        "num_stages": 3,
        "ready": True,
        "leaving": False,
        "uptime_s": 120.5,
        "step": 42,
        "samples": 1344,
        "throughput": 55.5,
        "queue": 2,
        "grad_norm": 0.75,
        "act_max": 7.5,
        "act_min": -6.25,
        "grad_norm_preclip": 3.5,
        "reachability": {"state": "direct", "detail": "dialled back by 2 peer(s)"},
        "tcp_congestion": {
            "wanted": "bbr",
            "active": False,
            "why": "Operation not permitted",
            "in_use": "cubic",
            "pacing": {
                "pacing": True,
                "pace_bytes_per_s": 1.1e6,
                "capacity_bytes_per_s": 1.25e6,
                "queueing_ms": 27.5,
                "sockets": 3,
            },
        },
        "relay": {
            "via": [],
            "served": {},
            "capacity": 8,
            "nodes": ["ab" * 16, "cd" * 16],
            "bytes": {"to_node": 4096, "from_node": 512},
            "requests": {"ok": 30, "relay_busy": 2},
            "attaches": {"ok": 3, "relay_busy": 1},
        },
        "attn_logit_max": {"0": 11.5, "1": 12.25},
        "steps_skipped": 2,
        "grad_delay_steps": 2.25,
        "lr_scale": 1.1,
        "lr": 0.00125,
        "schedule_step": 40.5,
        "counters": {
            "microbatches_issued": 100,
            "microbatches_completed": 90,
            "microbatches_retried": 6,
            "rejected_busy": 3,
            "rejected_bad_magic": 1,
            "send_failed_timeout": 2,
            "hop_retries": 4,
            "brand_new_counter": 7,
            "weights_refused:gossip:too_far": 2,
            "peers_banned": 1,
            "peer_clock_steps": 2,
            "loop_stalls": 3,
        },
        "loop": {"stalls": 3, "longest_s": 6.2},
        "peers": {
            "0": [],
            "1": [peer(0, 1, 30.0), peer(1, 1, 20.0, ready=False)],
            "2": [peer(2, 2, 45.0), peer(3, 2, 5.0)],
        },
        "loss": 2.5,
        "loss_ema": 2.75,
        "eval_loss": 2.625,
        "evals": [
            {"step": 0, "elapsed_s": 0.0, "loss": 5.5},
            {"step": 40, "elapsed_s": 60.0, "loss": 2.625},
        ],
        "tokens": 172032,
        "tokens_per_s": 1433.6,
        "train_s": 118.0,
        "in_flight": 5,
        "pipeline_complete": True,
        "window": {"policy": "adaptive", "size": 7, "base_rtt_ms": 120.0, "rtt_ms": 150.5},
        "wire": {
            "codec": "int8",
            "auto": True,
            "link_mbps": 18.4,
            "switches": 3,
            "send_s": 0.1,
            "too_thin": False,
            "uplink_waiting": 2,
        },
        "swarm_time": {"offset_s": -7200.0, "members_measured": 3, "corrections": 1},
        "sync": {
            "method": "noloco",
            "outer_steps": 3,
            "rounds": {"paired": 2, "solo": 1, "failed": 0},
            "seconds_sum": 1.5,
            "seconds_count": 3,
            "bytes_sent": 1_000_000,
            "bytes_received": 999_000,
            "spread_rms": 0.0125,
            "clock_offset_s": -12.5,
            "last_partner": PEER_IDS[0],
            "in_progress": False,
            "contribution_send_s": 14.2,
            "contribution_given_s": 11.9,
            "uplink_too_thin": True,
            "round_multiple": 1,
        },
        "recovery": {
            "recoveries": {"checkfree": 1},
            "seconds_sum": 4.0,
            "seconds_count": 1,
            "last": {
                "stage": 2,
                "kind": "checkfree",
                "sources": [{"stage": 1, "weight": 0.25}, {"stage": 3, "weight": 0.75}],
            },
            "empty_stages": [],
        },
        "balance": {
            "policy": "throughput",
            "own_block_rate": 812.5,
            "movable": False,
            "moves": 2,
            "yielded": 1,
            "answers": {"granted": 3, "refused": 1},
            "last_move_age_s": 30.0,
            "plan": None,
        },
    }
    st.update(changes)
    return st


def traffic() -> TrafficStats:
    stats = TrafficStats()
    stats.sent_bytes.update({"forward": 5000, "hello": 300})
    stats.received_bytes.update({"ack": 80, "welcome": 400})
    for seconds in (0.002, 0.02, 0.2, 20.0):
        stats.observe_request("forward", "ok", seconds)
    stats.observe_request("hello", "timeout", 3.0)
    return stats


class FakeNode:
    """Shaped like ``node.daemon.Node`` as far as the collector reads it."""

    def __init__(self, status: dict[str, Any], stats: TrafficStats | None = None) -> None:
        self._status = status
        self.stats = stats or TrafficStats()
        self.status_threads: list[int] = []

    def status(self) -> dict[str, Any]:
        self.status_threads.append(threading.get_ident())
        return self._status

    def traffic(self) -> tuple[TrafficStats, TrafficStats]:
        return self.stats, TrafficStats()


def scrape(node: Any) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(node))
    return generate_latest(registry).decode()


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def exported_names(node: Any) -> set[str]:
    """Every sample name (``_total``, ``_bucket``... included) the collector exports."""
    return {s.name for f in text_string_to_metric_families(scrape(node)) for s in f.samples}


def full_node() -> FakeNode:
    return FakeNode(head_status(), traffic())


def test_every_family_has_its_type_and_labels() -> None:
    got = families(scrape(full_node()))
    assert set(got) == set(EXPECTED)
    for name, (kind, labels) in EXPECTED.items():
        family = got[name]
        assert family.type == kind, name
        seen: set[str] = set()
        for s in family.samples:
            seen |= set(s.labels) - {"le", "quantile"}
        assert seen == labels, name
        assert family.samples, f"{name} has no samples"


def test_values_come_from_the_node_state() -> None:
    text = scrape(full_node())
    one = lambda name, **labels: samples(text, name)[tuple(sorted(labels.items()))]  # noqa: E731
    assert one("murmur_loss") == 2.5 and one("murmur_eval_loss") == 2.625
    assert one("murmur_tokens_total") == 172032
    assert one("murmur_inner_steps_total", stage="0") == 42
    assert one("murmur_activation_max", stage="0") == 7.5
    assert one("murmur_activation_min", stage="0") == -6.25
    assert one("murmur_grad_norm", stage="0") == 0.75
    assert one("murmur_grad_norm_preclip", stage="0") == 3.5
    assert one("murmur_attention_logit_max", stage="0", block="1") == 12.25
    assert one("murmur_inner_steps_skipped_total", stage="0") == 2
    assert one("murmur_gradient_delay_steps", stage="0") == 2.25
    assert one("murmur_lr_scale", stage="0") == 1.1
    assert one("murmur_learning_rate", stage="0") == 0.00125
    assert one("murmur_reachability", state="direct") == 1.0
    assert one("murmur_reachability", state="unreachable") == 0.0
    assert one("murmur_reachability", state="relayed") == 0.0
    assert one("murmur_relays_used") == 0 and one("murmur_relay_nodes") == 2
    assert one("murmur_relay_capacity") == 8
    assert one("murmur_uplink_pace_bytes_per_second") == 1.1e6
    assert one("murmur_uplink_capacity_bytes_per_second") == 1.25e6
    assert one("murmur_uplink_queueing_seconds") == 0.0275
    assert one("murmur_in_flight_window") == 7
    assert one("murmur_wire_link_bytes_per_second") == 18.4e6 / 8
    assert one("murmur_wire_codec_switches_total") == 3
    assert one("murmur_wire_uplink_waiting") == 2
    assert one("murmur_wire_info", codec="int8", auto="true") == 1.0
    assert one("murmur_round_trip_seconds", kind="base") == 0.12
    assert one("murmur_round_trip_seconds", kind="mean") == 0.1505
    assert one("murmur_relay_bytes_total", direction="to_node") == 4096
    assert one("murmur_relay_requests_total", outcome="relay_busy") == 2
    assert one("murmur_relay_attaches_total", outcome="ok") == 3
    assert one("murmur_microbatches_total", outcome="completed") == 90
    assert one("murmur_microbatches_total", outcome="dropped") == 0  # known outcome, zero
    assert one("murmur_microbatches_issued_total") == 100
    assert one("murmur_rejected_requests_total", code="busy") == 3
    assert one("murmur_send_failures_total", code="timeout") == 2
    assert one("murmur_events_total", event="brand_new_counter") == 7
    assert one("murmur_weights_refused_total", source="gossip", reason="too_far") == 2
    assert one("murmur_peers_banned_total") == 1
    assert one("murmur_peer_clock_steps_total") == 2
    assert one("murmur_proof_clock_offset_seconds") == -7200.0
    assert one("murmur_proof_clock_corrections_total") == 1
    assert one("murmur_clock_steps_total") == 0  # named: exported at zero
    assert one("murmur_hops_dropped_total") == 0
    # per stage: peers in the table; ready replicas and capacity count this node in
    assert one("murmur_peers_known", stage="1") == 2
    assert one("murmur_stage_replicas", stage="0") == 1
    assert one("murmur_stage_replicas", stage="1") == 1
    assert one("murmur_stage_replicas", stage="2") == 2
    assert one("murmur_stage_throughput_samples_per_second", stage="0") == 55.5
    assert one("murmur_stage_throughput_samples_per_second", stage="2") == 50.0
    assert one("murmur_sync_rounds_total", outcome="paired") == 2
    assert one("murmur_sync_bytes_total", direction="received") == 999_000
    assert one("murmur_sync_duration_seconds_count") == 3
    assert one("murmur_replica_spread_rms") == 0.0125
    assert one("murmur_clock_offset_seconds") == -12.5
    assert one("murmur_sync_uplink_too_thin") == 1
    assert one("murmur_sync_round_multiple") == 1
    assert one("murmur_recoveries_total", kind="checkfree") == 1
    assert one("murmur_recovery_duration_seconds_sum") == 4.0
    assert one("murmur_recovery_source_weight", source_stage="3") == 0.75
    assert one("murmur_stages_empty") == 0
    assert one("murmur_wire_bytes_total", direction="sent", kind="forward") == 5000
    assert one("murmur_requests_total", kind="hello", outcome="timeout") == 1


def test_latency_histogram_is_cumulative_and_complete() -> None:
    buckets = samples(scrape(full_node()), "murmur_request_duration_seconds_bucket")
    forward = sorted(
        (float(dict(k)["le"]), v) for k, v in buckets.items() if dict(k)["kind"] == "forward"
    )
    counts = [v for _, v in forward]
    assert counts == sorted(counts) and forward[-1] == (math.inf, 4.0)
    assert dict(forward)[0.0025] == 1 and dict(forward)[0.25] == 3 and dict(forward)[10.0] == 3
    h = Histogram()
    for v in (0.0005, 0.001, 11.0):
        h.observe(v)
    assert h.cumulative()[0] == (0.001, 2) and h.cumulative()[-1] == (math.inf, 3)
    assert h.sum == pytest.approx(11.0015)


def test_no_peer_id_or_address_in_any_label() -> None:
    st = head_status()
    secrets = {st["peer_id"], st["address"], *PEER_IDS}
    secrets |= {p["address"] for ps in st["peers"].values() for p in ps}
    secrets |= {s.split(":")[0] for s in list(secrets) if ":" in s}
    for family in text_string_to_metric_families(scrape(full_node())):
        for s in family.samples:
            for key, value in s.labels.items():
                assert key not in ("peer", "peer_id", "address", "instance_id"), s
                assert not any(x in value for x in secrets), s


def test_a_joining_node_exports_no_stage_series() -> None:
    st = head_status(stage=-1, ready=False, counters={}, peers={"0": [], "1": [], "2": []})
    for key in ("loss", "loss_ema", "eval_loss", "evals", "tokens", "sync", "recovery"):
        st.pop(key)
    got = families(scrape(FakeNode(st)))
    assert "murmur_grad_norm" not in got and "murmur_loss" not in got
    assert "murmur_sync_info" not in got and "murmur_recoveries" not in got
    assert "murmur_microbatches" not in got or not got["murmur_microbatches"].samples
    assert got["murmur_node_stage"].samples[0].value == -1
    assert {s.value for s in got["murmur_stage_replicas"].samples} == {0}


def test_joining_peers_are_known_but_no_stage_of_their_own() -> None:
    st = head_status()
    st["peers"]["-1"] = [peer(3, -1, 0.0, ready=False)]
    text = scrape(FakeNode(st))
    assert samples(text, "murmur_peers_known")[(("stage", "-1"),)] == 1
    assert (("stage", "-1"),) not in samples(text, "murmur_stage_replicas")
    assert (("stage", "-1"),) not in samples(text, "murmur_stage_throughput_samples_per_second")


def test_nan_loss_is_exported_as_nan_and_missing_eval_is_absent() -> None:
    text = scrape(FakeNode(head_status(loss=float("nan"), eval_loss=None)))
    assert math.isnan(samples(text, "murmur_loss")[()])
    assert "murmur_eval_loss" not in families(text)


def test_block_stage_node_has_no_head_families() -> None:
    st = head_status(stage=2, counters={"rejected_busy": 1})
    for key in ("loss", "loss_ema", "eval_loss", "evals", "tokens", "tokens_per_s"):
        st.pop(key)
    got = families(scrape(FakeNode(st)))
    assert "murmur_tokens" not in got and "murmur_microbatches_issued" not in got
    assert got["murmur_grad_norm"].samples[0].labels == {"stage": "2"}


@pytest.fixture
async def rpc_server() -> Any:
    async def handle(request: web.Request) -> web.Response:
        msg = await read_frame(request, Limits())
        if isinstance(msg, Leave) and msg.peer_id == "refuse":
            return frame_response(Error(code="busy", message="full"), status=503)
        return frame_response(Ack())

    async with rpc_app(handle) as served:
        yield served


async def test_transport_counts_bytes_outcomes_and_latency(rpc_server: Any) -> None:
    app, address = rpc_server
    t = HttpTransport(Limits())
    await t.start()
    try:
        await t.request(address, Leave(peer_id="p"), timeout_s=5)
        await t.request(address, Leave(peer_id="p"), timeout_s=5)
        with pytest.raises(TransportError):
            await t.request(address, Leave(peer_id="refuse"), timeout_s=5)
        with pytest.raises(TransportError):
            await t.request(f"127.0.0.1:{closed_port()}", Leave(peer_id="p"), timeout_s=5)
    finally:
        await t.close()
    s = t.stats
    assert s.requests == {("leave", "ok"): 2, ("leave", "busy"): 1, ("leave", "unreachable"): 1}
    assert s.latency_s["leave"].count == 4
    assert s.sent_bytes["leave"] == t.bytes_sent > 0 and set(s.sent_bytes) == {"leave"}
    assert s.received_bytes["ack"] > 0 and s.received_bytes["error"] > 0
    assert s.received_bytes.total() == t.bytes_received
    # the server side counted the same request bodies it read
    assert server_stats(app).received_bytes == {"leave": t.bytes_sent}


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def fetch(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        body: bytes = resp.read()
    return body.decode()


async def test_endpoint_takes_its_snapshot_on_the_event_loop() -> None:
    node = FakeNode(head_status(), traffic())
    server = start_metrics_server(node, "127.0.0.1", 0)
    try:
        text = await asyncio.to_thread(fetch, server.port)
    finally:
        server.close()
    assert node.status_threads == [threading.get_ident()]  # read on the loop's thread
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert {"murmur_tokens_total", "murmur_loss", "process_cpu_seconds_total"} <= names
    with pytest.raises(OSError):
        fetch(server.port)  # closed


def test_endpoint_without_a_loop_reads_directly() -> None:
    node = FakeNode(head_status())
    server = start_metrics_server(node, "127.0.0.1", 0)
    try:
        assert "murmur_node_ready 1.0" in fetch(server.port)
    finally:
        server.close()
    assert not server._thread.is_alive()


def test_status_text_shows_the_learning_rate_and_a_shared_place_in_the_schedule() -> None:
    from node.display import format_status

    st = head_status()
    assert "learning rate 0.00125 (the stage's place in its schedule: step 40)" in format_status(st)
    st["schedule_step"] = st["step"]  # its own place: nothing more to say
    assert "learning rate 0.00125\n" in format_status(st)


def test_status_text_says_when_clocks_were_seen_set() -> None:
    """The sync line counts clock steps, this machine's and its peers', once there are any;
    a proof clock corrected has a line of its own."""
    from node.display import format_status

    st = head_status()
    assert "clocks seen set: this machine's 0x, peers' 2x" in format_status(st)
    assert "clock is 7200s ahead of the swarm's: proofs carry the swarm's time" in format_status(st)
    st["counters"] = {k: v for k, v in st["counters"].items() if k != "peer_clock_steps"}
    assert "clocks seen set" not in format_status(st)


def test_node_status_says_when_the_uplink_is_too_thin_to_gossip() -> None:
    st = head_status()
    text = format_status(st)
    said = "uplink too thin to gossip: a contribution takes 14 s to send and a partner waits 12 s"
    assert said in text
    # in time for a partner, but its exchange outlasts the round
    st["sync"].update(contribution_send_s=8.0, contribution_given_s=12.6, contribution_round_s=10.0)
    st["sync"]["contribution_exchange_s"] = 16.0
    said = "a contribution takes 8 s to send and an exchange takes about 16 s of a 10 s round"
    assert said in format_status(st)
    st["sync"]["uplink_too_thin"] = False
    assert "too thin to gossip" not in format_status(st)
    # it takes every 4th round of the stage instead: said, and a gauge
    st["sync"].update(round_multiple=4, round_s=40.0)
    assert "every 40s (4 of the stage's rounds: its exchange outlasts one)" in format_status(st)
    assert "murmur_sync_round_multiple 4.0" in scrape(FakeNode(st))


def test_node_status_and_metrics_name_a_replica_the_hops_leave_out() -> None:
    """train.route_cutoff: the replicas our draws leave out now are marked in the peer list,
    and how many each draw left out is a counter (zero, the default cut being off)."""
    st = head_status()
    assert "left out of hops" not in format_status(st)
    assert "murmur_route_left_out_total 0.0" in scrape(FakeNode(st))
    st["peers"]["1"][0]["left_out"] = True
    st["counters"]["route_left_out"] = 12
    lines = [line for line in format_status(st).splitlines() if "left out" in line]
    assert len(lines) == 1 and PEER_IDS[0] in lines[0]
    assert "far slower (train.route_cutoff)" in lines[0]
    assert "murmur_route_left_out_total 12.0" in scrape(FakeNode(st))


def test_node_status_and_metrics_say_when_the_event_loop_was_held_up() -> None:
    st = head_status()
    said = "event loop held up 3 time(s), longest 6.2 s: the node answered nothing meanwhile"
    assert said in format_status(st)
    st["loop"] = {"stalls": 0, "longest_s": 0.0}
    assert "held up" not in format_status(st)
    text = scrape(FakeNode(head_status()))
    assert "murmur_loop_stalls_total 3.0" in text
