"""Peer table: observation, relayed ages, expiry with explicit ``now``, tombstones."""

from protocol.messages import PeerRecord
from swarm.peers import PeerTable


def rec(pid: str, stage: int = 1, ready: bool = True, **kw: object) -> PeerRecord:
    return PeerRecord(
        peer_id=pid, address=f"10.0.0.1:{7000 + len(pid)}", stage=stage, ready=ready, **kw
    )  # type: ignore[arg-type]


def test_observe_new_and_ignores_self() -> None:
    t = PeerTable("me", ttl_s=10)
    assert t.observe(rec("a"), now=0.0) is True
    assert t.observe(rec("a"), now=1.0) is False
    assert t.observe(rec("me"), now=1.0) is False
    assert len(t) == 1 and "a" in t and "me" not in t


def test_expiry_uses_last_seen() -> None:
    t = PeerTable("me", ttl_s=10)
    t.observe(rec("a"), now=0.0)
    t.observe(rec("b"), now=5.0)
    assert t.expire(now=10.0) == []
    assert t.expire(now=10.5) == ["a"]
    assert t.expire(now=15.5) == ["b"]
    assert len(t) == 0


def test_relayed_age_cannot_refresh_a_fresher_entry() -> None:
    t = PeerTable("me", ttl_s=10)
    t.observe(rec("a", step=5), now=100.0)
    # a relay that heard of "a" 4 s ago is older news than ours: keep ours
    t.observe(rec("a", step=3), now=101.0, age_s=4.0)
    assert t.get("a").step == 5  # type: ignore[union-attr]
    assert t.age_s("a", now=101.0) == 1.0
    # fresher relayed news replaces the record and its time
    t.observe(rec("a", step=9), now=103.0, age_s=0.5)
    assert t.get("a").step == 9  # type: ignore[union-attr]
    assert t.age_s("a", now=103.0) == 0.5


def test_relayed_record_older_than_ttl_is_ignored() -> None:
    t = PeerTable("me", ttl_s=10)
    assert t.observe(rec("a"), now=100.0, age_s=11.0) is False
    assert "a" not in t


def test_relays_keep_no_one_alive_forever() -> None:
    # two tables relaying to each other: "a" stops heartbeating at t=0
    x, y = PeerTable("x", ttl_s=5), PeerTable("y", ttl_s=5)
    x.observe(rec("a"), now=0.0)
    for now in range(1, 12):
        for r in x.for_exchange(float(now)):
            y.observe(r, float(now), r.age_s)
        for r in y.for_exchange(float(now)):
            x.observe(r, float(now), r.age_s)
        x.expire(float(now))
        y.expire(float(now))
    assert "a" not in x and "a" not in y


def test_leave_tombstone_blocks_stale_relays() -> None:
    t = PeerTable("me", ttl_s=10)
    t.observe(rec("a"), now=0.0)
    assert t.remove("a", now=5.0) is True
    assert t.observe(rec("a"), now=6.0, age_s=2.0) is False  # heard at 4.0, before it left
    assert t.observe(rec("a"), now=7.0) is True  # it came back: direct contact after leaving


def test_a_leaver_draining_or_relayed_does_not_come_back() -> None:
    t = PeerTable("me", ttl_s=60)
    t.observe(rec("a"), now=0.0)
    t.remove("a", now=5.0)
    # while it drains it still answers heartbeats, saying it is leaving
    assert t.observe(rec("a", leaving=True), now=5.5) is False
    # a relay dated after the goodbye (transit time) is not proof it came back
    assert t.observe(rec("a"), now=6.0, age_s=0.5, relayed=True) is False
    assert "a" not in t
    assert t.observe(rec("a"), now=7.0) is True


def test_a_leaving_peer_is_marked_but_never_added() -> None:
    t = PeerTable("me", ttl_s=60)
    assert t.observe(rec("b", leaving=True), now=0.0) is False
    assert "b" not in t
    t.observe(rec("a"), now=0.0)
    t.observe(rec("a", leaving=True), now=1.0)
    assert t.get("a") is not None and t.get("a").leaving


def test_replicas_and_stage_counts() -> None:
    t = PeerTable("me", ttl_s=10)
    t.observe(rec("a", stage=1), 0.0)
    t.observe(rec("b", stage=1, ready=False), 0.0)
    t.observe(rec("c", stage=2), 0.0)
    t.observe(rec("c", stage=2, leaving=True), 0.0)
    t.observe(rec("d", stage=-1, ready=False), 0.0)
    assert [r.peer_id for r in t.replicas(1)] == ["a"]
    assert {r.peer_id for r in t.replicas(1, ready_only=False)} == {"a", "b"}
    assert t.replicas(2) == []
    assert t.stage_counts(4) == {0: 0, 1: 2, 2: 0, 3: 0}
    assert t.stage_counts(4, extra=[3]) == {0: 0, 1: 2, 2: 0, 3: 1}


def test_a_full_table_ignores_new_peers_but_keeps_refreshing_known_ones() -> None:
    t = PeerTable("me", ttl_s=10, max_peers=2)
    assert t.observe(rec("a"), now=0.0) and t.observe(rec("b"), now=0.0)
    assert t.observe(rec("c"), now=1.0) is False and "c" not in t
    assert t.num_refused_full == 1
    t.observe(rec("a", step=7), now=2.0)
    assert t.get("a").step == 7 and t.age_s("a", 2.0) == 0.0
    t.remove("b", now=3.0)
    assert t.observe(rec("c"), now=4.0) is True


def test_a_relay_cannot_move_a_peer_we_hear_from_directly() -> None:
    t = PeerTable("me", ttl_s=10)
    t.observe(rec("a"), now=0.0)  # a itself, at its real address
    real = t.get("a").address  # type: ignore[union-attr]
    fake = PeerRecord(peer_id="a", address="6.6.6.6:1", stage=1, ready=True, step=9)
    t.observe(fake, now=1.0, age_s=0.0, relayed=True)
    got = t.get("a")
    assert got is not None and got.address == real and got.step == 9  # news, not the address
    # once a's own heartbeats are older than the TTL, relays are all we have
    t.observe(fake, now=10.5, age_s=0.0, relayed=True)
    assert t.get("a").address == "6.6.6.6:1"  # type: ignore[union-attr]
    # a peer only ever heard of through relays can be moved by them (a restart elsewhere)
    t.observe(PeerRecord(peer_id="b", address="10.0.0.2:1", stage=1), now=11.0, relayed=True)
    t.observe(PeerRecord(peer_id="b", address="10.0.0.3:1", stage=1), now=12.0, relayed=True)
    assert t.get("b").address == "10.0.0.3:1"  # type: ignore[union-attr]
