"""Ring all-reduce and NoLoCo matchmaking on an in-memory network with scripted faults."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Awaitable, Callable

import pytest
import torch

from protocol.errors import MalformedMessage
from protocol.messages import (
    Ack,
    GossipFollow,
    GossipReply,
    GossipRequest,
    Hop,
    Message,
    PeerRecord,
    RingChunk,
)
from protocol.quant import encode_tensor
from swarm.allreduce import RingAllReduce, RingFailed, chunk_bounds, ring_steps
from swarm.gossip import Contribution, GossipConfig, GossipService
from swarm.membership import IntroducingTransport
from swarm.seams import MonotonicClock, Refused, TransportError

pytestmark = pytest.mark.timeout(30)


class Net:
    """address -> node; ``dead`` addresses never answer; ``delay_s`` before delivery."""

    def __init__(self) -> None:
        self.rings: dict[str, RingAllReduce] = {}
        self.gossip: dict[str, GossipService] = {}
        self.dead: set[str] = set()
        self.delay_s = 0.0
        self.strangers: dict[str, set[str]] = {}
        """address -> senders refused there as ``unknown_peer`` until introduced."""
        self.tensor_bytes = 0
        """Tensor bytes carried by requests and replies delivered."""
        self.rate_bytes_s = 0.0
        """Tensor bytes per second of every link, each way (0: instant): a request's tensors
        cross before it is handled, the reply's before it is returned, as on a thin uplink."""

    async def _cross(self, msg: Message) -> None:
        if self.rate_bytes_s:
            await asyncio.sleep(_nbytes(msg) / self.rate_bytes_s)

    async def request(
        self, address: str, msg: Message, timeout_s: float, peer_id: str = ""
    ) -> Message:
        if address in self.dead:
            await asyncio.sleep(timeout_s)
            raise TransportError("timeout", address)
        await asyncio.sleep(self.delay_s)
        # a real wire serialises the message: the receiver never shares the sender's memory
        msg = dataclasses.replace(msg, tensors={k: v.clone() for k, v in msg.tensors.items()})
        try:
            async with asyncio.timeout(timeout_s):
                await self._cross(msg)
                if isinstance(msg, RingChunk):
                    self.rings[address].deliver(msg)
                    return Ack()
                if isinstance(msg, GossipRequest | GossipFollow):
                    if msg.sender in self.strangers.get(address, set()):
                        raise Refused("unknown_peer", f"{msg.sender} has not said hello")
                    self.tensor_bytes += _nbytes(msg)
                    service = self.gossip[address]
                    if isinstance(msg, GossipFollow):
                        reply = await service.handle_follow(msg)
                    else:
                        reply = await service.handle_request(msg)
                    self.tensor_bytes += _nbytes(reply)
                    await self._cross(reply)
                    return reply
        except Refused as e:
            raise TransportError(e.code, e.message) from None
        except TimeoutError:
            raise TransportError("timeout", address) from None
        raise AssertionError(msg)


def _nbytes(msg: Message) -> int:
    return sum(t.numel() * t.element_size() for t in msg.tensors.values())


# ---- ring all-reduce -------------------------------------------------------------------


def test_chunk_bounds_uneven() -> None:
    assert chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_ring_schedule_covers_every_chunk() -> None:
    n = 5
    for rank in range(n):
        steps = ring_steps(rank, n)
        assert len(steps) == 2 * (n - 1)
        # what I receive in a step is what my left neighbour sends in the same step
        left = ring_steps((rank - 1) % n, n)
        assert [s[3] for s in steps] == [s[2] for s in left]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("numel", [1, 7, 23])
async def test_ring_mean_is_exact(n: int, numel: int) -> None:
    net = Net()
    members = [Hop(1, f"p{i}", f"a{i}") for i in range(n)]
    for m in members:
        net.rings[m.address] = RingAllReduce(net, MonotonicClock(), m.peer_id, step_timeout_s=2.0)
    gen = torch.Generator().manual_seed(n * 100 + numel)
    data = [torch.randn(numel, generator=gen) for _ in range(n)]
    results = await asyncio.gather(
        *(
            net.rings[m.address].allreduce("r1", members, d)
            for m, d in zip(members, data, strict=True)
        )
    )
    expected = torch.stack(data).mean(0)
    for r in results:
        assert torch.allclose(r, expected, atol=1e-6)
    for d, orig in zip(
        data,
        [torch.randn(numel, generator=torch.Generator().manual_seed(n * 100 + numel))],
        strict=False,
    ):
        assert torch.equal(d, orig)  # inputs untouched


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
async def test_ring_side_values_are_averaged_exactly_beside_an_int8_tensor(n: int) -> None:
    """Each member's side values (the daemon's schedule places) come back as the members'
    mean, in fp64, while the tensor travels as int8: hand-computed, places 10, 20, ... 10 n
    (and 1e9 + k, which a float32 would round) average to 5 (n + 1) and 1e9 + (n - 1) / 2."""
    net = Net()
    members = [Hop(1, f"p{i}", f"a{i}") for i in range(n)]
    for m in members:
        net.rings[m.address] = RingAllReduce(net, MonotonicClock(), m.peer_id, codec="int8")
    results = await asyncio.gather(
        *(
            net.rings[m.address].allreduce_with_side(
                "r", members, torch.full((300,), float(k)), [10.0 * (k + 1), 1e9 + k]
            )
            for k, m in enumerate(members)
        )
    )
    for mean, side in results:
        assert torch.allclose(mean, torch.full((300,), (n - 1) / 2), atol=0.05)
        assert side == [5.0 * (n + 1), 1e9 + (n - 1) / 2]


