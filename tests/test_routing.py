"""SWARM routing policy: weights, frequencies for a fixed seed, bans, exclusions."""

import random
from collections import Counter

import pytest

from protocol.messages import PeerRecord
from swarm.routing import RECHECK_S, PeerStats, Router, cut_weights, route_weights


def rec(pid: str, throughput: float = 0.0, queue: int = 0) -> PeerRecord:
    return PeerRecord(
        peer_id=pid, address=f"h:{pid}", stage=1, ready=True, throughput=throughput, queue=queue
    )


def test_weights_are_rate_over_work_ahead() -> None:
    peers = [rec("a", 10.0, queue=0), rec("b", 10.0, queue=4), rec("c", 30.0)]
    stats = {"c": PeerStats(num_in_flight=2)}
    assert route_weights(peers, stats, now=0.0) == pytest.approx([10.0, 2.0, 10.0])


def test_unmeasured_peer_is_probed_at_the_best_known_rate() -> None:
    assert route_weights([rec("a", 5.0), rec("new")], {}, 0.0) == [5.0, 5.0]
    assert route_weights([rec("x"), rec("y")], {}, 0.0) == [1.0, 1.0]


def test_a_far_replica_counts_its_hop_time() -> None:
    """Equal replicas, one 1 ms away and one 150 ms: 16-sample microbatches at 100 samples/s
    take 0.16 s to compute, and the far one's hop 0.149 s more, so 1/0.16 against 1/0.309
    (the near one about 66 % of draws)."""
    near, far, new = rec("near", 100.0), rec("far", 100.0), rec("new", 100.0)
    stats = {"near": PeerStats(latency_ema_s=0.001), "far": PeerStats(latency_ema_s=0.150)}
    w = route_weights([near, far, new], stats, now=0.0, samples=16.0)
    assert w == pytest.approx([1 / 0.16, 1 / 0.309, 1 / 0.16])  # the new one: shortest hop
    r = Router(random.Random(3))
    r.samples = 16.0
    for pid, trip in (("near", 0.001), ("far", 0.150)):
        r.started(pid)
        r.finished(pid, True, now=0.0, latency_s=trip)
    picks = Counter(r.choose([near, far], now=1.0).peer_id for _ in range(4000))  # type: ignore[union-attr]
    assert picks["near"] / 4000 == pytest.approx(0.309 / (0.309 + 0.16), abs=0.03)


def test_equidistant_replicas_share_by_capacity_however_far() -> None:
    """The mixed swarm of ``bench/wan.py``: a replica at 108.8 samples/s and one at 38.9,
    both 100 ms away. The hop both pay alike does not count: 0.74 and 0.26 of the draws,
    their shares of the stage's capacity (with the hop counted whole, 1/(0.147 + 0.1) against
    1/(0.411 + 0.1) would give 0.67 and 0.33)."""
    fast, slow = rec("fast", 108.8), rec("slow", 38.9)
    stats = {"fast": PeerStats(latency_ema_s=0.1), "slow": PeerStats(latency_ema_s=0.1)}
    w = route_weights([fast, slow], stats, now=0.0, samples=16.0)
    assert w == pytest.approx([108.8 / 16, 38.9 / 16])
    assert w[0] / sum(w) == pytest.approx(108.8 / (108.8 + 38.9))


def test_banned_peer_has_zero_weight_until_ban_ends() -> None:
    r = Router(random.Random(0), ban_s=10.0)
    r.started("a")
    r.finished("a", ok=False, now=100.0)
    assert route_weights([rec("a", 1.0)], r.stats, now=105.0) == [0.0]
    assert route_weights([rec("a", 1.0)], r.stats, now=110.5) == [1.0]


