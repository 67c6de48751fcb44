"""Membership on the simulated network in virtual time (``swarm.simnet``): joining, news,
probes and burials, leaving, false alarms, partitions, the swarm filter, and what it costs."""

from __future__ import annotations

import asyncio
import random
import statistics
from dataclasses import replace

import pytest

from protocol.messages import Hello, Obituary, PeerRecord, Ping, Probe, StageSummary
from swarm import membership
from swarm.membership import (
    EXCHANGE_BYTES,
    LOST_FORGET_S,
    LOST_RETRY_MAX_S,
    RECORD_BYTES,
    STAGE_CLOCK_HOLD_S,
    MembershipConfig,
    MembershipService,
)
from swarm.peers import Neighbourhood, PeerTable
from swarm.seams import Refused
from swarm.simnet import SimClock, SimNet


def make(
    net: SimNet,
    i: int,
    swarm: str = "s",
    fp: str = "f",
    stage: int | None = None,
    scope: Neighbourhood | None = None,
) -> MembershipService:
    address = f"10.0.0.{i}:7070"
    record = PeerRecord(
        peer_id=f"p{i}", address=address, stage=i % 3 if stage is None else stage, ready=True
    )
    svc = MembershipService(
        MembershipConfig(ttl_s=5.0, fanout=3),
        swarm=swarm,
        fingerprint=fp,
        table=PeerTable(record.peer_id, 5.0, scope=scope),
        transport=net.transport(address),
        clock=net.clock,
        self_record=lambda: record,
        rng=random.Random(i),
    )
    net.nodes[address] = svc
    return svc


class Swarm:
    """Services running their heartbeats on a simulated network, in virtual time."""

    def __init__(self, latency_s: float = 0.01) -> None:
        self.clock = SimClock()
        self.net = SimNet(self.clock, latency_s)
        self.running: dict[str, asyncio.Task[None]] = {}

    def add(self, i: int, **kwargs: object) -> MembershipService:
        svc = make(self.net, i, **kwargs)  # type: ignore[arg-type]
        self.running[svc.self_record().address] = asyncio.ensure_future(svc.run())
        return svc

    def kill(self, svc: MembershipService) -> None:
        address = svc.self_record().address
        self.running.pop(address).cancel()
        del self.net.nodes[address]

    async def run_for(self, seconds: float) -> None:
        await self.clock.run_until(self.clock.t + seconds)

    async def close(self) -> None:
        for task in self.running.values():
            task.cancel()
        await asyncio.gather(*self.running.values(), return_exceptions=True)


async def joined(n: int, **kwargs: object) -> tuple[Swarm, list[MembershipService]]:
    sw = Swarm(**kwargs)  # type: ignore[arg-type]
    nodes = [sw.add(i) for i in range(n)]
    for node in nodes[1:]:
        node.add_bootstrap(["10.0.0.0:7070"])
    await sw.run_for(4.0)
    return sw, nodes


async def test_one_contact_is_enough_to_learn_the_whole_swarm() -> None:
    sw, nodes = await joined(8)
    for node in nodes:
        assert len(node.table) == 7, node.self_record().peer_id
    await sw.close()


async def test_a_crashed_peer_is_buried_everywhere_within_ttl_and_five_seconds() -> None:
    sw, nodes = await joined(6)
    for node in nodes:
        node.config = replace(node.config, ttl_s=8.0)  # the default, which the target is for
    sw.kill(nodes[5])  # without a word
    start = sw.clock.t
    while any("p5" in n.table for n in nodes[:5]):
        await sw.run_for(0.1)
        assert sw.clock.t - start < 8.0 + 5.0, "still in a table"
    assert sw.clock.t - start > 8.0  # not before a prober missed it for ttl_s
    assert sum(n.num_buried for n in nodes[:5]) >= 1
    await sw.run_for(5.0)
    assert all(len(n.table) == 4 for n in nodes[:5])
    await sw.close()


async def test_a_silent_host_is_buried_when_ttl_has_passed_not_a_probe_later() -> None:
    # a host that vanished without a word (pings time out, and so do probes through
    # others): each prober that buries it does so ttl_s after its first miss, to within a
    # ping's latency; before, it waited for a whole probe to fail past the deadline
    sw, nodes = await joined(6)
    for node in nodes:
        node.config = replace(node.config, ttl_s=8.0)
    for victim in nodes[3:]:
        sw.kill(victim)
        peer_id = victim.table.self_id
        since: dict[str, float] = {}
        gone: dict[str, float] = {}
        alive = [n for n in nodes if n.self_record().address in sw.net.nodes]
        burials = {n.table.self_id: n.num_buried for n in alive}
        while any(peer_id in n.table for n in alive):
            await sw.run_for(0.05)
            for n in alive:
                me = n.table.self_id
                if peer_id in n._missing:
                    since.setdefault(me, n._missing[peer_id])
                if peer_id not in n.table and me not in gone:
                    gone[me] = sw.clock.t
        buried = [n.table.self_id for n in alive if n.num_buried > burials[n.table.self_id]]
        assert buried, (since, gone)
        for me in buried:  # gone at ttl_s after the first miss (0.05 s steps, 2 latencies)
            assert 8.0 <= gone[me] - since[me] <= 8.0 + 0.1, (me, since[me], gone[me])
        await sw.run_for(10.0)  # obituaries settle before the next death
    await sw.close()