async def test_ring_members_that_chose_different_codecs_still_agree_on_the_mean() -> None:
    """With ``sync.codec = auto`` each member encodes its chunks in the codec its own uplink
    allows; a receiver decodes whatever a chunk declares, so a ring of fp32, bf16 and int8
    members still computes the mean (values 0, 1, 2: mean 1, within int8's step)."""
    net = Net()
    codecs = ["fp32", "bf16", "int8"]
    members = [Hop(1, f"p{i}", f"a{i}") for i in range(3)]
    for m, codec in zip(members, codecs, strict=True):
        net.rings[m.address] = RingAllReduce(net, MonotonicClock(), m.peer_id, codec=codec)
    results = await asyncio.gather(
        *(
            net.rings[m.address].allreduce("r", members, torch.full((300,), float(k)))
            for k, m in enumerate(members)
        )
    )
    for mean in results:
        assert torch.allclose(mean, torch.ones(300), atol=0.02)


async def test_a_ring_member_without_side_values_leaves_every_member_without_a_mean() -> None:
    """One member of four sends no side values (an older node, or one that shares no
    schedule place): the tensor's mean is still exact, and nobody takes a side mean made
    of three members' values as the stage's."""
    net = Net()
    members = [Hop(1, f"p{i}", f"a{i}") for i in range(4)]
    for m in members:
        net.rings[m.address] = RingAllReduce(net, MonotonicClock(), m.peer_id)
    results = await asyncio.gather(
        *(
            net.rings[m.address].allreduce_with_side(
                "r", members, torch.full((9,), float(k)), [] if k == 2 else [float(k)]
            )
            for k, m in enumerate(members)
        )
    )
    for mean, side in results:
        assert torch.equal(mean, torch.full((9,), 1.5))
        assert side is None


def test_a_ring_chunk_with_bad_side_values_is_refused_when_decoded() -> None:
    from protocol.messages import MAX_RING_SIDE, decode_message, encode_message

    def wire(side: list[float]) -> bytes:
        return b"".join(encode_message(RingChunk("r", "h", "reduce", 0, {}, tensors={}, side=side)))

    got = decode_message(wire([1.0, 2.0]))
    assert isinstance(got, RingChunk) and got.side == [1.0, 2.0]
    for side in ([float("nan")], [float("inf")], [0.0] * (MAX_RING_SIDE + 1)):
        with pytest.raises(MalformedMessage, match="side values"):
            decode_message(wire(side))


async def test_ring_member_dead_mid_round_fails_everyone_within_timeout() -> None:
    net = Net()
    members = [Hop(1, f"p{i}", f"a{i}") for i in range(4)]
    for m in members:
        net.rings[m.address] = RingAllReduce(net, MonotonicClock(), m.peer_id, step_timeout_s=0.5)
    net.dead.add("a2")
    live = [m for m in members if m.address != "a2"]
    results = await asyncio.gather(
        *(net.rings[m.address].allreduce("r", members, torch.ones(8)) for m in live),
        return_exceptions=True,
    )
    assert all(isinstance(r, RingFailed) for r in results)


@pytest.mark.parametrize("allowance", [True, False])
async def test_a_ring_step_is_given_time_for_its_chunk_to_cross_a_thin_link(
    allowance: bool,
) -> None:
    """A chunk that takes longer to cross than the fixed step timeout (a large stage on a thin
    uplink) still makes the round, given its size at the slowest rate waited for; without
    that allowance every such round fails."""
    net = Net()
    net.rate_bytes_s = 40_000.0  # a 16 KB chunk (8,192 fp32 values, ring of 2): 0.4 s
    members = [Hop(1, f"p{i}", f"a{i}") for i in range(2)]
    for m in members:
        net.rings[m.address] = RingAllReduce(
            net,
            MonotonicClock(),
            m.peer_id,
            step_timeout_s=0.2,
            min_rate_bytes_s=20_000.0 if allowance else 0.0,
        )
    data = [torch.full((8192,), float(i)) for i in range(2)]
    results = await asyncio.gather(
        *(
            net.rings[m.address].allreduce("r", members, d)
            for m, d in zip(members, data, strict=True)
        ),
        return_exceptions=True,
    )
    if allowance:
        assert all(
            isinstance(r, torch.Tensor) and torch.allclose(r, torch.full((8192,), 0.5))
            for r in results
        )
    else:
        assert all(isinstance(r, RingFailed) for r in results)