def test_a_failed_peer_that_speaks_to_us_is_alive_though_still_avoided() -> None:
    """A failed hop counts a peer out of the serving (recovery's liveness) unless it spoke to
    us since, or in the last ``silent_s``: the hop may have waited in our own thin uplink
    while the peer was fine. Routing still backs off from it for ``ban_s``."""
    r = Router(random.Random(0), ban_s=10.0, silent_s=2.0)
    for peer in ("slow_path", "dead"):
        r.started(peer)
        r.finished(peer, ok=False, now=100.0)
    assert r.unresponsive(100.5) == {"slow_path", "dead"}  # never heard from
    r.heard("slow_path", 102.0)  # its own forward reached us after our hop to it timed out
    r.heard("stranger", 102.0)  # a peer we never sent to is not noted at all
    assert r.unresponsive(103.0) == {"dead"} and "stranger" not in r.stats
    assert route_weights([rec("slow_path", 1.0)], r.stats, now=103.0) == [0.0]
    r.started("slow_path")
    r.finished("slow_path", ok=False, now=103.5)  # fails again; spoke 1.5 s ago
    assert r.unresponsive(104.0) == {"dead"}  # 2.0 s of silence: still counted
    assert r.unresponsive(104.5) == {"slow_path", "dead"}  # silent for longer: counted out
    r.started("slow_path")
    r.finished("slow_path", ok=True, now=106.0)  # an answer is hearing from it too
    assert r.unresponsive(109.0) == {"dead"}  # spoke after its last failure
    assert r.unresponsive(110.5) == set()  # the dead one's ban ended: the table decides now


def test_quarantined_and_avoided_peers_stay_unresponsive_whatever_they_send() -> None:
    r = Router(random.Random(0))
    r.quarantine("poisoner", now=0.0, seconds=300.0)
    r.avoid("undialable", now=0.0, seconds=60.0)
    r.heard("poisoner", 1.0)
    r.heard("undialable", 1.0)
    assert r.unresponsive(2.0) == {"poisoner", "undialable"}
    assert r.unresponsive(61.0) == {"poisoner"}


def test_equal_peers_are_chosen_uniformly() -> None:
    r = Router(random.Random(42))
    peers = [rec(p, 10.0) for p in "abcd"]
    counts = Counter(r.choose(peers, 0.0).peer_id for _ in range(8000))  # type: ignore[union-attr]
    assert set(counts) == set("abcd")
    for n in counts.values():
        assert abs(n / 8000 - 0.25) < 0.03


def test_faster_peer_gets_proportionally_more() -> None:
    r = Router(random.Random(7))
    peers = [rec("slow", 10.0), rec("fast", 30.0)]
    counts = Counter(r.choose(peers, 0.0).peer_id for _ in range(8000))  # type: ignore[union-attr]
    assert abs(counts["fast"] / 8000 - 0.75) < 0.03


def test_fixed_seed_gives_fixed_route() -> None:
    peers = [rec(p, 1.0 + i) for i, p in enumerate("abc")]
    a = [Router(random.Random(3)).choose(peers, 0.0).peer_id for _ in range(1)]  # type: ignore[union-attr]
    b = [Router(random.Random(3)).choose(peers, 0.0).peer_id for _ in range(1)]  # type: ignore[union-attr]
    assert a == b


def test_exclude_and_all_banned_fallback() -> None:
    r = Router(random.Random(0), ban_s=10.0)
    peers = [rec("a", 1.0), rec("b", 1.0)]
    assert r.choose(peers, 0.0, exclude={"a"}).peer_id == "b"  # type: ignore[union-attr]
    assert r.choose(peers, 0.0, exclude={"a", "b"}) is None
    r.finished("a", ok=False, now=0.0)
    r.finished("b", ok=False, now=1.0)
    # everyone banned: retry the one banned longest ago instead of giving up
    assert r.choose(peers, 2.0).peer_id == "a"  # type: ignore[union-attr]