async def test_each_member_hears_from_the_one_before_it_every_few_rounds() -> None:
    # twelve members of one stage: with round-robin pings alone two members may not speak
    # for two whole passes (22 rounds); a watcher pings the next member on the ring of ids
    # once they have not spoken for 1.5 rounds, so a death is first missed within ~2.7 s
    sw = Swarm()
    nodes = [sw.add(i, stage=0) for i in range(12)]
    for node in nodes[1:]:
        node.add_bootstrap(["10.0.0.0:7070"])
    spoke: dict[frozenset[str], list[float]] = {}
    for node in nodes:
        transport = node.transport
        request = transport.request

        async def logged(address, msg, timeout_s, peer_id="", request=request, node=node):
            reply = await request(address, msg, timeout_s, peer_id)
            if isinstance(msg, Ping) and peer_id:
                spoke.setdefault(frozenset((node.table.self_id, peer_id)), []).append(sw.clock.t)
            return reply

        transport.request = logged  # type: ignore[method-assign]
    await sw.run_for(5.0)
    start = sw.clock.t
    await sw.run_for(30.0)
    ring = sorted(n.table.self_id for n in nodes)
    for before, watched in zip(ring, ring[1:] + ring[:1], strict=True):
        pair = spoke.get(frozenset((before, watched)), [])
        times = [start, *sorted(t for t in pair if t >= start), sw.clock.t]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert max(gaps) <= 1.5 + 1.2 + 0.1, (before, watched, gaps)
    await sw.close()


async def test_a_slow_path_is_not_a_death_when_others_reach_the_peer() -> None:
    sw, nodes = await joined(5)
    a, b = nodes[0], nodes[4]
    real = sw.net.reachable
    sw.net.reachable = lambda src, dst: (
        real(src, dst)
        and {src, dst}
        != {  # type: ignore[method-assign]
            a.self_record().address,
            b.self_record().address,
        }
    )
    await sw.run_for(30.0)
    assert "p4" in a.table and "p0" in b.table and a.num_buried == 0
    await sw.close()


async def test_leave_removes_at_once_and_stays_removed() -> None:
    sw, nodes = await joined(4)
    leaving = asyncio.ensure_future(nodes[3].leave_all(timeout_s=1.0))
    await sw.run_for(0.5)
    await leaving
    sw.kill(nodes[3])
    for node in nodes[:3]:
        assert "p3" not in node.table
    await sw.run_for(20.0)
    for node in nodes[:3]:
        assert "p3" not in node.table
    await sw.close()


async def test_news_of_a_change_reaches_every_table_in_two_seconds() -> None:
    sw, nodes = await joined(12)
    for node in nodes:
        node.config = MembershipConfig(ttl_s=5.0)  # the default fanout, 8
    mover = nodes[7]
    record = mover.self_record()
    mover.self_record = lambda: replace(record, stage=9)  # type: ignore[method-assign]
    await sw.run_for(2.0)  # the next round publishes it, the push spreads it at once
    for node in nodes:
        if node is not mover:
            assert node.table.get("p7").stage == 9  # type: ignore[union-attr]
    await sw.close()


async def test_a_false_alarm_is_answered_and_the_peer_returns_everywhere() -> None:
    sw, nodes = await joined(6)
    victim = nodes[2]
    incarnation = victim.own().incarnation
    ping = Ping(sender="p0", deaths=[Obituary("p2", incarnation)])
    nodes[1].handle_ping(ping)  # a member says p2 is gone
    await sw.run_for(0.2)
    assert any("p2" not in n.table for n in nodes if n is not victim)
    await sw.run_for(3.0)
    assert victim.own().incarnation > incarnation
    assert all("p2" in n.table for n in nodes if n is not victim)
    await sw.close()


async def test_strangers_pings_and_probes_of_non_members_are_refused() -> None:
    sw, nodes = await joined(3)
    with pytest.raises(Refused) as info:
        nodes[0].handle_ping(Ping(sender="stranger", news=[PeerRecord("x", "1.2.3.4:1", 1)]))
    assert info.value.code == "unknown_peer" and "x" not in nodes[0].table
    with pytest.raises(Refused) as info:
        await nodes[0].handle_probe(Probe(sender="p1", target="somebody-else"))
    assert info.value.code == "unknown_target"
    await sw.close()


async def test_other_swarm_or_model_is_refused() -> None:
    sw = Swarm()
    a = sw.add(0)
    b = sw.add(1, swarm="other")
    c = sw.add(2, fp="different-model")
    b.add_bootstrap(["10.0.0.0:7070"])
    c.add_bootstrap(["10.0.0.0:7070"])
    await sw.run_for(3.0)
    assert len(a.table) == 0 and len(b.table) == 0 and len(c.table) == 0
    with pytest.raises(Refused) as info:
        a.handle_hello(
            Hello(swarm="other", fingerprint="f", sender=b.self_record(), peers=[]), "10.0.0.1"
        )
    assert info.value.code == "wrong_swarm"
    await sw.close()


async def test_unreachable_bootstrap_is_retried_until_it_appears() -> None:
    sw = Swarm()
    b = sw.add(1)
    b.add_bootstrap(["10.0.0.0:7070"])
    await sw.run_for(10.0)
    assert len(b.table) == 0
    a = sw.add(0)
    await sw.run_for(2.0)
    assert "p0" in b.table and "p1" in a.table
    await sw.close()