async def test_ring_members_disagree() -> None:
    net = Net()
    a, b, c = (Hop(1, f"p{i}", f"a{i}") for i in range(3))
    for m in (a, b, c):
        net.rings[m.address] = RingAllReduce(net, MonotonicClock(), m.peer_id, step_timeout_s=0.5)
    results = await asyncio.gather(
        net.rings["a0"].allreduce("r", [a, b], torch.ones(4)),
        net.rings["a1"].allreduce("r", [a, b, c], torch.ones(4)),
        return_exceptions=True,
    )
    assert all(isinstance(r, RingFailed) for r in results)


def chunk(round_id: str, step: int, numel: int, members_hash: str = "h") -> RingChunk:
    tensors, meta = encode_tensor(torch.ones(numel), "fp32", name="c")
    return RingChunk(
        round_id=round_id,
        members_hash=members_hash,
        phase="reduce",
        step=step,
        meta=meta,
        tensors=tensors,
    )


async def test_ring_mailboxes_hold_a_bounded_number_of_bytes() -> None:
    ring = RingAllReduce(Net(), MonotonicClock(), "p0", max_held_bytes=1000)
    for step in range(2):  # 2 x 400 bytes wait for a round not started here
        ring.deliver(chunk("early", step, 100))
    assert ring.held_bytes == 800
    with pytest.raises(Refused) as e:
        ring.deliver(chunk("other", 0, 100))
    assert e.value.code == "ring_overload" and "sync.ring_inbox_bytes" in e.value.message
    ring.forget_stale(lambda round_id: round_id != "early")
    assert ring.held_bytes == 0
    ring.deliver(chunk("other", 0, 100))  # room again


async def test_a_finished_ring_round_holds_no_bytes() -> None:
    net = Net()
    members = [Hop(1, f"p{i}", f"a{i}") for i in range(3)]
    for m in members:
        net.rings[m.address] = RingAllReduce(
            net, MonotonicClock(), m.peer_id, step_timeout_s=2.0, max_held_bytes=1 << 20
        )
    await asyncio.gather(
        *(net.rings[m.address].allreduce("r", members, torch.ones(30)) for m in members)
    )
    assert all(r.held_bytes == 0 for r in net.rings.values())


# ---- NoLoCo matchmaking ------------------------------------------------------------------


def make_records(n: int) -> list[PeerRecord]:
    return [PeerRecord(peer_id=f"p{i}", address=f"a{i}", stage=1, ready=True) for i in range(n)]


def make_gossip(net: Net, n: int, **cfg: float) -> list[GossipService]:
    config = GossipConfig(
        **{
            "request_timeout_s": 1.0,
            "hold_s": 0.5,
            "round_deadline_s": 2.0,
            "listen_s": 0.05,
            **cfg,
        }
    )
    records = make_records(n)
    services = []
    for i, rec in enumerate(records):
        svc = GossipService(
            config,
            transport=net,
            clock=MonotonicClock(),
            rng=random.Random(i),
            self_id=rec.peer_id,
            stage=1,
            replicas=lambda me=rec.peer_id: [r for r in records if r.peer_id != me],
        )
        net.gossip[rec.address] = svc
        services.append(svc)
    return services


def contrib(i: int) -> Contribution:
    return Contribution({"phi": torch.full((3,), float(i))}, {"who": i})


async def test_two_replicas_pair_and_swap() -> None:
    net = Net()
    a, b = make_gossip(net, 2)
    ra, rb = await asyncio.gather(a.exchange(0, contrib(0)), b.exchange(0, contrib(1)))
    assert (ra.partner_id, rb.partner_id) == ("p1", "p0")
    assert ra.contribution.meta == {"who": 1} and rb.contribution.meta == {"who": 0}  # type: ignore[union-attr]


async def test_two_replicas_that_choose_each_other_pair_once() -> None:
    net = Net()
    net.delay_s = 0.05  # both proposals are in flight at once
    a, b = make_gossip(net, 2, listen_s=0.0)
    ra, rb = await asyncio.gather(a.exchange(0, contrib(0)), b.exchange(0, contrib(1)))
    assert (ra.partner_id, rb.partner_id) == ("p1", "p0")
    assert ra.contribution.meta == {"who": 1} and rb.contribution.meta == {"who": 0}  # type: ignore[union-attr]
    assert (ra.num_sent, rb.num_sent) == (1, 1)  # the smaller id sent, the other replied
    assert net.tensor_bytes == 2 * 12


