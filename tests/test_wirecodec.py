"""``swarm.wirecodec``: the wire codec a node takes by its link, on hand-computed examples."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import aiohttp
import pytest
import torch

from node import pipeline
from node.display import format_status
from node.metrics import NodeCollector
from protocol.frames import join_frame
from protocol.messages import Ack, decode_message, encode_message
from swarm.gossip import GossipConfig
from swarm.wirecodec import (
    MIN_TIMED_BYTES,
    SETTLED_TIMEOUTS,
    CodecChoice,
    UploadLoad,
    arrival_rate,
    payload_bytes,
    spare_bytes_s,
    sync_codec,
    sync_codec_unmeasured,
)
from tests.test_hostile import forward, start_node

NUMEL = 16 * 128 * 128  # one microbatch's activations in the tiny model: 262,144 values
BF16 = 524_288  # 2 bytes a value
INT8 = 262_144 + 128 * 4  # 1 byte a value and one fp32 scale per block of 2048


def test_payload_bytes_by_codec() -> None:
    assert payload_bytes("bf16", NUMEL) == BF16
    assert payload_bytes("int8", NUMEL) == INT8
    assert payload_bytes("fp32", NUMEL) == 2 * BF16


def test_arrival_rate_needs_a_body_big_enough_to_time() -> None:
    assert arrival_rate(1_000_000, 0.5) == 2_000_000
    assert arrival_rate(MIN_TIMED_BYTES - 1, 0.5) == 0.0  # arrived with its headers
    assert arrival_rate(1_000_000, 0.0) == 0.0


def test_keeps_bf16_while_the_link_keeps_up_with_compute() -> None:
    c = CodecChoice()
    c.observe(12.5e6)  # 100 Mbit/s: a bf16 payload takes 524,288 / 12.5e6 = 41.9 ms
    assert c.choose(NUMEL, compute_s=0.050) == "bf16"  # 41.9 ms <= 50 ms
    assert c.num_switches == 0


def test_takes_int8_on_a_thin_link_and_stays_on_it_when_nothing_keeps_up() -> None:
    c = CodecChoice()
    c.observe(2.5e6)  # 20 Mbit/s: bf16 209.7 ms, int8 105.1 ms, both over 50 ms
    assert c.choose(NUMEL, compute_s=0.050) == "int8"
    assert c.choose(NUMEL, compute_s=0.050) == "int8"
    assert c.num_switches == 1


def test_goes_back_to_bf16_only_with_a_margin() -> None:
    c = CodecChoice(codec="int8")
    c.observe(12.5e6)  # bf16 would take 41.9 ms: within 50 ms but not within half of it
    assert c.choose(NUMEL, compute_s=0.050) == "int8"
    c = CodecChoice(codec="int8")
    c.observe(25e6)  # bf16 would take 21.0 ms <= 25 ms
    assert c.choose(NUMEL, compute_s=0.050) == "bf16"
    assert c.num_switches == 1


def test_unknown_rate_or_compute_time_keeps_the_current_codec() -> None:
    assert CodecChoice().choose(NUMEL, compute_s=0.05) == "bf16"  # no report yet
    c = CodecChoice()
    c.observe(1e3)
    assert c.choose(NUMEL, compute_s=0.0) == "bf16"  # compute time not measured yet


def test_reports_average_and_non_measurements_are_ignored() -> None:
    c = CodecChoice()
    for bad in (0.0, -5.0, math.inf, math.nan):
        c.observe(bad)
    assert c.rate_bytes_s is None
    c.observe(10.0)
    c.observe(20.0)
    assert c.rate_bytes_s == pytest.approx(13.0)  # 10 + 0.3 * (20 - 10)


def test_a_timed_out_payload_bounds_the_rate_so_a_link_nothing_crosses_takes_int8() -> None:
    """Behind 1 Mbit/s no bf16 microbatch crossed within the 10 s hop deadline, so no
    receiver ever reported a rate and the node stayed on bf16 for good
    (``bench/thin_uplink.py --floor 1``). A timeout says the payload got at most 524,288 B
    / 10 s = 52,429 B/s: bf16 would take 10 s a job, int8 about 5 s, so int8."""
    c = CodecChoice()
    c.observe_timeout(BF16, 10.0)
    assert c.rate_bytes_s == pytest.approx(52_428.8)
    assert c.choose(NUMEL, compute_s=0.05) == "int8"
    c.observe_timeout(BF16, 5.0)  # a looser bound does not raise the estimate
    assert c.rate_bytes_s == pytest.approx(52_428.8)
    c.observe_timeout(MIN_TIMED_BYTES - 1, 10.0)  # too small to say anything
    c.observe_timeout(BF16, 0.0)
    assert c.rate_bytes_s == pytest.approx(52_428.8)
    fast = CodecChoice()  # 100 Mbit/s, 0.1 s a job: bf16 takes 41.9 ms
    fast.observe(12.5e6)
    assert fast.choose(NUMEL, compute_s=0.1) == "bf16"
    fast.observe_timeout(BF16, 10.0)  # a dead receiver on a fast link: the bound stands...
    assert fast.choose(NUMEL, compute_s=0.1) == "int8"
    for _ in range(6):  # ...until reports of the link's real rate bring it back (50 ms)
        fast.observe(12.5e6)
    assert fast.choose(NUMEL, compute_s=0.1) == "bf16"


def test_the_rate_an_outer_round_is_chosen_by_is_not_lowered_by_one_timeout() -> None:
    """On a fast link a timed-out 512 kB hop (a dead receiver, a busy machine) bounds the
    rate to 0.4 Mbit/s; a round's codec chosen by that would send a 9.6 MB contribution in
    int8 for nothing. ``settled_bytes_s`` keeps the measurements' average until
    ``SETTLED_TIMEOUTS`` (3) timeouts come in a row, and takes the bound while nothing has
    been measured."""
    assert SETTLED_TIMEOUTS == 3
    allowed = GossipConfig().allowed_s  # 10 s plus the bytes at 10 Mbit/s
    numel = 2 * 1_200_000  # slow weights and pseudo-gradient: 9.6 MB in fp32
    c = CodecChoice()
    c.observe_timeout(BF16, 10.0)  # nothing measured yet: the bound is all there is
    assert c.settled_bytes_s == pytest.approx(52_428.8)
    assert sync_codec(numel, c.settled_bytes_s, allowed) == "int8"
    c.observe(12.5e6)
    c.observe(12.5e6)
    assert c.measured_bytes_s == pytest.approx(12.5e6)
    assert c.settled_bytes_s == pytest.approx(12.5e6)
    for timeouts in (1, 2):
        c.observe_timeout(BF16, 10.0)
        assert c.rate_bytes_s == pytest.approx(52_428.8)  # the hops' codec takes the bound
        assert c.settled_bytes_s == pytest.approx(12.5e6), timeouts  # a round's does not
        assert sync_codec(numel, c.settled_bytes_s, allowed) == "fp32"
    c.observe_timeout(BF16, 10.0)  # three in a row with nothing between: the link changed
    assert c.settled_bytes_s == pytest.approx(52_428.8)
    assert sync_codec(numel, c.settled_bytes_s, allowed) == "int8"
    c.observe(1e6)  # a measurement: the average of measurements alone again
    assert c.timeouts_in_a_row == 0
    assert c.settled_bytes_s == pytest.approx(12.5e6 + 0.3 * (1e6 - 12.5e6))
    c.observe_timeout(MIN_TIMED_BYTES - 1, 10.0)  # too small to say anything
    assert c.timeouts_in_a_row == 0


def test_an_upload_no_receiver_timed_enters_the_average_by_the_senders_clock() -> None:
    """A relayed receiver reports nothing; the sender's own clock gives the upload's bytes
    over its round trip, averaged like a report. It lifts a timeout's bound as reports do
    (a node whose receivers are all relayed kept the bound, and int8, for good)."""
    c = CodecChoice()
    c.observe_trip(MIN_TIMED_BYTES - 1, 0.001)  # too small to time
    c.observe_trip(BF16, 0.0)
    assert c.rate_bytes_s is None
    c.observe_trip(1_000_000, 0.5)
    assert c.rate_bytes_s == pytest.approx(2e6)
    c.observe_timeout(BF16, 10.0)
    assert c.rate_bytes_s == pytest.approx(52_428.8)
    c.observe_trip(1_000_000, 0.5)
    assert c.rate_bytes_s == pytest.approx(52_428.8 + 0.3 * (2e6 - 52_428.8))


def test_agrees_with_the_rule_stated_independently() -> None:
    """The rule in words: the most precise codec whose payload is sent within one job's
    compute time (within half of it, to move to a more precise codec than the current);
    the most compact when none is."""
    sizes = {"bf16": BF16, "int8": INT8}
    for current in ("bf16", "int8"):
        for rate in (1e5, 1e6, 5e6, 1e7, 2e7, 5e7, 1e9):
            for compute_s in (0.001, 0.01, 0.03, 0.1, 1.0):
                bf16_ok = sizes["bf16"] / rate <= compute_s * (0.5 if current == "int8" else 1)
                expected = "bf16" if bf16_ok else "int8"
                c = CodecChoice(codec=current)
                c.observe(rate)
                assert c.choose(NUMEL, compute_s) == expected, (current, rate, compute_s)


# ---- the receiver's side: a real node times what arrives --------------------------------


async def test_a_node_acks_a_microbatch_with_the_rate_its_body_arrived_at() -> None:
    """A forward posted through a client that sends 1 MB in 8 chunks 50 ms apart (a thin
    uplink, about 3 MB/s) is acked with about that rate; a small one with none."""
    node = await start_node(**{"net.max_frame_bytes": 4 << 20})
    try:
        frame = join_frame(encode_message(forward(torch.zeros(16, 128, 128), mb_id="00000000.3.1")))
        assert len(frame) > 1_000_000

        async def thin_uplink() -> Any:
            step = len(frame) // 8 + 1
            for i in range(0, len(frame), step):
                yield frame[i : i + step]
                await asyncio.sleep(0.05)

        url = f"http://{node.state.address}/rpc"
        async with aiohttp.ClientSession() as session:
            async with session.post(url, data=thin_uplink()) as resp:
                reply = decode_message(await resp.read())
            assert isinstance(reply, Ack), reply
            # 1 MB over 7 gaps of 50 ms (the first chunk comes with the headers): ~3 MB/s
            assert 1.5e6 < reply.rate < 4.5e6, reply.rate
            small = join_frame(encode_message(forward(mb_id="00000000.4.1")))
            async with session.post(url, data=small) as resp:
                assert decode_message(await resp.read()) == Ack(queue=2)  # too small to time
    finally:
        await node.close()


async def test_auto_follows_the_reported_rate_and_shows_it() -> None:
    node = await start_node()  # auto is the default
    try:
        assert node.status()["wire"] == {
            "codec": "bf16",
            "auto": True,
            "link_mbps": None,
            "switches": 0,
            "send_s": None,
            "too_thin": False,
            "uplink_waiting": 0,
            "load_mbps": 0.0,
        }
        node.hops.wire.observe(2.5e6)  # 20 Mbit/s
        assert node.hops.codec(NUMEL, 0.05) == "int8"
        assert node.status()["wire"] == {
            "codec": "int8",
            "auto": True,
            "link_mbps": 20.0,
            "switches": 1,
            "send_s": 0.1,  # 262,656 B at 2.5e6 B/s: 0.105 s
            "too_thin": False,
            "uplink_waiting": 0,
            "load_mbps": 0.0,
        }
        assert "wire codec int8 (auto: payloads arrive at 20.0 Mbit/s)" in format_status(
            node.status()
        )
        names = {m.name: m for m in NodeCollector(node).collect()}
        assert names["murmur_wire_link_bytes_per_second"].samples[0].value == 2.5e6
        assert names["murmur_wire"].samples[0].labels == {"codec": "int8", "auto": "true"}
    finally:
        await node.close()
    fixed = await start_node(**{"train.wire_codec": "bf16"})
    try:
        fixed.hops.wire.observe(2.5e6)
        assert fixed.hops.codec(NUMEL, 0.05) == "bf16"  # a fixed codec is never second-guessed
    finally:
        await fixed.close()


async def test_a_node_whose_uplink_is_too_thin_for_its_microbatches_is_told(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 0.5 Mbit/s (62,500 B/s) an int8 tensor of the tiny model's microbatch takes
    262,656 / 62,500 = 4.2 s to send: within half the 10 s hop deadline. At 0.4 Mbit/s it
    takes 5.3 s: two in flight miss it, and the node says so in ``node status``, and in its
    log once that has held ``THIN_HOLD_S`` (then once per ``THIN_WARNING_EVERY_S``)."""
    monkeypatch.setattr(pipeline, "THIN_HOLD_S", 0.5)
    node = await start_node()
    try:
        node.hops.wire.observe(62_500.0)
        assert node.hops.codec(NUMEL, 0.05) == "int8"
        assert node.status()["wire"]["send_s"] == 4.2 and not node.status()["wire"]["too_thin"]
        assert "too thin" not in caplog.text
        for _ in range(40):  # reports of 0.4 Mbit/s bring the average down to it
            node.hops.wire.observe(50_000.0)
        assert node.hops.codec(NUMEL, 0.05) == "int8"
        wire = node.status()["wire"]
        assert wire["send_s"] == 5.3 and wire["too_thin"]
        assert "too thin" not in caplog.text  # not for long yet: a report may lift it
        node.hops.wire.observe(1e6)  # one report of a fast link does
        node.hops.codec(NUMEL, 0.05)
        assert not node.status()["wire"]["too_thin"]
        await asyncio.sleep(0.6)
        node.hops.wire.observe_timeout(500_000, 10.0)  # a timeout: 0.4 Mbit/s again
        node.hops.codec(NUMEL, 0.05)
        assert node.status()["wire"]["too_thin"]
        assert "too thin" not in caplog.text  # the hold starts again from here
        await asyncio.sleep(0.6)
        node.hops.codec(NUMEL, 0.05)
        node.hops.codec(NUMEL, 0.05)
        assert caplog.text.count("uplink is too thin") == 1
        assert "0.40 Mbit/s, so one int8 tensor takes 5.3 s" in caplog.text
        assert "uplink too thin: one tensor takes 5.3 s" in format_status(node.status())
    finally:
        await node.close()