async def test_the_two_sides_of_a_healed_partition_find_each_other_again() -> None:
    # Discovery by sightings alone (zeroconf reports a peer once): after the partition each
    # side has buried the other, and only the retried addresses of buried peers reconnect.
    sw = Swarm()
    nodes = [sw.add(i) for i in range(6)]
    for node in nodes[1:]:
        node.add_address("10.0.0.0:7070")
    await sw.run_for(4.0)
    assert all(len(node.table) == 5 for node in nodes)
    sw.net.side = {f"10.0.0.{i}:7070": 1 for i in (3, 4, 5)}
    await sw.run_for(40.0)
    assert all(len(node.table) == 2 for node in nodes)
    sw.net.side = {}
    await sw.run_for(LOST_RETRY_MAX_S + 10)
    assert all(len(node.table) == 5 for node in nodes)
    await sw.close()


async def test_a_buried_peer_is_greeted_with_backoff_then_forgotten() -> None:
    sw = Swarm()
    a, b = sw.add(0), sw.add(1)
    b.add_bootstrap(["10.0.0.0:7070"])
    await sw.run_for(2.0)
    tries: list[float] = []
    contact = a.contact

    async def counting(address: str, introduce: bool = False, share: bool = True) -> bool:
        tries.append(sw.clock.t)
        return await contact(address, introduce, share)

    a.contact = counting  # type: ignore[method-assign]
    sw.kill(b)  # b dies for good
    await sw.run_for(LOST_FORGET_S + 100)
    # ttl_s = 5 after the first miss, then 10, 20, 30, 30...: each at the first round due
    waits = [t2 - t1 for t1, t2 in zip(tries, tries[1:], strict=False)]
    expected = [10.0, 20.0] + [30.0] * (len(waits) - 2)
    assert all(e <= w <= e + 1.3 for w, e in zip(waits, expected, strict=True)), waits[:6]
    lost_for = tries[-1] - tries[0]
    assert LOST_FORGET_S - 2 * 30 <= lost_for <= LOST_FORGET_S, lost_for
    await sw.close()


def test_refresh_interval_fits_everyones_figures_into_the_budget() -> None:
    # n = 1000 members and us, fanout 8, 4 * ceil(log10(1002)) = 16 piggybacks: a record
    # costs a node 8 pushes of (250 + 300 HTTP) bytes and 16 piggybacks of 250, in and out.
    # A table exchange costs 2 * 1001 * 250 + 300 = 500,800 bytes; a node starts one and
    # answers one every 2 * 500,800 / (0.2 * 4000) = 1252 s, 800 B/s of the 4000. So
    # 1001 * (8 * 550 + 16 * 250) * 2 / 3200 B/s = 5255.25 s.
    net = SimNet(SimClock())
    svc = make(net, 0)
    svc.config = MembershipConfig(fanout=8, budget_bytes_per_s=4000.0)
    for i in range(1, 1001):
        svc.table.observe(PeerRecord(f"q{i}", f"10.1.{i // 250}.{i % 250}:1", 1), 0.0)
    assert svc.sync_s() == pytest.approx(1252.0)
    assert svc.refresh_s() == pytest.approx(1001 * (8 * 550 + 16 * 250) * 2 / 3200.0)
    assert RECORD_BYTES == 250 and EXCHANGE_BYTES == 300
    # alone: 1 push, 4 piggybacks; an 800-byte exchange every 30 s (the floor), twice,
    # against the default 2000 B/s
    small = make(net, 1)
    assert small.sync_s() == 30.0
    assert small.refresh_s() == pytest.approx((550 + 4 * 250) * 2 / (2000.0 - 1600 / 30))


async def test_a_quiet_swarm_costs_the_same_per_node_at_any_size() -> None:
    per_node = {}
    for n in (8, 48):
        sw, nodes = await joined(n)
        await sw.run_for(20.0)  # settle: joins spread
        before = sum(sw.net.sent.values())
        await sw.run_for(30.0)
        per_node[n] = (sum(sw.net.sent.values()) - before) / n / 30.0
        await sw.close()
    assert per_node[48] < 1.5 * per_node[8], per_node
    assert per_node[48] < 2000, per_node  # a ping and its pong a second, and rare refreshes


async def test_an_obituary_of_an_older_incarnation_is_checked_at_once() -> None:
    sw, nodes = await joined(5)
    victim, holder = nodes[4], nodes[1]
    stale = victim.own().incarnation
    victim._incarnation += 1  # it answered a false alarm that `holder` heard of, others not
    victim._publish(victim.self_record(), sw.clock.t)
    holder.table.observe(victim.own(), sw.clock.t)
    assert holder.table.incarnation("p4") == stale + 1
    sw.kill(victim)
    start = sw.clock.t
    silent_s = holder.table.silent_s("p4", start)
    holder.handle_ping(Ping(sender="p0", deaths=[Obituary("p4", stale)]))
    assert "p4" in holder.table  # not on a stale word alone
    while "p4" in holder.table:
        await sw.run_for(0.1)
    # one probe round, not ttl_s more; but a ping of its own is proof of life for ttl_s
    quiet_in = 0.0 if silent_s is None else max(0.0, holder.config.ttl_s - silent_s)
    assert sw.clock.t - start < quiet_in + 5.0, (quiet_in, sw.clock.t - start)
    await sw.close()