@pytest.mark.parametrize("allowance", [True, False])
async def test_a_contribution_is_given_time_to_cross_a_thin_link(allowance: bool) -> None:
    """A contribution that takes longer to upload than the request timeout and the round's
    deadline (a 100 MB stage at 100 Mbit/s: 16 s each way) still pairs: the proposer's
    request and the acceptor's promise allow its size at the slowest rate waited for, and a
    promise given before the deadline is kept past it. Without the allowance both go solo."""
    net = Net()
    net.rate_bytes_s = 20_000.0  # 16 KB each way: 0.8 s up (past the deadline), 0.8 s back
    cfg = {"request_timeout_s": 0.3, "round_deadline_s": 0.5}
    a, b = make_gossip(net, 2, **cfg, min_rate_bytes_s=10_000.0 if allowance else 0.0)
    big = [Contribution({"phi": torch.full((4096,), float(i))}, {"who": i}) for i in range(2)]
    ra, rb = await asyncio.gather(a.exchange(0, big[0]), b.exchange(0, big[1]))
    if allowance:
        assert {ra.partner_id, rb.partner_id} == {"p0", "p1"}
        assert ra.contribution.meta == {"who": 1} and rb.contribution.meta == {"who": 0}  # type: ignore[union-attr]
    else:
        assert (ra.partner_id, rb.partner_id) == (None, None)


def test_a_promise_waits_for_the_upload_its_sender_announced_within_a_bound() -> None:
    """10 s plus the bytes at 10 Mbit/s; an announced upload plus 10 s where longer, up to
    ``max_upload_wait_s`` (60 s). A 2.4 MB contribution: 11.92 s allowed; announced at
    19.2 s (1 Mbit/s): 29.2 s; at 96 s (0.2 Mbit/s): 60 s; announced under the allowance,
    or not at all: the allowance. A 200 MB one (a 100 MB stage) is allowed 170 s, past the
    bound, which never shortens a wait."""
    cfg = GossipConfig()
    assert cfg.promise_s(2.4e6) == pytest.approx(11.92)
    assert cfg.promise_s(2.4e6, 1.0) == pytest.approx(11.92)
    assert cfg.promise_s(2.4e6, 19.2) == pytest.approx(29.2)
    assert cfg.promise_s(2.4e6, 96.0) == pytest.approx(60.0)
    assert cfg.promise_s(200e6, 96.0) == pytest.approx(170.0)
    assert GossipConfig(max_upload_wait_s=0.0).promise_s(2.4e6, 19.2) == pytest.approx(11.92)


@pytest.mark.parametrize("announced", [True, False])
async def test_replicas_whose_uploads_outlast_the_allowance_pair_when_they_say_so(
    announced: bool,
) -> None:
    """Links slower than ``min_rate_bytes_s``: each contribution takes 1 s to cross, the
    allowance is 0.46 s. Announced in the proposal and the promise, the partner waits 1.3 s
    for the proposer's and the proposer 2.3 s for the exchange: they pair. Unannounced, the
    promise lapses before the contribution arrives: both end solo."""
    net = Net()
    net.rate_bytes_s = 16_384.0  # a 16 KB contribution takes 1 s each way
    a, b = make_gossip(
        net, 2, request_timeout_s=0.3, round_deadline_s=0.5, min_rate_bytes_s=100_000.0
    )
    upload_s = 1.0 if announced else 0.0
    big = [
        Contribution({"phi": torch.full((4096,), float(i))}, {"who": i}, upload_s=upload_s)
        for i in range(2)
    ]
    ra, rb = await asyncio.gather(a.exchange(0, big[0]), b.exchange(0, big[1]))
    if announced:
        assert {ra.partner_id, rb.partner_id} == {"p0", "p1"}
        assert ra.contribution is not None and ra.contribution.meta == {"who": 1}
        assert rb.contribution is not None and rb.contribution.meta == {"who": 0}
    else:
        assert (ra.partner_id, rb.partner_id) == (None, None)
        assert a.num_lapsed + b.num_lapsed >= 1  # the promise (and an incoming after it)


async def test_a_partners_contribution_carries_the_upload_time_it_announced() -> None:
    """p0 announces 3 s, p1 5 s. Whichever proposes, each receives the other's contribution
    with the time its sender announced: the proposer's from its proposal, the acceptor's
    from its promise. A contribution sent in one message, with no proposal before it,
    announced nothing (0)."""
    roles = set()
    for round_ in range(6):
        net = Net()
        a, b = make_gossip(net, 2)
        a.rng, b.rng = random.Random(round_), random.Random(100 + round_)
        mine = [
            Contribution({"phi": torch.full((3,), float(i))}, {"who": i}, upload_s=s)
            for i, s in enumerate((3.0, 5.0))
        ]
        ra, rb = await asyncio.gather(a.exchange(0, mine[0]), b.exchange(0, mine[1]))
        assert ra.contribution is not None and rb.contribution is not None
        assert (ra.contribution.upload_s, rb.contribution.upload_s) == (5.0, 3.0)
        roles.add(a._sent_as_acceptor)
    assert roles == {True, False}  # p0 accepted in some rounds, proposed in others
    net = Net()
    _, b = make_gossip(net, 2, round_deadline_s=0.3)  # p0 never takes part
    b_round = asyncio.ensure_future(b.exchange(0, contrib(1)))
    await asyncio.sleep(0)
    await b.handle_request(
        GossipRequest(stage=1, round=0, sender="p0", meta={}, tensors=contrib(0).tensors)
    )
    outcome = await b_round
    assert outcome.partner_id == "p0" and outcome.contribution is not None
    assert outcome.contribution.upload_s == 0.0