@pytest.mark.parametrize(
    "rate, codec",
    [
        (None, "fp32"),  # not measured yet: the published rules' full precision
        (0.0, "fp32"),
        (math.nan, "fp32"),
        (1e6, "fp32"),  # 4 MB in 4 s, 13.2 s given
        (2.5e5, "bf16"),  # fp32 16 s > 13.2 s; bf16 8 s <= 11.6 s
        (1.2e5, "int8"),  # bf16 16.7 s > 11.6 s; int8 (1,001,953 B) 8.35 s <= 10.8 s
        (5e4, "int8"),  # int8 20 s > 10.8 s: nothing fits, the most compact
    ],
)
def test_sync_codec_takes_the_most_precise_payload_that_arrives_before_the_wait_ends(
    rate: float | None, codec: str
) -> None:
    """A million values; the receiver waits 10 s plus the payload at 10 Mbit/s."""
    assert sync_codec(1_000_000, rate, lambda n: 10.0 + n / 1.25e6) == codec


def test_before_any_rate_auto_sends_the_published_rules_fp32_and_a_fixed_codec_stands() -> None:
    assert sync_codec_unmeasured("auto") == "fp32"
    for fixed in ("fp32", "bf16", "int8"):
        assert sync_codec_unmeasured(fixed) == fixed