async def test_new_relays_reach_a_member_that_hears_from_the_peer_directly() -> None:
    # relayed news may not move a peer heard from directly; its own word must bring it
    sw, nodes = await joined(4)
    mover = nodes[3]
    record = mover.self_record()
    moved = replace(record, relays=["10.9.9.9:7070"])
    mover.self_record = lambda: moved  # type: ignore[method-assign]
    await sw.run_for(6.0)
    for node in nodes[:3]:
        assert node.table.get("p3").relays == ["10.9.9.9:7070"]  # type: ignore[union-attr]
    await sw.close()


async def test_a_member_that_cannot_be_dialled_but_pings_stays_alive() -> None:
    # a node behind a NAT with no relay: nobody reaches its address, its own pings get out
    sw, nodes = await joined(4)
    for node in nodes:  # the default: a member pings each of 3 others within 6 s
        node.config = replace(node.config, ttl_s=8.0)
    natted = nodes[3].self_record().address
    real = sw.net.reachable
    sw.net.reachable = lambda src, dst: real(src, dst) and dst != natted  # type: ignore[method-assign]
    await sw.run_for(40.0)
    for node in nodes[:3]:
        assert "p3" in node.table and node.num_buried == 0
    assert nodes[3]._incarnation == 1  # never told it was gone (it would answer with 2)
    # once it stops speaking too, it is gone within ttl_s and a few rounds
    sw.kill(nodes[3])
    start = sw.clock.t
    while any("p3" in n.table for n in nodes[:3]):
        await sw.run_for(0.1)
        assert sw.clock.t - start < 8.0 + 5.0, "still in a table"
    await sw.close()


async def test_a_member_that_cannot_be_dialled_learns_of_a_join_it_missed() -> None:
    # a NATed member (nobody dials it) whose uplink drops for 4 s (less than ttl_s, so
    # nobody buries anybody) while a node joins: every push and piggyback of the join is
    # spent by then, and in a quiet swarm nothing repeats it. Its own table exchanges
    # with a member it can dial bring it.
    sw, nodes = await joined(4)
    natted = nodes[3].self_record().address
    cut = [True]
    real = sw.net.reachable
    sw.net.reachable = lambda src, dst: (  # type: ignore[method-assign]
        real(src, dst) and dst != natted and not (cut[0] and src == natted)
    )
    late = sw.add(4)
    late.add_bootstrap(["10.0.0.0:7070"])
    await sw.run_for(4.0)
    assert all("p4" in n.table for n in nodes[:3]) and "p4" not in nodes[3].table
    cut[0] = False
    start = sw.clock.t
    while "p4" not in nodes[3].table:
        await sw.run_for(0.5)
        # first exchange within one interval of starting, each later one within 1.5
        assert sw.clock.t - start < 1.5 * nodes[3].sync_s(), "never heard of the join"
    assert all(n.num_buried == 0 for n in nodes)
    await sw.close()


async def test_news_on_a_ping_that_is_not_answered_is_not_spent() -> None:
    net = SimNet(SimClock())
    svc, other = make(net, 0), make(net, 1)
    svc.table.observe(other.self_record(), 0.0)
    news = PeerRecord("q9", "10.1.0.9:1", 1)
    svc.table.observe(news, 0.0)
    svc._tell(news)
    left = svc._news["q9"].piggy_left
    del net.nodes[other.self_record().address]  # down: the ping waits out its timeout
    probe = asyncio.ensure_future(svc._probe("p1"))
    await net.clock.run_until(net.clock.t + 1.5)
    assert svc._news["q9"].piggy_left == left  # given back
    probe.cancel()
    net.nodes[other.self_record().address] = other
    answered = asyncio.ensure_future(svc._probe("p1"))
    await net.clock.run_until(net.clock.t + 1.0)
    await answered
    assert "q9" in other.table and svc._news["q9"].piggy_left == left - 1


# -- neighbourhood tables: a node holds its own stage and the two next to it ----------------

EIGHT = Neighbourhood(8)


def near(stage: int, other: int) -> bool:
    return EIGHT.covers(stage, other)


async def neighbourhoods(
    n: int, ring: Neighbourhood = EIGHT, settle_s: float = 15.0
) -> tuple[Swarm, list[MembershipService]]:
    """``n`` nodes on the ring's stages (node i on stage i % 8 with the default's 8), all
    joining through node 0 (stage 0, whose table holds stages 7, 0 and 1 only)."""
    sw = Swarm()
    nodes = [sw.add(i, stage=i % ring.num_stages, scope=ring) for i in range(n)]
    for node in nodes[1:]:
        node.add_bootstrap(["10.0.0.0:7070"])
    await sw.run_for(settle_s)
    return sw, nodes


def holds_its_neighbourhood(node: MembershipService, nodes: list[MembershipService]) -> bool:
    stage = node.self_record().stage
    expected = {
        n.table.self_id for n in nodes if n is not node and near(stage, n.self_record().stage)
    }
    return {r.peer_id for r in node.table.records()} == expected