async def test_a_refusal_costs_no_upload_of_the_contribution() -> None:
    # eight replicas reaching the round at once refuse each other often; only the
    # contributions of replicas that pair travel, once each
    for seed in range(3):
        net = Net()
        net.delay_s = 0.02
        services = make_gossip(net, 8, listen_s=0.01)
        for i, s in enumerate(services):
            s.rng = random.Random(seed * 10 + i)
        outcomes = await asyncio.gather(
            *(s.exchange(0, contrib(i)) for i, s in enumerate(services))
        )
        paired = [o for o in outcomes if o.partner_id is not None]
        assert sum(sum(o.refusals.values()) for o in outcomes) > 0
        assert len(paired) >= 4
        assert net.tensor_bytes == 12 * len(paired)
        assert all(o.num_sent == (o.partner_id is not None) for o in outcomes)


async def test_a_promise_whose_proposer_vanishes_lapses_and_the_round_still_pairs() -> None:
    net = Net()
    a, b, _ = make_gossip(net, 3, request_timeout_s=0.3, listen_s=0.01)
    b_round = asyncio.ensure_future(b.exchange(0, contrib(1)))
    await asyncio.sleep(0)  # b is seeking: p2 proposes, is promised, and never sends
    accept = await b.handle_request(
        GossipRequest(stage=1, round=0, sender="p2", meta={}, propose=True)
    )
    assert accept.tensors == {} and accept.meta == {}
    with pytest.raises(Refused) as info:  # promised: a contribution from another is refused
        await b.handle_request(
            GossipRequest(stage=1, round=0, sender="p0", meta={}, tensors=contrib(0).tensors)
        )
    assert info.value.code == "busy"
    ra, rb = await asyncio.gather(a.exchange(0, contrib(0)), b_round)
    assert (ra.partner_id, rb.partner_id) == ("p1", "p0")
    assert b.num_lapsed == 1


async def test_a_proposer_whose_promise_lapsed_is_refused_until_its_ban_ends() -> None:
    """Refused for ``lapse_ban_s``, in later rounds too: the wait for a promised contribution
    grows with its size, so one member must not hold round after round up that long."""
    net = Net()
    _, b = make_gossip(  # p0 never takes part: b stays seeking
        net, 2, request_timeout_s=0.2, round_deadline_s=1.0, lapse_ban_s=1.5
    )
    b_round = asyncio.ensure_future(b.exchange(0, contrib(1)))
    await asyncio.sleep(0)
    propose = GossipRequest(stage=1, round=0, sender="p9", meta={}, propose=True)
    await b.handle_request(propose)
    await asyncio.sleep(0.4)  # p9 never sends
    ban_ends = time.monotonic() + 1.5  # it lapsed 0.2 s ago: at most this
    while b._target is not None:  # b asks p0 now and then: a proposal then hears busy
        await asyncio.sleep(0.001)
    with pytest.raises(Refused) as info:
        await b.handle_request(propose)
    assert info.value.code == "lapsed" and b.num_lapsed == 1
    assert (await b_round).partner_id is None
    b_round = asyncio.ensure_future(b.exchange(1, contrib(1)))  # the next round: still refused
    await asyncio.sleep(0)
    with pytest.raises(Refused) as info:
        await b.handle_request(dataclasses.replace(propose, round=1))
    assert info.value.code == "lapsed"
    await b_round
    await asyncio.sleep(ban_ends - time.monotonic())  # the ban is over: accepted again
    b_round = asyncio.ensure_future(b.exchange(2, contrib(1)))
    await asyncio.sleep(0)
    accept = await b.handle_request(dataclasses.replace(propose, round=2))
    assert accept.meta == {}
    await b_round


async def test_replicas_that_let_each_others_promises_lapse_still_pair_unannounced() -> None:
    """Honest replicas on a thin uplink lapse too. Two that each let the other's promise
    lapse refuse each other's proposals for ``lapse_ban_s`` (live: ten minutes, no round
    paired, over a hundred refusals a round). Refused with ``lapsed``, a proposer sends its
    contribution in one request, which its partner takes without a promise: they pair, at
    the cost of one proposal each, and nobody is held up waiting."""
    net = Net()
    a, b = make_gossip(net, 2, request_timeout_s=0.2, round_deadline_s=1.0, lapse_ban_s=60.0)
    # round 0: each accepts the other's proposal and waits for a contribution that never comes
    for me, other in ((a, b), (b, a)):
        me_round = asyncio.ensure_future(me.exchange(0, contrib(0)))
        await asyncio.sleep(0)
        await me.handle_request(
            GossipRequest(stage=1, round=0, sender=other.self_id, meta={}, propose=True)
        )
        assert (await me_round).partner_id is None and me.num_lapsed == 1
    ra, rb = await asyncio.gather(a.exchange(1, contrib(0)), b.exchange(1, contrib(1)))
    assert (ra.partner_id, rb.partner_id) == ("p1", "p0")
    assert ra.contribution is not None and ra.contribution.meta == {"who": 1}
    assert rb.contribution is not None and rb.contribution.meta == {"who": 0}
    # each proposal was refused as lapsed at most once, and no refusal was a busy one
    assert ra.refusals.get("lapsed", 0) + rb.refusals.get("lapsed", 0) <= 2
    assert not ra.refusals.get("busy") and not rb.refusals.get("busy")


