"""Membership on an in-memory network with a fake clock: exchange, expiry, leave, swarm filter."""

from __future__ import annotations

import random

import pytest

from protocol.messages import Ack, Hello, Leave, Message, PeerRecord
from swarm.membership import (
    LOST_FORGET_S,
    LOST_RETRY_MAX_S,
    MembershipConfig,
    MembershipService,
)
from swarm.peers import PeerTable
from swarm.seams import Refused, TransportError


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += seconds


class FakeNet:
    """Addresses map to services; an address not present, or on another side, is unreachable."""

    def __init__(self) -> None:
        self.nodes: dict[str, MembershipService] = {}
        self.side: dict[str, int] = {}  # a partition: addresses on different sides (default 0)

    def transport(self, source: str) -> FakeTransport:
        return FakeTransport(self, source)


class FakeTransport:
    def __init__(self, net: FakeNet, source: str) -> None:
        self.net, self.source = net, source

    async def request(
        self, address: str, msg: Message, timeout_s: float, peer_id: str = ""
    ) -> Message:
        target = self.net.nodes.get(address)
        side = self.net.side
        if (
            target is None
            or self.source not in self.net.nodes
            or side.get(self.source, 0) != side.get(address, 0)
        ):
            raise TransportError("unreachable", address)
        try:
            if isinstance(msg, Hello):
                return target.handle_hello(msg, self.source.split(":")[0])
            if isinstance(msg, Leave):
                target.handle_leave(msg)
                return Ack()
        except Refused as e:
            raise TransportError(e.code, e.message) from None
        raise AssertionError(msg)


def make(
    net: FakeNet, clock: FakeClock, i: int, swarm: str = "s", fp: str = "f"
) -> MembershipService:
    address = f"10.0.0.{i}:7070"
    record = PeerRecord(peer_id=f"p{i}", address=address, stage=i % 3, ready=True)
    svc = MembershipService(
        MembershipConfig(ttl_s=5.0, fanout=3),
        swarm=swarm,
        fingerprint=fp,
        table=PeerTable(record.peer_id, 5.0),
        transport=net.transport(address),
        clock=clock,
        self_record=lambda: record,
        rng=random.Random(i),
    )
    net.nodes[address] = svc
    return svc


async def rounds(nodes: list[MembershipService], clock: FakeClock, n: int) -> None:
    for _ in range(n):
        for node in nodes:
            await node.round()
        clock.t += 1.0


async def test_one_contact_is_enough_to_learn_the_whole_swarm() -> None:
    net, clock = FakeNet(), FakeClock()
    nodes = [make(net, clock, i) for i in range(8)]
    for node in nodes[1:]:
        node.add_bootstrap(["10.0.0.0:7070"])
    await rounds(nodes, clock, 4)
    for node in nodes:
        assert len(node.table) == 7, node.self_record().peer_id


async def test_silent_peer_expires_everywhere() -> None:
    net, clock = FakeNet(), FakeClock()
    nodes = [make(net, clock, i) for i in range(5)]
    for node in nodes[1:]:
        node.add_bootstrap(["10.0.0.0:7070"])
    await rounds(nodes, clock, 3)
    del net.nodes["10.0.0.4:7070"]  # crashes without a word
    await rounds(nodes[:4], clock, 8)
    for node in nodes[:4]:
        assert "p4" not in node.table
        assert len(node.table) == 3


async def test_leave_removes_at_once_and_stays_removed() -> None:
    net, clock = FakeNet(), FakeClock()
    nodes = [make(net, clock, i) for i in range(4)]
    for node in nodes[1:]:
        node.add_bootstrap(["10.0.0.0:7070"])
    await rounds(nodes, clock, 3)
    await nodes[3].leave_all(timeout_s=1.0)
    del net.nodes["10.0.0.3:7070"]
    for node in nodes[:3]:
        assert "p3" not in node.table
    await rounds(nodes[:3], clock, 2)
    for node in nodes[:3]:
        assert "p3" not in node.table


async def test_other_swarm_or_model_is_refused() -> None:
    net, clock = FakeNet(), FakeClock()
    a = make(net, clock, 0)
    b = make(net, clock, 1, swarm="other")
    c = make(net, clock, 2, fp="different-model")
    b.add_bootstrap(["10.0.0.0:7070"])
    c.add_bootstrap(["10.0.0.0:7070"])
    await rounds([a, b, c], clock, 3)
    assert len(a.table) == 0 and len(b.table) == 0 and len(c.table) == 0
    with pytest.raises(Refused) as info:
        a.handle_hello(
            Hello(swarm="other", fingerprint="f", sender=b.self_record(), peers=[]), "10.0.0.1"
        )
    assert info.value.code == "wrong_swarm"


async def test_unreachable_bootstrap_is_retried_until_it_appears() -> None:
    net, clock = FakeNet(), FakeClock()
    b = make(net, clock, 1)
    b.add_bootstrap(["10.0.0.0:7070"])
    await rounds([b], clock, 2)
    assert len(b.table) == 0
    a = make(net, clock, 0)
    await rounds([a, b], clock, 1)
    assert "p0" in b.table and "p1" in a.table


async def test_the_two_sides_of_a_healed_partition_find_each_other_again() -> None:
    # Discovery by sightings alone (zeroconf reports a peer once): after the partition each
    # side has expired the other, and only the retried addresses of expired peers reconnect.
    net, clock = FakeNet(), FakeClock()
    nodes = [make(net, clock, i) for i in range(6)]
    for node in nodes[1:]:
        node.add_address("10.0.0.0:7070")
    await rounds(nodes, clock, 4)
    assert all(len(node.table) == 5 for node in nodes)
    net.side = {f"10.0.0.{i}:7070": 1 for i in (3, 4, 5)}
    await rounds(nodes, clock, 40)
    assert all(len(node.table) == 2 for node in nodes)
    net.side = {}
    await rounds(nodes, clock, int(LOST_RETRY_MAX_S) + 3)
    assert all(len(node.table) == 5 for node in nodes)


async def test_an_expired_peer_is_retried_with_backoff_then_forgotten() -> None:
    net, clock = FakeNet(), FakeClock()
    a, b = make(net, clock, 0), make(net, clock, 1)
    b.add_bootstrap(["10.0.0.0:7070"])
    await rounds([a, b], clock, 2)
    del net.nodes["10.0.0.1:7070"]  # b dies for good
    tries: list[float] = []
    contact = a.contact

    async def counting(address: str) -> bool:
        tries.append(clock.t)
        return await contact(address)

    a.contact = counting  # type: ignore[method-assign]
    await rounds([a], clock, int(LOST_FORGET_S) + 100)
    waits = [t2 - t1 for t1, t2 in zip(tries, tries[1:], strict=False)]
    retries = waits[waits.index(6.0) :]  # heartbeats each second, then expiry after ttl_s = 5
    assert retries[:4] == [6.0, 10.0, 20.0, 30.0] and set(retries[4:]) == {30.0}, retries[:6]
    lost_for = tries[-1] - tries[len(waits) - len(retries)]
    assert LOST_FORGET_S - 30 <= lost_for <= LOST_FORGET_S, lost_for
