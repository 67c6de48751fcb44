"""Long uploads take a thin uplink in turns, gradients first (``node.net.uplink``), and the
hop sender uses the turns only for uploads that are long at the rate its receivers report
(``node.pipeline.HopSender``). The live check is ``bench/thin_uplink.py``'s floor runs.
Last, the word to a head when a hop went nowhere: the hop sender's ``tell_head``, and when a
block replica sends it (``BlockRole``)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any

import pytest
import torch

from node.config import resolve_config
from node.context import NodeContext, NodeState
from node.net.uplink import UplinkTurns
from node.pipeline import TURNS_SEND_S, HopSender
from node.roles.block import BlockRole
from node.stage.runner import StageRunner
from protocol.messages import Ack, Backward, Dropped, Error, Forward, Hop, Message, PeerRecord
from protocol.quant import WireTensor, encode_tensor, open_tensor
from swarm.peers import PeerTable
from swarm.routing import Router
from swarm.seams import MonotonicClock, Transport, TransportError


async def holders(turns: UplinkTurns, asks: list[tuple[str, int]], hold_s: float) -> list[str]:
    """Each of ``asks`` (name, priority), queued in that order while the turn is held,
    holds it for ``hold_s``: the order they got it in."""
    order: list[str] = []

    async def one(name: str, priority: int) -> None:
        assert await turns.acquire(priority, 10.0)
        order.append(name)
        await asyncio.sleep(hold_s)
        turns.release()

    assert await turns.acquire(0, 1.0)  # held while the others line up
    tasks = [asyncio.create_task(one(n, p)) for n, p in asks]
    await asyncio.sleep(0.01)
    assert turns.waiting == len(asks)
    turns.release()
    await asyncio.gather(*tasks)
    return order


def test_turns_go_by_priority_then_in_the_order_asked() -> None:
    turns = UplinkTurns()
    asks = [("out1", 2), ("grad1", 0), ("out2", 2), ("grad2", 0)]
    order = asyncio.run(holders(turns, asks, 0.001))
    assert order == ["grad1", "grad2", "out1", "out2"]
    assert turns.waiting == 0


def test_a_waiter_whose_time_runs_out_holds_nothing_and_the_line_goes_on() -> None:
    async def scenario() -> list[Any]:
        turns = UplinkTurns()
        assert await turns.acquire(0, 1.0)
        late = asyncio.create_task(turns.acquire(0, 0.05))
        later = asyncio.create_task(turns.acquire(1, 5.0))
        gave_up = await late
        turns.release()  # passes over the waiter that left, to the next
        got = await later
        turns.release()
        free = await turns.acquire(0, 0.0)  # nobody holds it: taken at once
        return [gave_up, got, free]

    assert asyncio.run(scenario()) == [False, True, True]


def test_a_waiter_cancelled_as_its_turn_comes_passes_the_turn_on() -> None:
    async def scenario() -> bool:
        turns = UplinkTurns()
        assert await turns.acquire(0, 1.0)
        first = asyncio.create_task(turns.acquire(0, 5.0))
        second = asyncio.create_task(turns.acquire(0, 5.0))
        await asyncio.sleep(0.01)
        turns.release()  # handed to ``first``...
        first.cancel()  # ...which is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await first
        return await asyncio.wait_for(second, 1.0)

    assert asyncio.run(scenario())


def test_random_holders_never_overlap_and_all_are_served() -> None:
    """An independent statement of the rule: whatever the mix of priorities, timeouts and
    hold times, at most one holds the turn at a time, and every waiter either gets it or
    gives up after its timeout, holding nothing."""

    async def scenario(rng: random.Random) -> tuple[int, int, int]:
        turns = UplinkTurns()
        holding = 0
        most = 0
        outcomes: Counter[bool] = Counter()

        async def one() -> None:
            nonlocal holding, most
            await asyncio.sleep(rng.random() * 0.02)
            got = await turns.acquire(rng.randrange(3), rng.choice([0.0, 0.005, 1.0]))
            outcomes[got] += 1
            if got:
                holding += 1
                most = max(most, holding)
                await asyncio.sleep(rng.random() * 0.004)
                holding -= 1
                turns.release()

        await asyncio.gather(*(one() for _ in range(40)))
        return most, outcomes[True] + outcomes[False], turns.waiting

    for seed in range(5):
        most, served, waiting = asyncio.run(scenario(random.Random(seed)))
        assert most == 1 and served == 40 and waiting == 0


class SharingTransport:
    """Requests whose bytes take ``nbytes / rate`` seconds each, however many overlap, and
    whose ack comes ``ack_s`` after the last byte; it notes the most transfers that ran at
    once, how long two overlapped at most, and the order they began in."""

    def __init__(self, rate: float, reports: bool = True, ack_s: float = 0.0) -> None:
        self.rate = rate
        self.reports = reports
        """Whether the receiver reports the rate in its ack (a relayed one does not)."""
        self.ack_s = ack_s
        self.running = 0
        self.most = 0
        self.began: list[str] = []
        self.spans: list[tuple[float, float]] = []
        """(start, end) of each transfer, by the loop's clock."""

    async def request(
        self, address: str, msg: Message, timeout: float, peer_id: str | None = None
    ) -> Message:
        loop = asyncio.get_running_loop()
        nbytes = sum(t.nbytes for t in msg.tensors.values())
        late = nbytes / self.rate + self.ack_s > timeout
        self.running += 1
        self.most = max(self.most, self.running)
        self.began.append(msg.TYPE)
        start = loop.time()
        try:
            await asyncio.sleep(timeout if late else nbytes / self.rate)
        finally:
            self.running -= 1
            self.spans.append((start, loop.time()))
        if late:
            raise TransportError("timeout", "late")
        await asyncio.sleep(self.ack_s)
        return Ack(rate=self.rate if self.reports else 0.0)

    def overlap_s(self) -> float:
        """The longest a transfer ran together with any that began before it."""
        longest, end = 0.0, float("-inf")
        for start, stop in sorted(self.spans):
            longest = max(longest, min(end, stop) - start)
            end = max(end, stop)
        return longest