def test_success_clears_failures_and_tracks_latency() -> None:
    r = Router(random.Random(0), ema=0.5)
    r.started("a")
    r.finished("a", ok=False, now=0.0)
    r.started("a")
    r.finished("a", ok=True, now=1.0, latency_s=0.2)
    r.started("a")
    r.finished("a", ok=True, now=1.0, latency_s=0.4)
    s = r.stats["a"]
    assert s.num_failures == 0 and s.num_in_flight == 0
    assert s.latency_ema_s == pytest.approx(0.3)


def test_a_replicas_ack_outranks_its_record() -> None:
    """Both records say 10 samples/s and an empty queue (a large swarm republishes them every
    few minutes or hours). a's last ack said 9 jobs queued (ours included), b's that it
    computes 40 samples/s: a weighs 10 / (1 + 9) = 1, b 40 / 1 = 40, c (no ack) 10."""
    peers = [rec("a", 10.0), rec("b", 10.0), rec("c", 10.0)]
    r = Router(random.Random(0))
    for pid, queue, rate in (("a", 9, 10.0), ("b", 0, 40.0)):
        r.started(pid)
        r.finished(pid, True, 0.0, 0.01, queue=queue, rate=rate)
    assert route_weights(peers, r.stats, now=0.0) == pytest.approx([1.0, 40.0, 10.0])
    # a failed request says nothing of the peer's figures
    r.started("c")
    r.finished("c", False, 0.0, queue=50, rate=1.0)
    assert (r.stats["c"].queue_s, r.stats["c"].rate) == (None, 0.0)


def test_an_acked_queue_drains_at_the_replicas_rate() -> None:
    """9 jobs at 10 samples/s, 2 samples a job: 5 jobs drain per second. At 0.5 s, 6.5
    left: 10 / (2 x 7.5) = 0.667; from 1.8 s on, none: 10 / 2 = 5."""
    stats = {"a": PeerStats(queue=9, queue_s=0.0, rate=10.0)}
    w = [route_weights([rec("a", 10.0)], stats, now=t, samples=2.0)[0] for t in (0.5, 1.8, 60)]
    assert w == pytest.approx([10 / 15, 5.0, 5.0])


def test_a_queue_from_an_ack_stands_in_for_the_record_only_once_said() -> None:
    stats = {"a": PeerStats(rate=20.0)}  # a rate said, no queue: the record's queue stands
    assert route_weights([rec("a", 10.0, queue=3)], stats, now=0.0) == pytest.approx([5.0])


def acked(queue: int, rate: float, at: float) -> PeerStats:
    """What a replica's acknowledgement at ``at`` told us."""
    return PeerStats(queue=queue, queue_s=at, rate=rate)


def test_the_cut_leaves_out_replicas_more_than_cutoff_times_slower_than_the_best() -> None:
    """One-sample microbatches. a: 10 samples/s, 1 job queued, so ours ends in 0.2 s; b: 10
    samples/s, 3 queued, 0.4 s (twice a's: kept, the boundary); c: 2 samples/s, idle, 0.5 s
    (2.5 times a's: left out); d: 4 samples/s, idle, 0.25 s. Cutoff 2: a, b, d drawn."""
    peers = [rec(p, 1.0) for p in "abcd"]
    stats = {
        "a": acked(1, 10.0, 0.0),
        "b": acked(3, 10.0, 0.0),
        "c": acked(0, 2.0, 0.0),
        "d": acked(0, 4.0, 0.0),
    }
    weights = route_weights(peers, stats, now=0.0)
    assert weights == pytest.approx([5.0, 2.5, 2.0, 4.0])
    finish_s = {p: 1 / w for p, w in zip("abcd", weights, strict=True)}
    # an independent statement: kept iff its time is at most cutoff x the best time
    for cutoff in (1.0, 1.25, 2.0, 2.5, 3.0):
        cut = cut_weights(peers, stats, weights, now=0.0, cutoff=cutoff)
        kept = {p for p, w in zip("abcd", cut, strict=True) if w > 0}
        best_s = min(finish_s.values())
        assert kept == {p for p, t in finish_s.items() if t <= cutoff * best_s + 1e-12}
        kept_weights = [w for p, w in zip("abcd", weights, strict=True) if p in kept]
        assert [w for w in cut if w > 0] == kept_weights
    assert cut_weights(peers, stats, weights, now=0.0, cutoff=2.0) == pytest.approx(
        [5.0, 2.5, 0.0, 4.0]
    )