async def test_a_neighbourhood_table_holds_its_stages_even_when_joined_through_a_far_node() -> None:
    sw, nodes = await neighbourhoods(24)
    for node in nodes:
        assert holds_its_neighbourhood(node, nodes), node.table.self_id
        assert len(node.table) == 8  # 3 stages of 3 replicas, less itself
    # and a summary of every other stage, counting its replicas right
    far = nodes[4]  # stage 4
    await sw.run_for(10.0)
    summaries = far.summaries()
    assert sorted(summaries) == list(range(8))
    for stage, summary in summaries.items():
        assert (summary.replicas, summary.ready) == (3, 3), summary
        if not near(4, stage):
            assert summary.age_s < 10.0 and summary.contact.endswith(":7070")
    await sw.close()


async def test_a_newcomer_is_known_to_its_neighbourhood_within_five_seconds_and_nowhere_else() -> (
    None
):
    sw, nodes = await neighbourhoods(24)
    newcomer = sw.add(100, stage=4, scope=EIGHT)
    newcomer.add_bootstrap(["10.0.0.0:7070"])  # stage 0: holds nothing of stage 4's
    start = sw.clock.t
    neighbours = [n for n in nodes if near(4, n.self_record().stage)]
    while not all("p100" in n.table for n in neighbours):
        await sw.run_for(0.1)
        assert sw.clock.t - start < 5.0
    await sw.run_for(5.0)
    assert holds_its_neighbourhood(newcomer, [*nodes, newcomer])
    assert not any("p100" in n.table for n in nodes if n not in neighbours)
    await sw.close()


async def test_a_death_leaves_every_table_that_held_it_within_ttl_and_five_seconds() -> None:
    sw, nodes = await neighbourhoods(24)
    for node in nodes:
        node.config = replace(node.config, ttl_s=8.0)
    sw.kill(nodes[12])  # stage 4
    start = sw.clock.t
    while any("p12" in n.table for n in nodes):
        await sw.run_for(0.1)
        assert sw.clock.t - start < 8.0 + 5.0
    # stage 0 does not hold stage 4: it hears of the death through summaries
    while nodes[0].summaries()[4].replicas != 2:
        await sw.run_for(0.5)
        assert sw.clock.t - start < 40.0, nodes[0].summaries()[4]
    await sw.close()


async def test_a_node_that_moves_leaves_its_old_neighbourhood_and_joins_the_new_one() -> None:
    sw, nodes = await neighbourhoods(24)
    mover = nodes[12]  # stage 4 -> 0
    record = replace(mover.self_record(), stage=0)
    mover.self_record = lambda: record  # type: ignore[method-assign]
    await sw.run_for(6.0)
    for node in nodes:
        if node is mover:
            continue
        assert ("p12" in node.table) == near(0, node.self_record().stage), node.table.self_id
    assert holds_its_neighbourhood(mover, nodes)
    await sw.close()


async def test_a_summary_of_a_stage_past_the_pipeline_is_not_kept() -> None:
    sw, nodes = await neighbourhoods(8)
    node = nodes[4]
    bogus = [StageSummary(stage, 5, 5, 1.0, 1, 0.0, "10.9.9.9:1") for stage in (8, 10**9)]
    node.handle_ping(Ping(sender="p3", stages=bogus))
    assert sorted(node.summaries()) == list(range(8))
    await sw.close()


async def test_a_node_does_not_greet_a_far_bootstrap_again_once_it_answered() -> None:
    sw, nodes = await neighbourhoods(16)
    for node in nodes:
        node._far_next_s = float("inf")  # its greetings of far stages for summaries aside,
        node._sync_next_s = float("inf")  # and its table exchanges
    hellos = sw.net.by_type["hello"]
    await sw.run_for(20.0)
    assert sw.net.by_type["hello"] == hellos  # every far node's bootstrap (node 0) answered
    await sw.close()


async def test_a_newcomer_its_bootstrap_knows_no_contact_for_walks_to_its_stages() -> None:
    # with many stages a far bootstrap may have no summary yet of the newcomer's stages:
    # the newcomer greets the nearest stage's contact it knows, and so on towards its own
    sixteen = Neighbourhood(16)
    sw, nodes = await neighbourhoods(48, sixteen, settle_s=60.0)
    boot = nodes[0]  # stage 0
    for stage in (7, 8, 9):  # it has heard nothing of stage 8's neighbourhood
        boot._far.pop(stage, None)
    boot._lobby.clear()
    boot._take_summaries = lambda summaries: None  # type: ignore[method-assign]  # nor will
    newcomer = sw.add(100, stage=8, scope=sixteen)
    newcomer.add_bootstrap(["10.0.0.0:7070"])
    start = sw.clock.t
    neighbours = [n for n in nodes if sixteen.covers(8, n.self_record().stage)]
    while not all("p100" in n.table for n in neighbours):
        await sw.run_for(0.1)
        assert sw.clock.t - start < 5.0, [
            n.table.self_id for n in neighbours if "p100" not in n.table
        ]
    await sw.close()


async def test_the_view_counts_held_stages_from_the_table_and_relays_the_rest() -> None:
    sw, nodes = await neighbourhoods(24)
    await sw.run_for(10.0)
    node = nodes[4]  # stage 4: holds 3, 4 and 5
    draws = node.rng.getstate()
    view = node.view()
    assert node.rng.getstate() == draws  # picks no contact: the planners' reads are free
    assert sorted(view) == list(range(8))
    for stage, summary in view.items():
        assert (summary.replicas, summary.ready) == (3, 3), summary
        if near(4, stage):
            assert summary.age_s == 0.0 and summary.contact == ""  # counted, just now
        else:
            assert summary.age_s > 0.0  # relayed
    sw.kill(nodes[13])  # stage 5, held: the view follows the table
    await sw.run_for(13.0)
    assert node.view()[5].replicas == 2
    await sw.close()