def no_tasks(coro: Coroutine[Any, Any, None]) -> None:
    coro.close()
    raise AssertionError("a hop sender runs no task of its own")


def sender(transport: Transport, hop_timeout_s: float) -> HopSender:
    """A hop sender on a node context as the daemon builds it, its peers' requests going
    through ``transport``."""
    ctx = NodeContext(
        config=resolve_config(overrides={"train.hop_timeout_s": hop_timeout_s}),
        peer_id="a" * 16,
        num_stages=3,
        state=NodeState(stage=1, ready=True, address="127.0.0.1:1"),
        clock=MonotonicClock(),
        rng=random.Random(0),
        table=PeerTable("a" * 16, 30.0, 100),
        stages=dict,
        router=Router(random.Random(0)),
        transport=transport,
        counters=Counter(),
        spawn=no_tasks,
    )
    return HopSender(ctx)


def hop_message(kind: str, nbytes: int) -> Message:
    x = torch.zeros(nbytes // 4)
    if kind == "forward":
        return Forward("mb", target_stage=2, path=[], eval=False, meta={}, tensors={"x": x})
    return Backward("mb", index=0, path=[], meta={}, tensors={"g": x})


HOP = Hop(stage=2, peer_id="peer", address="127.0.0.1:1")


async def send_all(
    hops: HopSender, kinds: list[str], nbytes: int, gap_s: float = 0.005
) -> list[bool]:
    """Sends one hop of each of ``kinds``, asked ``gap_s`` apart: whether each was taken."""

    async def one(kind: str, delay: float) -> bool:
        await asyncio.sleep(delay)
        return await hops.send_to(HOP, hop_message(kind, nbytes)) is None

    return await asyncio.gather(*(one(k, i * gap_s) for i, k in enumerate(kinds)))


def test_long_uploads_go_one_at_a_time_gradients_first_and_short_ones_together() -> None:
    rate = 1e6  # bytes/s
    transport = SharingTransport(rate)
    hops = sender(transport, hop_timeout_s=5.0)
    hops.wire.observe(rate)
    nbytes = int(rate * TURNS_SEND_S * 0.2)  # short: all at once
    assert asyncio.run(send_all(hops, ["forward"] * 3, nbytes)) == [True] * 3
    assert transport.most == 3
    transport.most, transport.began, transport.spans = 0, [], []
    nbytes = int(rate * TURNS_SEND_S * 1.2)  # long: one at a time
    sent = asyncio.run(send_all(hops, ["forward", "forward", "backward"], nbytes))
    assert sent == [True] * 3
    assert transport.overlap_s() < 0.02
    # the first forward went at once; the gradient, asked for last, went before the other
    assert transport.began == ["forward", "backward", "forward"]
    assert hops.turns.waiting == 0 and hops.wire_status()["uplink_waiting"] == 0


def test_a_long_upload_that_cannot_end_within_its_deadline_is_not_sent() -> None:
    """Its turn did not come in time, or came with less of the deadline left than the
    upload takes: it is not sent, so the uploads behind it are not delayed by bytes that
    arrive too late to count."""
    rate = 1e6
    nbytes = int(rate * 1.5)  # 1.5 s each
    transport = SharingTransport(rate)
    hops = sender(transport, hop_timeout_s=4.0)
    hops.wire.observe(rate)
    sent = asyncio.run(send_all(hops, ["forward"] * 3, nbytes))
    # the first ends at 1.5 s, the second (2.5 s left at its turn) at 3 s; the third's turn
    # comes with 1 s left
    assert sent == [True, True, False]
    assert transport.began == ["forward", "forward"]
    assert hops.ctx.counters["send_failed_uplink_busy"] == 1

    transport = SharingTransport(rate)
    hops = sender(transport, hop_timeout_s=2.0)
    hops.wire.observe(rate)
    sent = asyncio.run(send_all(hops, ["forward", "forward", "backward"], nbytes, 0.05))
    # the first goes at once and ends at 1.5 s; then the gradient (asked last, but first in
    # line) has 0.6 s left and the second forward 0.55 s: neither is sent
    assert sent == [True, False, False]
    assert transport.began == ["forward"]
    assert hops.ctx.counters["send_failed_uplink_busy"] == 2
    assert hops.ctx.counters["send_failed_timeout"] == 0
    assert hops.ctx.counters["hops_dropped"] == 2
    assert hops.turns.waiting == 0


def test_an_upload_that_finds_the_uplink_free_is_sent_however_long_it_looks() -> None:
    """A timed-out hop bounds the rate at its bytes over the deadline, so an upload of that
    size looks exactly as long as the deadline. Were it skipped, no upload would be sent
    again and the rate would never be measured anew: one that finds the uplink free goes,
    and the receiver's report brings the rate back up."""
    rate = 1e7  # the link is fast again
    nbytes = 1_000_000
    transport = SharingTransport(rate)
    hops = sender(transport, hop_timeout_s=2.0)
    hops.wire.observe_timeout(nbytes, 2.0)  # 0.5 MB/s: this upload reads as 2 s, the deadline
    assert asyncio.run(send_all(hops, ["forward"], nbytes)) == [True]
    assert transport.began == ["forward"]
    assert hops.wire.rate_bytes_s is not None and hops.wire.rate_bytes_s > nbytes / 2.0
    assert hops.ctx.counters["send_failed_uplink_busy"] == 0


def test_before_any_rate_is_known_the_first_upload_measures_the_link_alone() -> None:
    """A node on a thin uplink that knows no rate yet: three uploads of 3 s each, asked
    together, would share the link and all miss a 4 s deadline (each would take 9 s). The
    first goes alone and ends in time; its receiver's report says the others, which waited,
    could no longer end within theirs, so they are not sent. Sent together, as before this
    rule, none would arrive."""
    rate = 1e5
    nbytes = int(rate * 3.0)
    transport = SharingTransport(rate)
    hops = sender(transport, hop_timeout_s=4.0)
    assert hops.wire.rate_bytes_s is None
    assert asyncio.run(send_all(hops, ["forward"] * 3, nbytes)) == [True, False, False]
    assert transport.began == ["forward"]
    assert hops.ctx.counters["send_failed_uplink_busy"] == 2
    assert hops.ctx.counters["send_failed_timeout"] == 0


@pytest.mark.parametrize("reports", [True, False])
def test_on_a_fast_link_only_the_first_uploads_wait_for_the_rate(reports: bool) -> None:
    """Before any rate is known the first timeable uploads go one at a time; once one has
    ended, the rate its receiver reported (or, from a relayed receiver that reports none,
    the rate this node's own clock gave it) calls the next ones short, and they go
    together."""
    rate = 1e7
    nbytes = 200_000  # 20 ms: short at any rate this link gives
    transport = SharingTransport(rate, reports=reports)
    hops = sender(transport, hop_timeout_s=5.0)
    assert asyncio.run(send_all(hops, ["forward"] * 3, nbytes, gap_s=0.0)) == [True] * 3
    assert transport.overlap_s() < 0.02  # nothing known: one at a time
    transport.most = 0
    assert asyncio.run(send_all(hops, ["forward"] * 3, nbytes, gap_s=0.0)) == [True] * 3
    assert transport.most == 3
    assert hops.wire.rate_bytes_s is not None and hops.wire.rate_bytes_s <= rate


def test_a_turn_is_held_until_the_ack_is_back() -> None:
    """Two uploads of 1.2 s at the known rate, each ack 0.3 s after its last byte: the
    second's bytes start once the first's ack is back, not as its bytes end (passing the
    turn on earlier was tried live and trained no more, ``docs/algorithms.md`` section 7)."""
    rate = 1e6
    nbytes = int(rate * 1.2)
    transport = SharingTransport(rate, ack_s=0.3)
    hops = sender(transport, hop_timeout_s=10.0)
    hops.wire.observe(rate)
    assert asyncio.run(send_all(hops, ["forward"] * 2, nbytes, gap_s=0.0)) == [True] * 2
    (first, second) = sorted(transport.spans)
    assert second[0] - first[1] == pytest.approx(0.3, abs=0.1)


def test_an_outer_sync_upload_is_given_what_the_hops_leave_of_the_uplink() -> None:
    """Two hops of 0.3 MB at 1 MB/s, then one that times out: 0.9 MB crossed the link in the
    last 30 s, 30 kB/s, so an outer sync's upload reads 970 kB/s; the status says 0.24
    Mbit/s of hops. Before any rate is known there is nothing to share."""
    rate = 1e6
    nbytes = 300_000
    transport = SharingTransport(rate)
    hops = sender(transport, hop_timeout_s=2.0)
    assert hops.sync_bytes_s() is None
    assert asyncio.run(send_all(hops, ["forward"] * 2, nbytes, gap_s=0.0)) == [True] * 2
    transport.rate = nbytes / 3.0  # the next one takes 3 s, past the deadline
    assert asyncio.run(send_all(hops, ["forward"], nbytes)) == [False]
    assert hops.ctx.counters["send_failed_timeout"] == 1
    assert hops.wire.settled_bytes_s == pytest.approx(rate)  # one timeout does not move it
    assert hops.sync_bytes_s() == pytest.approx(rate - 3 * nbytes / 30.0, rel=1e-3)
    assert hops.wire_status()["load_mbps"] == 0.24


def test_a_node_whose_receivers_are_all_relayed_recovers_from_a_timeout() -> None:
    """A relayed receiver reports no rate. After one hop timed out (a dead receiver on a
    fast link), its bound made every later bf16 upload look 2 s long: the node took int8
    and its uploads took turns for good, since only reports ever raised the rate. Timed by
    its own clock, the uploads that arrive after the timeout bring the rate back up: bf16
    again, and uploads go together."""
    rate = 1e7  # 80 Mbit/s
    numel = 250_000  # bf16: 0.5 MB, 50 ms at this rate; a job computes in 0.2 s
    transport = SharingTransport(rate, reports=False)
    hops = sender(transport, hop_timeout_s=2.0)
    assert hops.codec(numel, job_s=0.2) == "bf16"
    hops.wire.observe_timeout(2 * numel, 2.0)  # 0.25 MB/s: 2 s a bf16 upload
    assert hops.codec(numel, job_s=0.2) == "int8"
    nbytes = numel  # int8 payloads, timed as they arrive
    for _ in range(8):
        assert asyncio.run(send_all(hops, ["forward"], nbytes)) == [True]
    assert hops.codec(numel, job_s=0.2) == "bf16"
    transport.most = 0
    assert asyncio.run(send_all(hops, ["forward"] * 3, 2 * numel, gap_s=0.0)) == [True] * 3
    assert transport.most == 3  # short again: no turns


def test_small_uploads_never_wait_for_the_rate() -> None:
    """Bodies too small for a receiver to time say nothing of the link: they go at once,
    however many, before any rate is known."""
    transport = SharingTransport(1e7)
    hops = sender(transport, hop_timeout_s=5.0)
    assert asyncio.run(send_all(hops, ["forward"] * 3, 16_000, gap_s=0.0)) == [True] * 3
    assert transport.most == 3


class Answering:
    """A transport whose every request gets ``answer`` (raised, if it is an exception)."""

    def __init__(self, answer: Message | Exception) -> None:
        self.answer = answer
        self.sent: list[tuple[str, Message, str]] = []

    async def request(
        self, address: str, msg: Message, timeout_s: float, peer_id: str = ""
    ) -> Message:
        self.sent.append((address, msg, peer_id))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.mark.parametrize(
    ("answer", "counted"),
    [
        (Ack(), "drop_notices_sent"),
        (TransportError("timeout", "no answer"), "drop_notices_failed"),
        (TransportError("stale_microbatch", "re-issued already"), "drop_notices_failed"),
        (Error("x", "not an ack"), "drop_notices_failed"),
    ],
)
def test_a_drop_notice_goes_to_the_head_and_a_failed_one_is_only_counted(
    answer: Message | Exception, counted: str
) -> None:
    transport = Answering(answer)
    hops = sender(transport, hop_timeout_s=5.0)
    head = Hop(0, "h" * 16, "10.0.0.1:7000")
    asyncio.run(hops.tell_head(head, "mb.1.1.00ff", 2))
    [(address, notice, peer_id)] = transport.sent
    assert (address, peer_id) == (head.address, head.peer_id)
    assert notice == Dropped(mb_id="mb.1.1.00ff", stage=2, sender=hops.ctx.peer_id)
    assert hops.ctx.counters == Counter({counted: 1})


class HopRefused:
    """A transport that answers every hop with ``error`` and takes every drop notice."""

    def __init__(self, error: str) -> None:
        self.error = error
        self.notices: list[tuple[str, Message]] = []

    async def request(
        self, address: str, msg: Message, timeout_s: float, peer_id: str = ""
    ) -> Message:
        if isinstance(msg, Dropped):
            self.notices.append((address, msg))
            return Ack()
        raise TransportError(self.error, "refused")


HEAD = Hop(0, "h" * 16, "10.0.0.1:7000")
STAGE_1 = Hop(1, "a" * 16, "10.0.0.2:7000")


def block_replica(transport: HopRefused, stage: int, num_block_stages: int) -> BlockRole:
    """A block role of ``stage`` with its model built, its hops going through ``transport``;
    a replica of stage 2 is in its table."""
    hops = sender(transport, hop_timeout_s=1.0)
    config = resolve_config(
        overrides={
            "swarm.num_block_stages": str(num_block_stages),
            "train.hop_retries": "0",
            "train.step_samples": "64",
        }
    )
    ctx = replace(hops.ctx, config=config, num_stages=num_block_stages + 1)
    hops.ctx = ctx
    replica = PeerRecord(peer_id="b" * 16, address="10.0.0.3:7000", stage=2, ready=True)
    ctx.table.observe(replica, ctx.clock.now())
    runner = StageRunner(config, stage)
    runner._build()
    return BlockRole(ctx, runner, hops)


def wire(x: torch.Tensor) -> WireTensor:
    tensors, meta = encode_tensor(x, "fp32", name="x")
    return open_tensor(tensors, meta)


@pytest.mark.parametrize(
    ("hop", "error", "told"),
    [
        ("onward", "unreachable", True),  # the head cannot know
        ("home", "overloaded", True),  # the head turned it away and waits on
        ("home", "stale_microbatch", False),  # the head re-issued it already
        ("home", "unreachable", False),  # nor would the notice reach it
        ("home", "banned", False),  # nor would it take the notice
        ("back to the head", "stale_microbatch", False),
        ("back to the head", "timeout", True),  # a thin uplink's timeout: a notice is small
        ("back to a replica", "unknown_microbatch", True),
        ("back to a replica", "unreachable", True),  # the head may be reachable
    ],
)
def test_a_block_replica_tells_the_head_of_a_dropped_hop_unless_it_knows(
    hop: str, error: str, told: bool
) -> None:
    """After a hop that went nowhere, the head that issued the microbatch hears of it, except
    from a hop to itself that it refused knowing the microbatch gone, or that a notice could
    not cross either (``HEAD_NEEDS_NO_WORD``)."""
    transport = HopRefused(error)
    mb_id = "h0h0h0h0.1.1.00ff"
    x = torch.randn(1, 8, 128)
    if hop in ("onward", "home"):
        role = block_replica(transport, 1, num_block_stages=1 if hop == "home" else 2)
        msg = Forward(mb_id, target_stage=1, path=[HEAD], eval=False, meta={}, tensors={})
        job = role.forward_job(msg, wire(x))
    else:
        stage = 1 if hop == "back to the head" else 2
        role = block_replica(transport, stage, num_block_stages=2)
        role.runner.block_forward(mb_id, x, train=True)
        path = [HEAD, STAGE_1, Hop(2, role.ctx.peer_id, "10.0.0.4:7000")][: stage + 1]
        msg_b = Backward(mb_id, index=stage, path=path, meta={}, tensors={})
        job = role.backward_job(msg_b, wire(x))

    async def run() -> None:
        send = await job()
        assert send is not None
        await send()

    try:
        asyncio.run(run())
    finally:
        role.runner.close()
    counters = role.ctx.counters
    assert counters["hops_dropped"] == 1
    notice = Dropped(mb_id=mb_id, stage=role.runner.stage, sender=role.ctx.peer_id)
    assert transport.notices == ([(HEAD.address, notice)] if told else [])
    assert counters["drop_notices_sent"] == told
    assert counters["drop_notices_needless"] == (not told)