def test_the_hops_load_is_their_bytes_over_the_window() -> None:
    """A 30 s window: 3 MB at t = 0 and 1.5 MB at t = 20 read 150 kB/s at t = 25; at t = 30
    the first has left the window (50 kB/s), at t = 50 the second (0). A node that began
    less than a window ago reads low, its bytes over the whole window."""
    load = UploadLoad(window_s=30.0)
    assert load.bytes_s(0.0) == 0.0
    load.record(0.0, 3_000_000)
    load.record(20.0, 1_500_000)
    assert load.bytes_s(25.0) == pytest.approx(150_000)
    assert load.bytes_s(30.0) == pytest.approx(50_000)
    assert load.bytes_s(50.0) == 0.0
    load.record(51.0, 600_000)
    assert load.bytes_s(51.0) == pytest.approx(20_000)


@pytest.mark.parametrize(
    "rate, load, spare",
    [
        (None, 1e5, None),  # not measured: nothing to share
        (250_000.0, 0.0, 250_000.0),  # 2 Mbit/s, no hops: the whole link
        (250_000.0, 50_000.0, 200_000.0),  # hops send 0.4 Mbit/s: what they leave
        (250_000.0, 150_000.0, 125_000.0),  # they would leave 0.8: TCP's even share, half
        (250_000.0, 400_000.0, 125_000.0),  # a load read above the link: still half
        (250_000.0, -5.0, 250_000.0),
    ],
)
def test_an_outer_sync_upload_gets_what_the_hops_leave_and_at_least_half(
    rate: float | None, load: float, spare: float | None
) -> None:
    assert spare_bytes_s(rate, load) == spare


@pytest.mark.parametrize(
    "current, rate, codec",
    [
        ("fp32", 2.5e5, "bf16"),  # down at once: fp32 16 s > 13.2 s given; bf16 8 s fits
        ("bf16", 3.5e5, "bf16"),  # fp32 would fit (11.4 s of 13.2) but not in half of it
        (None, 3.5e5, "fp32"),  # the same rate without a last round: fp32
        ("bf16", 6.1e5, "fp32"),  # 6.56 s, within half of 13.2 s: back to fp32
        ("int8", 2.5e5, "int8"),  # bf16 8 s fits 11.6 s, not half of it
        ("int8", 3.5e5, "bf16"),  # bf16 5.71 s within 5.8 s
    ],
)
def test_sync_codec_moves_up_only_with_room_to_spare(
    current: str | None, rate: float, codec: str
) -> None:
    """A million values, 10 s plus the payload at 10 Mbit/s given: a more precise codec
    than the last round's is taken back only when it arrives within half its allowance
    (``UP_MARGIN``), so a rate that moves with the hops' load does not flip the codec from
    round to round; a less precise one is taken as soon as the current one is late."""
    assert sync_codec(1_000_000, rate, lambda n: 10.0 + n / 1.25e6, current) == codec