async def test_a_mover_meets_its_new_neighbourhood_before_it_serves() -> None:
    # arrive(): the daemon awaits it after taking a stage, before copying the stage's weights
    sw, nodes = await neighbourhoods(24)
    await sw.run_for(10.0)
    mover = nodes[12]  # stage 4 -> 0: held 3, 4, 5; will hold 7, 0, 1
    record = replace(mover.self_record(), stage=0)
    mover.self_record = lambda: record  # type: ignore[method-assign]
    start = sw.clock.t
    mover.own()  # centred on stage 0 now (arrive does it too), its replicas not met yet:
    assert mover._own_stage() == []  # a greeting's count would say "1 replica", and fresh
    arrived = asyncio.ensure_future(mover.arrive(10.0))
    while not arrived.done():
        await sw.run_for(0.1)
    assert arrived.result() is True
    assert sw.clock.t - start < 2.0
    assert {r.stage for r in mover.table.records()} == {7, 0, 1}
    assert mover.unmet() == []
    assert [(s.stage, s.replicas) for s in mover._own_stage()] == [(0, 4)]  # met: 3 and itself
    await sw.close()


async def test_arrive_gives_up_when_no_member_of_its_new_stages_answers() -> None:
    sw, nodes = await neighbourhoods(24)
    for dead in (nodes[7], nodes[15], nodes[23]):  # all of stage 7
        sw.kill(dead)
    await sw.run_for(30.0)  # buried everywhere
    mover = nodes[12]  # stage 4 -> 0, with an old summary still saying stage 7 has replicas
    mover._far[7] = (StageSummary(7, 3, 3, 30.0, 9, 0.0, "10.0.0.7:7070"), sw.clock.t - 40.0)
    sw.net.side[mover.self_record().address] = 1  # and cut off from everyone
    record = replace(mover.self_record(), stage=0)
    mover.self_record = lambda: record  # type: ignore[method-assign]
    arrived = asyncio.ensure_future(mover.arrive(5.0))
    while not arrived.done():
        await sw.run_for(0.1)
    assert arrived.result() is False
    assert mover.unmet() == [0, 1, 7] and mover.view()[7].replicas == 3  # relayed, not met
    sw.net.side.clear()  # the next rounds go on greeting contacts
    await sw.run_for(11.0)  # held for 2 ttl_s: its table's word stands, stage 7 is empty
    assert mover.unmet() == []
    assert [mover.view()[s].replicas for s in (7, 0, 1)] == [0, 4, 3]  # 0: itself too
    await sw.close()


async def test_a_newcomer_without_a_stage_does_not_summarise_stages_it_has_not_met() -> None:
    # it holds what its far bootstrap gave it (stages 7, 0 and 1); a summary of stage 4
    # from it would say "no replica", age 0, and win by freshness everywhere it went
    sw, nodes = await neighbourhoods(24)
    await sw.run_for(10.0)
    newcomer = sw.add(100, stage=-1, scope=EIGHT)
    newcomer.add_bootstrap(["10.0.0.0:7070"])
    await sw.run_for(3.0)
    view = newcomer.view()
    assert view[0].replicas == 3 and view[0].age_s == 0.0  # counted: met through stage 0
    assert all(s.replicas == 3 for s in view.values()), view  # the rest relayed, not zeros
    sent = newcomer._summaries_for(4, everything=True)
    assert sent and all(summary.replicas == 3 for summary in sent), sent
    await sw.close()


