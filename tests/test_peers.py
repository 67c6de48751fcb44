"""Peer table: versions, direct and relayed records, tombstones, with explicit ``now``."""

from protocol.messages import PeerRecord
from swarm.peers import NEW, NEWER, Neighbourhood, PeerTable


def rec(
    pid: str, stage: int = 1, ready: bool = True, version: int = 1, inc: int = 1, **kw: object
) -> PeerRecord:
    return PeerRecord(
        peer_id=pid,
        address=f"10.0.0.1:{7000 + len(pid)}",
        stage=stage,
        ready=ready,
        incarnation=inc,
        version=version,
        **kw,  # type: ignore[arg-type]
    )


def test_observe_new_newer_and_ignores_self_and_older() -> None:
    t = PeerTable("me", ttl_s=10)
    assert t.observe(rec("me"), 0.0) is None and len(t) == 0
    assert t.observe(rec("a", step=1), 0.0) == NEW
    assert t.observe(rec("a", step=2), 1.0) is None  # same version: nothing new
    assert t.observe(rec("a", version=3, step=5), 2.0) == NEWER
    assert t.observe(rec("a", version=2, step=9), 3.0) is None  # news never goes backwards
    assert t.get("a").step == 5 and t.incarnation("a") == 1  # type: ignore[union-attr]
    assert t.age_s("a", 4.0) == 2.0
    # a higher incarnation outranks any version of a lower one
    assert t.observe(rec("a", inc=2, version=1, step=11), 5.0) == NEWER
    assert t.observe(rec("a", inc=1, version=99), 6.0) is None


def test_a_tombstone_stops_its_incarnation_until_the_peer_speaks_or_answers() -> None:
    t = PeerTable("me", ttl_s=10, grave_s=30)
    t.observe(rec("a", inc=4, version=2), 0.0)
    assert t.bury("a", 4, 1.0) is True and "a" not in t and t.grave("a") == 4
    assert t.bury("a", 4, 1.5) is False  # not news twice
    assert t.observe(rec("a", inc=4, version=9), 2.0) is None  # relayed, same incarnation
    assert t.observe(rec("a", inc=5), 3.0) == NEW  # it answered the report of its death
    t.bury("a", 5, 4.0)
    assert t.observe(rec("a", inc=5), 5.0, direct=True) == NEW  # it spoke to us itself
    # from itself, figures of the moment in the same record: taken, but not news
    assert t.observe(rec("a", inc=5, step=42), 6.0, direct=True) is None
    assert t.get("a").step == 42  # type: ignore[union-attr]
    assert t.observe(rec("a", inc=5, step=43), 7.0) is None
    assert t.get("a").step == 42  # type: ignore[union-attr]


def test_an_obituary_buries_newer_versions_but_not_a_newer_incarnation() -> None:
    t = PeerTable("me", ttl_s=10)
    t.observe(rec("a", inc=3, version=7), 0.0)
    assert t.bury("a", 3, 1.0) is True  # the prober held version 5: still this incarnation
    t.observe(rec("b", inc=4), 0.0)
    assert t.bury("b", 3, 1.0) is False and "b" in t  # b answered since


def test_graves_are_forgotten_after_grave_s() -> None:
    t = PeerTable("me", ttl_s=10, grave_s=30)
    t.bury("a", 3, 0.0)  # news of a death we never held is kept too, and passed on
    t.forget_graves(29.0)
    assert t.grave("a") == 3
    t.forget_graves(31.0)
    assert t.grave("a") is None and t.observe(rec("a", version=3), 32.0) == NEW


def test_a_leaving_peer_is_marked_but_never_added() -> None:
    t = PeerTable("me", ttl_s=10)
    assert t.observe(rec("a", leaving=True), 0.0) is None and "a" not in t
    t.observe(rec("b"), 0.0)
    assert t.observe(rec("b", version=2, leaving=True), 1.0) == NEWER
    assert t.replicas(1) == []


def test_replicas_and_stage_counts() -> None:
    t = PeerTable("me", ttl_s=10)
    t.observe(rec("a", stage=1), 0.0)
    t.observe(rec("b", stage=1, ready=False), 0.0)
    t.observe(rec("c", stage=2), 0.0)
    t.observe(rec("c", stage=2, version=2, leaving=True), 0.0)
    t.observe(rec("d", stage=-1, ready=False), 0.0)
    assert [r.peer_id for r in t.replicas(1)] == ["a"]
    assert {r.peer_id for r in t.replicas(1, ready_only=False)} == {"a", "b"}
    assert t.replicas(2) == []
    assert t.stage_counts(4) == {0: 0, 1: 2, 2: 0, 3: 0}
    assert t.stage_counts(4, extra=[3]) == {0: 0, 1: 2, 2: 0, 3: 1}