async def test_a_lapsed_proposer_whose_unannounced_contribution_is_refused_asks_no_more() -> None:
    """A replica refused as ``lapsed`` whose one-message contribution is refused too (its
    partner is promised to another) does not ask that partner again in the round."""
    net = Net()
    a, b = make_gossip(net, 2, request_timeout_s=0.2, round_deadline_s=0.8, lapse_ban_s=60.0)
    b_round = asyncio.ensure_future(b.exchange(0, contrib(1)))
    await asyncio.sleep(0)
    await b.handle_request(GossipRequest(stage=1, round=0, sender="p0", meta={}, propose=True))
    await b_round  # a's promise lapsed at b
    proposals = b.handle_request

    async def takes_proposals_only(req: GossipRequest) -> GossipReply:
        if not req.propose:  # as if b had been claimed by another replica meanwhile
            raise Refused("busy", "promised to another replica")
        return await proposals(req)

    b.handle_request = takes_proposals_only  # type: ignore[method-assign]
    net.dead.add("a0")  # and b's own proposals to a go unanswered
    b_round = asyncio.ensure_future(b.exchange(1, contrib(1)))
    ra = await a.exchange(1, contrib(0))
    await b_round
    assert ra.partner_id is None
    assert ra.num_attempts == 1 and ra.refusals == {"lapsed": 1, "busy": 1}


@pytest.mark.parametrize("thin", [0, 1])
async def test_a_proposer_whose_partner_is_sending_it_a_contribution_waits_for_it(
    thin: int,
) -> None:
    """A replica refused as ``lapsed`` uploads its contribution unannounced; its partner,
    proposing to it meanwhile, hears ``incoming`` and waits for it. Before, in one order of
    the ids the partner heard ``busy`` and proposed again and again while the upload crossed
    (live: tens of times a round); in the other it was accepted, sent its own contribution,
    and the reply carried the thin replica's a second time, beside the first."""
    net = Net()
    net.rate_bytes_s = 32_768.0  # a 16 KB contribution takes 0.5 s each way
    services = make_gossip(
        net, 2, request_timeout_s=0.3, round_deadline_s=3.0, min_rate_bytes_s=10_000.0
    )
    t, p = services[thin], services[1 - thin]
    p._lapsed[t.self_id] = time.monotonic() + 60.0  # as after a promise of t's lapsed at p
    big = [Contribution({"phi": torch.full((4096,), float(i))}, {"who": i}) for i in range(2)]
    t_round = asyncio.ensure_future(t.exchange(1, big[thin]))
    await asyncio.sleep(0.1)  # t proposed first: held at p until p reaches round 1
    rp = await p.exchange(1, big[1 - thin])
    rt = await t_round
    assert (rt.partner_id, rp.partner_id) == (p.self_id, t.self_id)
    assert rp.contribution is not None and rp.contribution.meta == {"who": thin}
    assert rt.contribution is not None and rt.contribution.meta == {"who": 1 - thin}
    assert rt.refusals == {"lapsed": 1}
    assert rp.refusals == {"incoming": 1} and rp.num_attempts == 1
    assert net.tensor_bytes == 2 * 16_384  # each contribution crossed once


async def test_an_incoming_contribution_that_never_comes_holds_a_proposer_up_once() -> None:
    """A replica that answers ``incoming`` and sends nothing holds its proposer for the time
    it says it keeps sending, at most ``max_upload_wait_s``, like a promise that lapses; for
    ``lapse_ban_s`` after, its ``incoming`` is not waited for."""
    net = Net()
    liar, p = make_gossip(
        net, 2, request_timeout_s=0.3, round_deadline_s=1.0, max_upload_wait_s=0.6
    )

    async def says_incoming(req: GossipRequest) -> GossipReply:
        return GossipReply(round=req.round, meta={}, incoming=True, upload_s=1e9)  # it is not

    liar.handle_request = says_incoming  # type: ignore[method-assign]
    t0 = time.monotonic()
    r0 = await p.exchange(0, contrib(1))
    assert time.monotonic() - t0 >= 0.6  # waited: the longest it waits for any upload
    assert r0.partner_id is None and r0.refusals == {"incoming": 1} and p.num_lapsed == 1
    t0 = time.monotonic()
    r1 = await p.exchange(1, contrib(1))
    assert time.monotonic() - t0 < 0.25  # not waited for: nobody left to ask, solo at once
    assert r1.partner_id is None and r1.refusals == {"incoming": 1} and r1.num_attempts == 1
    assert p.num_lapsed == 1