async def far_summaries(far_every_s: float, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Ages of 40 nodes' summaries of the stages they do not hold, 60 s after a swarm of 40
    stages formed (two nodes a stage, joined through node 0); None where missing."""
    monkeypatch.setattr(membership, "FAR_EVERY_S", far_every_s)
    ring = Neighbourhood(40)
    sw, nodes = await neighbourhoods(80, ring, settle_s=60.0)
    ages = []
    for node in nodes[:40]:
        known = node.summaries()
        stage = node.self_record().stage
        for other in range(40):
            if not ring.covers(stage, other):
                ages.append(known[other].age_s if other in known else None)
    await sw.close()
    return ages


async def test_far_greetings_spread_every_stage_summary_through_a_long_ring(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 40 stages: hop by hop, news of a stage takes a minute and more to cross the ring;
    # greeting a far stage's contact every ~30 s mixes the summaries across it
    ages = await far_summaries(30.0, monkeypatch)
    hop_by_hop = await far_summaries(float("inf"), monkeypatch)
    # every stage is known either way: node 0, everyone's bootstrap, heard each stage from
    # its first greeters and passed them on in its welcomes (hop by hop alone, before
    # greetings told of their senders' stages, left 440 of 1480 missing)
    assert ages.count(None) == 0 and hop_by_hop.count(None) == 0
    # but hop by hop they are as old as the swarm (median 60 s); with far greetings 26 s
    known = statistics.median(a for a in ages if a is not None)
    slow = statistics.median(a for a in hop_by_hop if a is not None)
    assert known < 0.6 * slow, (known, slow)


async def test_a_far_contact_that_does_not_answer_is_not_greeted_again() -> None:
    # a member that lies in its summaries (every far stage's contact an outsider's address,
    # always the freshest) gets one greeting sent there, not one every FAR_EVERY_S
    sw, nodes = await neighbourhoods(24)
    node = nodes[4]  # stage 4: holds 3, 4 and 5
    outsider = "10.9.9.9:1"
    greeted: list[float] = []
    request = node.transport.request

    async def logged(address, msg, timeout_s, peer_id=""):  # type: ignore[no-untyped-def]
        if address == outsider:
            greeted.append(sw.clock.t)
        return await request(address, msg, timeout_s, peer_id)

    node.transport.request = logged  # type: ignore[method-assign]
    lies = [StageSummary(s, 9, 9, 1.0, 1, 0.0, outsider) for s in (0, 1, 2, 6, 7)]
    node._far_next_s = sw.clock.t
    for _ in range(150):
        node.handle_ping(Ping(sender="p3", stages=lies))
        await sw.run_for(1.0)
    assert len(greeted) == 1, greeted
    # while honest contacts keep answering: its summaries of far stages stay fresh
    await sw.run_for(5.0)
    assert max(s.age_s for s in node.summaries().values()) < 60.0
    await sw.close()


async def test_a_stage_with_no_neighbour_is_seen_by_its_far_bootstrap_and_when_it_is_ready() -> (
    None
):
    # a swarm's first replica of stage 2 of 0-3: the head holds 3, 0 and 1, the newcomer 1,
    # 2 and 3, and nobody holds both; no member relays stage 2's summary, so the head (every
    # joiner's bootstrap, which reads its view to choose a stage) must hear it from the
    # greetings the newcomer sends it while it holds nobody
    four = Neighbourhood(4)
    sw = Swarm()
    head = sw.add(0, stage=0, scope=four)
    record = PeerRecord(peer_id="p2", address="10.0.0.2:7070", stage=2, ready=False)
    newcomer = make(sw.net, 2, stage=2, scope=four)
    newcomer.self_record = lambda: record  # type: ignore[method-assign]
    sw.running[record.address] = asyncio.ensure_future(newcomer.run())
    newcomer.add_bootstrap([head.self_record().address])
    await sw.run_for(3.0)
    assert "p2" not in head.table  # not its neighbourhood: no record, a summary
    seen = head.view()[2]
    assert (seen.replicas, seen.ready) == (1, 0), seen
    record = replace(record, ready=True, throughput=5.0)  # it serves now
    start = sw.clock.t
    while head.view()[2].ready != 1:
        await sw.run_for(0.1)
        assert sw.clock.t - start < 2.0, head.view()[2]
    assert head.view()[2].throughput == 5.0
    assert head.summaries()[2].contact == record.address  # a joiner of stage 1 or 3 greets it
    # if it dies while nobody else holds stage 2, the head's summary of it ages but stands
    # (a summary is not dropped for its age: in a long ring that would leave gaps); the next
    # node on stage 1 or 3 holds stage 2, finds it empty and says so
    sw.kill(newcomer)
    await sw.run_for(10.0)
    assert head.view()[2].replicas == 1 and head.view()[2].age_s > 9.0
    sw.add(1, stage=1, scope=four).add_bootstrap([head.self_record().address])
    start = sw.clock.t
    while head.view()[2].replicas != 0:
        await sw.run_for(0.5)
        assert sw.clock.t - start < 2 * 5.0 + 5.0, head.view()[2]
    await sw.close()


async def test_a_greeting_tells_of_its_senders_own_stage_only() -> None:
    # a summary in a greeting is the greeter's word on its own stage; what it says of others
    # (any contact, always fresh) is not taken, so a stranger cannot steer joiners with it
    sw, nodes = await neighbourhoods(8)
    head = nodes[0]  # holds 7, 0 and 1
    sender = PeerRecord(peer_id="p99", address="10.0.0.99:7070", stage=4, ready=True)
    lies = [StageSummary(s, 9, 9, 1.0, 1, 0.0, "10.9.9.9:1") for s in (3, 4, 5)]
    head.handle_hello(
        Hello(swarm="s", fingerprint="f", sender=sender, peers=[], stages=lies), "10.0.0.99"
    )
    view = head.view()
    # its own stage: its count is taken, not the contact it names (not itself)
    assert (view[4].replicas, view[4].contact) == (9, "")
    assert view[3].replicas == 1 and view[5].replicas == 1  # the others: as relayed before
    await sw.close()


async def test_refresh_brings_a_join_the_news_never_brought_at_once() -> None:
    """A joiner choosing its stage must see the swarm as it is: a member that missed a
    join's news (it could not be reached when it was pushed) has it after ``refresh``, long
    before its next table exchange; a member that cannot be dialled is not asked."""
    sw, nodes = await joined(4)
    natted = nodes[3].self_record().address
    cut = [True]
    real = sw.net.reachable
    sw.net.reachable = lambda src, dst: (  # type: ignore[method-assign]
        real(src, dst) and not (cut[0] and (src == natted or dst == natted))
    )
    late = sw.add(4)
    late.add_bootstrap(["10.0.0.0:7070"])
    await sw.run_for(3.0)
    assert "p4" not in nodes[3].table
    cut[0] = False
    refreshing = asyncio.ensure_future(nodes[3].refresh())
    await sw.run_for(0.1)  # virtual time: a few round trips of 10 ms
    assert refreshing.done() and refreshing.result()
    assert "p4" in nodes[3].table  # its next table exchange is due in sync_s (30 s)
    await sw.close()


class Skewed:
    """A simulated node's clock ``skew_s`` off the others' wall time."""

    def __init__(self, clock: SimClock, skew_s: float) -> None:
        self.clock, self.skew_s = clock, skew_s

    def now(self) -> float:
        return self.clock.now()

    def wall(self) -> float:
        return self.clock.wall() + self.skew_s

    async def sleep(self, seconds: float) -> None:
        await self.clock.sleep(seconds)


async def test_pings_measure_each_members_clock_and_the_stage_reads_the_median() -> None:
    """Four replicas of stage 1, one with its clock 30 s ahead, 10 ms each way: within a
    few heartbeats every member has measured the others on its pings; the three right
    clocks read their own time as the stage's (to the millisecond the pongs carry) and the
    wrong one reads 30 s back."""
    sw = Swarm(latency_s=0.01)
    nodes = [sw.add(i, stage=1) for i in range(4)]
    nodes[3].clock = Skewed(sw.clock, 30.0)
    for node in nodes[1:]:
        node.add_bootstrap(["10.0.0.0:7070"])
    await sw.run_for(15.0)
    for node in nodes[:3]:
        assert node.stage_offset_s(1) == pytest.approx(0.0, abs=2e-3), node.clocks._samples
        assert node.clocks.offset_s("p3", sw.clock.now()) == pytest.approx(30.0, abs=0.011)
    assert nodes[3].stage_offset_s(1) == pytest.approx(-30.0, abs=0.011)
    await sw.close()


async def test_a_replica_that_drops_out_still_counts_in_the_stage_clock_a_while() -> None:
    """Two replicas of stage 1, the second's clock 30 s ahead, and a head: each replica
    reads the stage's clock halfway, 15 s off its own. When the second stalls (nothing
    reaches it, so it is buried after ttl_s), the first's stage clock does not jump back to
    its own for ``STAGE_CLOCK_HOLD_S`` (an outer round 15 s ahead, then a wait to restart
    the rounds, for a partner back a few seconds later); past it, it does. One that says
    goodbye stops counting at once."""
    sw = Swarm(latency_s=0.01)
    head, right, ahead = (sw.add(i, stage=stage) for i, stage in ((0, 0), (1, 1), (2, 1)))
    ahead.clock = Skewed(sw.clock, 30.0)
    for node in (right, ahead):
        node.add_bootstrap(["10.0.0.0:7070"])
    await sw.run_for(15.0)
    assert right.stage_offset_s(1) == pytest.approx(15.0, abs=0.02)
    assert ahead.stage_offset_s(1) == pytest.approx(-15.0, abs=0.02)
    sw.kill(ahead)
    for _ in range(int(STAGE_CLOCK_HOLD_S) - 5):  # the daemon reads it every second or so
        await sw.run_for(1.0)
        assert right.stage_offset_s(1) == pytest.approx(15.0, abs=0.02)
    assert "p2" not in right.table  # buried long since (ttl_s = 5), at about 5 s
    await sw.run_for(15.0)  # 70 s after the kill: the hold counts from the burial
    assert right.stage_offset_s(1) == 0.0

    late = sw.add(3, stage=1)  # a new replica on the right clock, then it says goodbye
    late.clock = Skewed(sw.clock, 30.0)
    late.add_bootstrap(["10.0.0.0:7070"])
    await sw.run_for(15.0)
    assert right.stage_offset_s(1) == pytest.approx(15.0, abs=0.02)
    leaving = asyncio.ensure_future(late.leave_all(timeout_s=1.0))
    await sw.run_for(1.0)
    assert leaving.done()
    sw.kill(late)  # as the daemon does after its goodbyes
    assert "p3" not in right.table
    assert right.stage_offset_s(1) == 0.0
    await sw.close()


async def test_a_bootstrap_that_refuses_or_is_silent_is_reported_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A volunteer greeting a node of another swarm, and an address nobody listens at, is
    told each once (its bootstrap is greeted again every round); when the silent one comes
    up it says so."""
    import logging

    caplog.set_level(logging.INFO, logger="swarm.membership")
    sw = Swarm()
    other = sw.add(0, swarm="elsewhere")
    me = sw.add(1)
    me.add_bootstrap([other.self_record().address, "10.0.0.2:7070"])
    await sw.run_for(5.0)
    warnings = {r.getMessage() for r in caplog.records if r.levelno == logging.WARNING}
    assert warnings == {
        "bootstrap 10.0.0.0:7070: refused us (wrong_swarm: this node is in swarm 'elsewhere'"
        " with model f; you are in 's' with f); greeting it again every round",
        "bootstrap 10.0.0.2:7070: did not answer (timeout: 10.0.0.2:7070 did not answer in"
        " 3 s); greeting it again every round",
    }
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2  # once each
    assert other.self_record().peer_id not in me.table
    sw.add(2)
    await sw.run_for(3.0)
    assert "bootstrap 10.0.0.2:7070 answered" in caplog.text and "p2" in me.table
    await sw.close()