def test_the_cut_off_leaves_swarms_draw_as_it_is() -> None:
    peers = [rec("a"), rec("b")]
    stats = {"a": acked(0, 100.0, 0.0), "b": acked(0, 1.0, 0.0)}
    weights = route_weights(peers, stats, now=0.0)
    assert cut_weights(peers, stats, weights, now=0.0, cutoff=0.0) == weights


def test_only_fresh_figures_leave_a_replica_out() -> None:
    """b is 10 times slower. With no acknowledgement from it (its record's figures, or the
    optimism for a stranger) it is drawn by its weight; likewise once its last one is older
    than RECHECK_S, so that a replica that sped up is found again."""
    peers = [rec("a"), rec("b", 1.0)]
    fresh = {"a": acked(0, 10.0, 0.0), "b": acked(0, 1.0, 0.0)}
    unacked = {"a": acked(0, 10.0, 0.0), "b": PeerStats()}
    for stats, now, kept in (
        (fresh, 0.0, False),
        (fresh, RECHECK_S, False),
        (fresh, RECHECK_S + 0.1, True),
        (unacked, 0.0, True),
    ):
        weights = route_weights(peers, stats, now)
        assert (cut_weights(peers, stats, weights, now, cutoff=2.0)[1] > 0) is kept


def test_a_router_with_a_cutoff_never_draws_a_far_slower_replica_while_it_knows() -> None:
    peers = [rec("fast-a"), rec("fast-b"), rec("slow")]
    draws, routers = {}, {}
    for cutoff in (0.0, 2.0):
        r = Router(random.Random(5), cutoff=cutoff)
        for pid, rate in (("fast-a", 17.0), ("fast-b", 17.0), ("slow", 1.0)):
            r.started(pid)
            r.finished(pid, True, 0.0, 0.01, queue=0, rate=rate)
        chosen = [r.choose(peers, 1.0) for _ in range(6000)]
        draws[cutoff] = Counter(c.peer_id for c in chosen if c is not None)
        routers[cutoff] = r
    # SWARM's draw: 1 / (17 + 17 + 1) of them to the slow one; the cut: none
    assert draws[0.0]["slow"] / 6000 == pytest.approx(1 / 35, abs=0.01)
    assert draws[2.0]["slow"] == 0
    assert draws[2.0]["fast-a"] / 6000 == pytest.approx(0.5, abs=0.03)
    # what an operator sees: each draw counts the slow one left out, and status names it
    assert routers[0.0].num_left_out == 0 and routers[0.0].left_out(peers, 1.0) == set()
    assert routers[2.0].num_left_out == 6000
    assert routers[2.0].left_out(peers, 1.0) == {"slow"}
    assert routers[2.0].left_out(peers, RECHECK_S + 0.1) == set()  # due for a recheck
    routers[2.0].choose(peers, 1.0, exclude={"fast-a", "fast-b"})  # the only one left
    assert routers[2.0].num_left_out == 6000
    # once its figures are old it is drawn by its weight again
    r = Router(random.Random(5), cutoff=2.0)
    r.started("slow")
    r.finished("slow", True, 0.0, 0.01, queue=0, rate=1.0)
    for pid in ("fast-a", "fast-b"):
        r.started(pid)
        r.finished(pid, True, RECHECK_S + 1, 0.01, queue=0, rate=17.0)
    chosen = [r.choose(peers, RECHECK_S + 1) for _ in range(6000)]
    later = Counter(c.peer_id for c in chosen if c is not None)
    assert later["slow"] / 6000 == pytest.approx(1 / 35, abs=0.01)