async def test_odd_replica_out_goes_solo_and_nobody_deadlocks() -> None:
    for seed in range(5):
        net = Net()
        net.delay_s = 0.01
        services = make_gossip(net, 3)
        for i, s in enumerate(services):
            s.rng = random.Random(seed * 10 + i)
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(s.exchange(0, contrib(i)) for i, s in enumerate(services))), 10
        )
        partners = {f"p{i}": o.partner_id for i, o in enumerate(outcomes)}
        paired = {k: v for k, v in partners.items() if v is not None}
        for k, v in paired.items():
            assert partners[v] == k  # symmetric pairs only
        assert len(paired) in (0, 2)


async def test_partner_dead_mid_exchange_means_solo() -> None:
    net = Net()
    a, b = make_gossip(net, 2)
    net.dead.add("a1")
    out = await a.exchange(0, contrib(0))
    assert out.partner_id is None and out.refusals == {"timeout": 1}


async def test_a_partner_that_does_not_know_us_yet_is_introduced_to_and_asked_again() -> None:
    net = Net()
    a, b = make_gossip(net, 2)
    net.strangers["a1"] = {"p0"}
    out = await a.exchange(0, contrib(0))  # no way to say hello: refused, solo
    assert out.partner_id is None and out.refusals == {"unknown_peer": 1}

    net = Net()
    a, b = make_gossip(net, 2)
    net.strangers = {"a1": {"p0"}, "a0": {"p1"}}  # neither has heard of the other
    hellos: list[tuple[str, str]] = []

    def introducer(me: str) -> Callable[[str], Awaitable[bool]]:
        async def introduce(address: str) -> bool:
            hellos.append((me, address))
            net.strangers[address].discard(me)
            return True

        return introduce

    a.transport = IntroducingTransport(net, introducer("p0"), MonotonicClock())
    b.transport = IntroducingTransport(net, introducer("p1"), MonotonicClock())
    ra, rb = await asyncio.gather(a.exchange(0, contrib(0)), b.exchange(0, contrib(1)))
    assert hellos and (ra.partner_id, rb.partner_id) == ("p1", "p0")


async def test_request_for_a_round_not_reached_is_held_until_then() -> None:
    net = Net()
    a, b = make_gossip(net, 2, hold_s=1.0)

    async def late() -> object:
        await asyncio.sleep(0.3)
        return await b.exchange(0, contrib(1))

    ra, rb = await asyncio.gather(a.exchange(0, contrib(0)), late())
    assert ra.partner_id == "p1" and rb.partner_id == "p0"  # type: ignore[attr-defined]


async def test_stale_and_busy_refusals() -> None:
    net = Net()
    a, b, c = make_gossip(net, 3)
    a.completed = 3
    with pytest.raises(Refused) as info:
        await a.handle_request(GossipRequest(stage=1, round=2, sender="p1", meta={}))
    assert info.value.code == "stale"
    with pytest.raises(Refused) as info:
        await a.handle_request(GossipRequest(stage=2, round=9, sender="p1", meta={}))
    assert info.value.code == "wrong_stage"
    with pytest.raises(Refused) as info:
        await b.handle_request(GossipRequest(stage=1, round=0, sender="p0", meta={}))
    assert info.value.code == "not_ready"


async def test_a_follower_takes_a_contribution_and_sends_none_while_the_others_pair() -> None:
    """Three replicas of which one follows: the other two pair with each other (the
    follower answers their proposals ``busy``), and the follower gets one of their
    contributions without sending its own: the wire carries two contributions for the pair
    and one for the follower, 12 bytes each."""
    net = Net()
    a, b, c = make_gossip(net, 3)
    ra, rb, rc = await asyncio.gather(
        a.exchange(0, contrib(0)), b.exchange(0, contrib(1)), c.follow(0)
    )
    assert (ra.partner_id, rb.partner_id) == ("p1", "p0")
    assert rc.partner_id in ("p0", "p1") and (rc.num_attempts, rc.num_follows) == (0, 1)
    assert rc.contribution is not None
    assert rc.contribution.meta == {"who": int(rc.partner_id[1])}
    assert net.tensor_bytes == 3 * 12
    assert a.num_followers + b.num_followers == 1 and c.completed == 0


