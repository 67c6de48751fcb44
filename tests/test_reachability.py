"""Reachability known from peers: real nodes dial each other back over HTTP on loopback."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from node.config import resolve_config
from node.daemon import Node
from node.display import format_status
from protocol.messages import DialBack

pytestmark = pytest.mark.timeout(60)

SETTINGS = {"net.listen": "127.0.0.1:0", "net.zeroconf": False, "balance.benchmark_s": 0}


@pytest.fixture
async def nodes() -> AsyncIterator[Callable[..., Any]]:
    started: list[Node] = []

    async def make(**settings: Any) -> Node:
        node = Node(resolve_config(overrides={**SETTINGS, **settings}))
        await node.start_server()
        started.append(node)
        return node

    yield make
    for node in started:
        await node.close()


def introduce(*nodes: Node) -> None:
    for me in nodes:
        for other in nodes:
            if other is not me:
                me.table.observe(other.record(), me.clock.now())


async def test_a_node_peers_can_dial_is_direct(nodes: Any) -> None:
    a, b = await nodes(), await nodes()
    assert a.reachability.state == "unknown"
    assert await a.reachability.check() == "unknown"  # nobody to ask yet
    introduce(a, b)
    assert await a.reachability.check() == "direct"
    st = a.status()["reachability"]
    assert st["state"] == "direct" and st["checked_by"] == [b.peer_id] and st["advice"] == ""
    assert "reachability: direct" in format_status(a.status())


async def test_an_address_nobody_can_open_is_unreachable_and_avoided(nodes: Any) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    a, b = await nodes(), await nodes()
    a.state.address = f"127.0.0.1:{closed}"  # what it announces: its real port is closed to us
    introduce(a, b)
    assert await a.reachability.check() == "unreachable"
    st = a.status()["reachability"]
    assert "did not accept a connection" in st["detail"]
    assert f"forward TCP port {closed}" in st["advice"]
    assert b.router.stats[a.peer_id].banned_until > b.clock.now()  # b routes nothing to it
    text = format_status(a.status())
    assert "reachability: unreachable" in text and "forward TCP port" in text


async def test_a_node_announcing_another_host_than_it_connects_from_is_told(nodes: Any) -> None:
    a, b = await nodes(), await nodes()
    introduce(a, b)
    port = a.state.address.rsplit(":", 1)[1]
    a.state.address = f"192.168.7.2:{port}"  # a private address behind a home router
    assert await a.reachability.check() == "unreachable"
    assert "behind a NAT" in a.status()["reachability"]["detail"]


async def test_a_dial_back_goes_only_to_the_asking_host(nodes: Any) -> None:
    """Nobody can make a node connect elsewhere: the address's host must be the asker's."""
    b = await nodes()
    result = await b.reachability.on_dial_back(
        DialBack(address="10.9.9.9:80", nonce="n", sender="x" * 16), peer_host="127.0.0.1"
    )
    assert not result.reached and result.observed_host == "127.0.0.1"
    assert "behind a NAT" in result.detail


async def test_an_unreachable_node_with_no_relay_takes_no_stage(nodes: Any) -> None:
    import asyncio

    a = await nodes(**{"net.reachability_retry_s": 0.2})
    b = await nodes(**{"net.relay_capacity": 0})  # relays for nobody
    introduce(a, b)
    port = a.state.address.rsplit(":", 1)[1]
    a.state.address = f"192.168.7.2:{port}"
    waiting = asyncio.ensure_future(a.reachability.until_servable(lambda: None))
    await asyncio.sleep(1.0)
    assert not waiting.done() and a.state.stage == -1  # still refusing to take one
    a.state.address = f"127.0.0.1:{port}"  # the volunteer fixed it (an --announce, a port)
    await asyncio.wait_for(waiting, 10)
    assert a.reachability.state == "direct"


async def test_an_unreachable_node_serves_through_a_peer_that_relays(nodes: Any) -> None:
    a = await nodes(**{"net.reachability_retry_s": 0.2})
    b = await nodes()  # relays by default
    introduce(a, b)
    port = a.state.address.rsplit(":", 1)[1]
    a.state.address = f"192.168.7.2:{port}"
    await a.reachability.until_servable(lambda: None)
    st = a.status()
    assert st["reachability"]["state"] == "relayed"
    assert st["reachability"]["detail"] == f"via {b.state.address}"
    assert "goes through a relay" in st["reachability"]["advice"]
    assert a.record().relays == [b.state.address] and a.record().relay_slots == 0
    assert "reachability: relayed" in format_status(st)


async def test_a_peer_that_does_not_answer_says_nothing_about_us(nodes: Any) -> None:
    """A dead peer still in the table (it has not expired yet) must not make a node think
    it is unreachable: that would keep it from taking a stage for nothing."""
    from protocol.messages import PeerRecord

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    a = await nodes()
    a.table.observe(PeerRecord(peer_id="d" * 16, address=dead, stage=1, ready=True), 0.0)
    assert await a.reachability.check() == "unknown"
    assert "did not answer" in a.status()["reachability"]["detail"]


def dead_address() -> str:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


async def test_a_check_nobody_answers_leaves_the_last_verdict(nodes: Any) -> None:
    """A NATed node whose peers stop answering is still behind its NAT: taking ``unknown``
    for news would let it take a stage nobody can reach, and stop looking for a relay."""
    from protocol.messages import PeerRecord

    a, b = await nodes(), await nodes()
    introduce(a, b)
    port = a.state.address.rsplit(":", 1)[1]
    a.state.address = f"192.168.7.2:{port}"
    assert await a.reachability.check() == "unreachable"
    a.table.bury(b.peer_id, b.record().incarnation, a.clock.now())
    a.table.observe(
        PeerRecord(peer_id="d" * 16, address=dead_address(), stage=1, ready=True), a.clock.now()
    )
    assert [p.peer_id for p in a.table.records()] == ["d" * 16]
    assert await a.reachability.check() == "unreachable"
    assert "behind a NAT" in a.status()["reachability"]["detail"]
    a.state.address = f"127.0.0.1:{port}"  # a new address: the old verdict says nothing of it
    assert await a.reachability.check() == "unknown"


async def test_peers_dialled_directly_are_asked_before_relayed_ones(nodes: Any) -> None:
    """A relayed peer refuses dial-backs, so asking one is a wasted question."""
    from protocol.messages import PeerRecord

    a, b = await nodes(), await nodes()
    introduce(a, b)
    dead = dead_address()
    for k in range(4):
        relayed = PeerRecord(peer_id=f"{k}" * 16, address=dead, stage=1, relays=[dead])
        a.table.observe(relayed, a.clock.now())
    for _ in range(6):  # b is among the two asked every time, not two times in five
        a.reachability.state = "unknown"
        assert await a.reachability.check() == "direct"
        assert a.status()["reachability"]["checked_by"] == [b.peer_id]


async def test_a_peer_that_does_not_answer_is_replaced_by_the_next(nodes: Any) -> None:
    """Volunteers who have just joined from behind NATs look direct (no relays yet) and
    nobody can reach them: asking two of them left a NATed joiner ``unknown``, and it took a
    stage announced as direct that nobody could dial (seen with four NATed joiners). A peer
    that does not answer is replaced by the next candidate."""
    from protocol.messages import PeerRecord

    a, b = await nodes(), await nodes()
    introduce(a, b)
    for k in range(4):
        silent = PeerRecord(peer_id=f"{k}" * 16, address=dead_address(), stage=-1)
        a.table.observe(silent, a.clock.now())
    for _ in range(6):  # b answers every time, not two times in five
        a.reachability.state = "unknown"
        assert await a.reachability.check() == "direct"
        assert a.status()["reachability"]["checked_by"] == [b.peer_id]
        assert not a.reachability.unanswered


async def test_a_joining_node_nobody_answers_asks_again_before_it_serves(nodes: Any) -> None:
    """Peers known but none answering is not the first node's "nobody to ask": the join
    waits and asks again (here a peer that answers comes meanwhile), and serves unverified
    only after ``UNANSWERED_TRIES`` checks."""
    import asyncio

    from node.services.reachability import UNANSWERED_TRIES
    from protocol.messages import PeerRecord

    a = await nodes(**{"net.reachability_retry_s": 0.3})
    b = await nodes()
    silent = PeerRecord(peer_id="d" * 16, address=dead_address(), stage=-1)
    a.table.observe(silent, a.clock.now())
    waiting = asyncio.ensure_future(a.reachability.until_servable(lambda: None))
    while not a.reachability.unanswered:
        await asyncio.sleep(0.01)
    assert not waiting.done()  # an unanswered check does not let it serve
    introduce(a, b)
    await asyncio.wait_for(waiting, 10)
    assert a.reachability.state == "direct"

    c = await nodes(**{"net.reachability_retry_s": 0.1})
    c.table.observe(silent, c.clock.now())
    t0 = asyncio.get_running_loop().time()
    await asyncio.wait_for(c.reachability.until_servable(lambda: None), 10)
    assert c.reachability.state == "unknown" and c.reachability.unanswered
    assert asyncio.get_running_loop().time() - t0 >= 0.1 * (UNANSWERED_TRIES - 1)


async def test_a_public_node_whose_only_peer_is_natted_is_verified_once_it_attaches(
    nodes: Any,
) -> None:
    """A public node started together with NATed joiners knows only them, and nobody can
    reach them: its check goes unanswered. Before, a relayed peer refused every dial-back
    (its asker's host was only the relay's word), so the node served unverified after
    ``UNANSWERED_TRIES`` checks (about 10 s), and a joiner could take its stage meanwhile.
    Now the joiner that attaches to it wakes its check at once, is asked first, and dials
    back the host it connected to. A dial-back passed on by a relay is still refused."""
    import asyncio

    from node.services.reachability import RECHECK_UNANSWERED_S
    from protocol.messages import Error, decode_message, encode_message

    p = await nodes()  # public
    n = await nodes(**{"net.reachability_retry_s": 0.2})
    port = n.state.address.rsplit(":", 1)[1]
    n.state.address = f"127.0.0.9:{port}"  # announced, and nothing listens there: NATed
    introduce(p, n)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    public = asyncio.ensure_future(p.reachability.until_servable(lambda: None))
    while not p.reachability.unanswered:  # it asked the joiner, who cannot be reached
        await asyncio.sleep(0.01)
    await n.reachability.until_servable(lambda: None)
    assert n.reachability.state == "relayed" and p.relay_hub.attached(n.peer_id)
    await asyncio.wait_for(public, RECHECK_UNANSWERED_S)
    assert p.reachability.state == "direct", p.status()["reachability"]
    assert p.status()["reachability"]["checked_by"] == [n.peer_id]
    assert loop.time() - t0 < RECHECK_UNANSWERED_S  # woken by the attach, not the timer

    # a dial-back another peer sends through the relay: its host is the relay's word
    ask = DialBack(address="127.0.0.1:9", nonce="ab" * 4, sender=p.peer_id)
    frame = b"".join(bytes(b) for b in encode_message(ask))
    status, _, reply = await n.server.serve_relayed(None, frame, "127.0.0.1", firsthand=False)
    refused = decode_message(reply)
    assert status == 400 and isinstance(refused, Error) and refused.code == "relayed"


async def test_the_first_node_is_verified_by_the_first_natted_peer_that_attaches(
    nodes: Any,
) -> None:
    """The swarm's first node has nobody to ask and serves at once, ``unknown``; it used to
    check again only every ``RECHECK_UNKNOWN_S`` (30 s), and a NATed peer could not answer
    even then. Now the first peer that attaches to it makes a check due, and answers it."""
    p = await nodes()
    await p.reachability.until_servable(lambda: None)  # nobody to ask: at once
    assert p.reachability.state == "unknown" and not p.reachability.unanswered
    n = await nodes(**{"net.reachability_retry_s": 0.2})
    port = n.state.address.rsplit(":", 1)[1]
    n.state.address = f"127.0.0.9:{port}"  # NATed
    introduce(p, n)
    assert not p.reachability.due(p.state.address)  # a peer came, but not 30 s ago
    await n.reachability.until_servable(lambda: None)
    assert n.reachability.state == "relayed" and p.reachability.due(p.state.address)
    await p.reachability.keep()
    assert p.reachability.state == "direct"
    assert p.status()["reachability"]["checked_by"] == [n.peer_id]


def test_peers_are_asked_in_waves_of_one_standing() -> None:
    """By hand: standing 0 (attached to this node), 1 (spoke to it), 2 (the rest); six
    peers at most, two at once, and never a likely one in a wave with an unlikely one."""
    from node.services.reachability import MAX_ASKED, NUM_ASKED, asking_waves
    from protocol.messages import PeerRecord

    assert (MAX_ASKED, NUM_ASKED) == (6, 2)
    ranked = [
        PeerRecord(peer_id=c * 16, address=f"10.0.0.{i}:1", stage=1)
        for i, c in enumerate("abcdefgh")
    ]
    standing = dict(zip("abcdefgh", [2, 2, 0, 1, 2, 1, 2, 2], strict=True))
    waves = asking_waves(ranked, lambda p: standing[p.peer_id[0]])
    assert [[p.peer_id[0] for p in w] for w in waves] == [["c"], ["d", "f"], ["a", "b"], ["e"]]
    assert asking_waves([], lambda p: 0) == []