def test_a_full_table_ignores_new_peers_but_keeps_updating_known_ones() -> None:
    t = PeerTable("me", ttl_s=10, max_peers=2)
    assert t.observe(rec("a"), now=0.0) and t.observe(rec("b"), now=0.0)
    assert t.observe(rec("c"), now=1.0) is None and "c" not in t
    assert t.num_refused_full == 1
    t.observe(rec("a", version=2, step=7), now=2.0)
    assert t.get("a").step == 7  # type: ignore[union-attr]
    t.bury("b", 1, now=3.0)
    assert t.observe(rec("c"), now=4.0) == NEW


def test_a_relay_cannot_move_a_peer_we_hear_from_directly() -> None:
    t = PeerTable("me", ttl_s=10)
    t.observe(rec("a"), now=0.0, direct=True)  # a itself, at its real address
    real = t.get("a").address  # type: ignore[union-attr]
    fake = PeerRecord("a", "6.6.6.6:1", 1, ready=True, step=9, incarnation=1, version=2)
    t.observe(fake, now=1.0)
    got = t.get("a")
    assert got is not None and got.address == real and got.step == 9  # news, not the address
    # once a's own word is older than the TTL, relays are all we have
    t.observe(PeerRecord("a", "6.6.6.6:1", 1, ready=True, incarnation=1, version=3), now=10.5)
    assert t.get("a").address == "6.6.6.6:1"  # type: ignore[union-attr]
    t.heard_from("a", now=11.0)  # it answered a ping at the address we hold
    t.observe(PeerRecord("a", "7.7.7.7:1", 1, incarnation=1, version=4), now=12.0)
    assert t.get("a").address == "6.6.6.6:1"  # type: ignore[union-attr]


def test_a_neighbourhood_is_the_stages_within_its_radius_on_the_ring() -> None:
    eight = Neighbourhood(8)
    # stage 0 is the head: its neighbours are the first block stage and the last
    assert [s for s in range(8) if eight.covers(0, s)] == [0, 1, 7]
    assert [s for s in range(8) if eight.covers(4, s)] == [3, 4, 5]
    assert [s for s in range(8) if Neighbourhood(8, radius=2).covers(7, s)] == [0, 1, 5, 6, 7]
    assert all(eight.covers(-1, s) for s in range(8))  # no stage yet: everything
    assert eight.covers(3, -1)  # a peer with no stage yet is held by everyone
    assert [s for s in range(3) if Neighbourhood(3).covers(1, s)] == [0, 1, 2]


def test_a_table_holds_its_neighbourhood_and_drops_a_peer_that_moves_away() -> None:
    t = PeerTable("me", ttl_s=10, scope=Neighbourhood(8))
    t.set_stage(4)
    assert t.observe(rec("near", stage=5), 0.0) == NEW
    assert t.observe(rec("far", stage=1), 0.0) is None and "far" not in t
    assert t.observe(rec("new", stage=-1), 0.0) == NEW  # no stage yet
    # news that a held peer moved out of the neighbourhood: dropped, and news to pass on
    assert t.observe(rec("near", stage=6, version=2), 1.0) == NEWER and "near" not in t
    assert t.num_moved_away == 1 and t.grave("near") is None  # not buried: it lives on
    # an older record of it (still travelling) does not bring it back; a newer one does
    assert t.observe(rec("near", stage=5, version=1), 2.0) is None and "near" not in t
    assert t.observe(rec("near", stage=3, version=3), 3.0) == NEW and t.get("near").stage == 3  # type: ignore[union-attr]
    # moving ourselves: what the new neighbourhood does not cover goes
    t.observe(rec("five", stage=5), 4.0)
    t.set_stage(2)
    assert sorted(r.peer_id for r in t.records()) == ["near", "new"]
    assert t.covers(1) and not t.covers(5) and t.covers(5, own=4)


def test_stand_ins_share_a_summarised_stage_s_throughput_among_its_ready_replicas() -> None:
    from protocol.messages import StageSummary
    from swarm.peers import stand_ins

    made = stand_ins(StageSummary(3, 3, 2, 10.0, 40, 7.0, "10.0.0.1:1"))
    assert [(r.peer_id, r.stage, r.ready, r.throughput, r.step) for r in made] == [
        ("~3.0", 3, True, 5.0, 40),
        ("~3.1", 3, True, 5.0, 40),
        ("~3.2", 3, False, 0.0, 40),
    ]
    assert not any(r.movable or r.address for r in made)  # never moved, never dialled
    assert stand_ins(StageSummary(2, 0, 0, 0.0, 0, 0.0)) == []