async def test_a_contribution_can_be_followed_until_the_next_round_begins() -> None:
    """A pair that finished round 0 still answers a follower of round 0 (it keeps its
    contribution), each follower once and at most ``max_followers`` of them (``busy``
    beyond); once it is in round 1, a follower of round 0 hears ``stale`` from both and
    steps solo; a follower of round 1 that is not reached yet is held until it is."""
    net = Net()
    a, b, c, d = make_gossip(net, 4, max_followers=2)
    a.replicas = lambda: [r for r in make_records(4) if r.peer_id == "p1"]
    b.replicas = lambda: [r for r in make_records(4) if r.peer_id == "p0"]
    c.replicas = d.replicas = lambda: make_records(2)  # the pair
    await asyncio.gather(a.exchange(0, contrib(0)), b.exchange(0, contrib(1)))
    got = await a.handle_follow(GossipFollow(stage=1, round=0, sender="p2"))
    assert got.meta == {"who": 0} and torch.equal(got.tensors["phi"], torch.zeros(3))
    for sender, code in (("p2", "stale"), ("p3", None), ("p9", "busy")):
        follow = GossipFollow(stage=1, round=0, sender=sender)
        if code is None:
            await a.handle_follow(follow)
            continue
        with pytest.raises(Refused) as info:
            await a.handle_follow(follow)
        assert info.value.code == code
    assert a.num_followers == 2 and a.bytes_to_followers == 24

    await asyncio.gather(a.exchange(1, contrib(0)), b.exchange(1, contrib(1)))
    late = await d.follow(0)
    assert late.partner_id is None and late.refusals == {"stale": 2}

    async def round_2_later() -> None:
        await asyncio.sleep(0.2)
        await a.exchange(2, contrib(5))

    early, _ = await asyncio.gather(c.follow(2), round_2_later())
    # b never reaches round 2 (not_ready after its hold); a answers once it gets there
    assert early.partner_id == "p0" and early.contribution is not None
    assert early.contribution.meta == {"who": 5}


@pytest.mark.parametrize("follow_if_solo", [False, True])
async def test_a_replica_that_finds_every_partner_paired_can_follow_instead(
    follow_if_solo: bool,
) -> None:
    """The fat pair finishes its round before the third replica seeks it: both answer its
    proposals ``stale`` and it would step solo. With ``follow_if_solo`` it follows one of
    them instead: their contribution, nothing more of its own on the wire (the pair's two
    and the one it downloads), and it still answers a follower of its round meanwhile."""
    net = Net()
    a, b, c = make_gossip(net, 3)
    ra, rb = await asyncio.gather(a.exchange(0, contrib(0)), b.exchange(0, contrib(1)))
    assert (ra.partner_id, rb.partner_id) == ("p1", "p0")
    rc = await c.exchange(0, contrib(2), follow_if_solo)
    assert rc.refusals.get("stale") == 2 and rc.num_attempts == 2 and rc.num_sent == 0
    if not follow_if_solo:
        assert rc.partner_id is None and not rc.followed and net.tensor_bytes == 2 * 12
        return
    assert rc.followed and rc.partner_id in ("p0", "p1") and rc.num_follows == 1
    assert rc.contribution is not None
    assert rc.contribution.meta == {"who": int(rc.partner_id[1])}
    assert net.tensor_bytes == 3 * 12 and a.num_followers + b.num_followers == 1
    got = await c.handle_follow(GossipFollow(stage=1, round=0, sender="p9"))
    assert got.meta == {"who": 2}


async def test_a_follower_offers_nothing_in_its_round() -> None:
    """While it follows (its partners unreachable here), a replica answers a proposal
    ``busy`` and a follower ``stale``, saying it follows, after a round it exchanged in as
    well as in its first; its round ends solo at the deadline."""
    net = Net()
    a, b, c = make_gossip(net, 3, round_deadline_s=1.0, request_timeout_s=0.3)
    net.dead = {"a0", "a1"}
    before = await c.exchange(0, contrib(2))  # a round sought and over: nothing left open
    assert before.partner_id is None
    following = asyncio.ensure_future(c.follow(1))
    await asyncio.sleep(0.05)
    for request, code, says in (
        (GossipRequest(stage=1, round=1, sender="p0", meta={}, propose=True), "busy", "follow"),
        (GossipFollow(stage=1, round=1, sender="p1"), "stale", "no contribution"),
    ):
        with pytest.raises(Refused) as info:
            handler = c.handle_follow if isinstance(request, GossipFollow) else c.handle_request
            await handler(request)  # type: ignore[arg-type]
        assert info.value.code == code and says in info.value.message
    outcome = await following
    assert outcome.partner_id is None and outcome.refusals.get("timeout", 0) >= 2


async def test_many_rounds_many_replicas_always_terminate() -> None:
    net = Net()
    services = make_gossip(net, 6)
    num_paired = 0
    for r in range(5):
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(s.exchange(r, contrib(i)) for i, s in enumerate(services))), 15
        )
        partners = {f"p{i}": o.partner_id for i, o in enumerate(outcomes)}
        for k, v in partners.items():
            if v is not None:
                assert partners[v] == k
        num_paired += sum(v is not None for v in partners.values())
    assert num_paired >= 0.6 * 5 * 6  # even when all start at once, most replicas pair
