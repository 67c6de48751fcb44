"""SWARM stochastic wiring: choose the next hop of a microbatch among a stage's replicas.

SWARM Parallelism (Ryabinin et al., ICML 2023, arXiv 2301.11913), section 3.2 and
``docs/algorithms.md`` section 2. Each hop is drawn at random with probability proportional to the
replica's estimated rate of finishing our work: one over the time it should take, the work
ahead of ours (its queue plus what we already have in flight with it) at its service rate
(samples/s, an EMA it measures itself) plus how much longer a hop to it takes
than a hop to the nearest candidate, as this node measured them (round trip and transfer: a
replica 150 ms further away is not as good as one next door, as SWARM's wiring weighs it).
Only the difference counts: the hop time every choice pays alike would flatten the weights
of a fast and a slow replica at the same distance towards a uniform draw (on a WAN the slow
one got a fifth more than its share of the stage's capacity, ``bench/wan.py``); without it,
equidistant replicas are drawn in proportion to rate over work ahead, SWARM's rule. The
queue and rate are the figures of the replica's last ack to us (every microbatch's ack
carries them), its queue drained since at its rate; before any ack, its published record's.
A record is republished rarely in a large swarm (membership spreads figures within a byte
budget: every few minutes at 100 nodes, hours at 1000), so the replicas this node sends to
are weighed by what they said a moment ago, whatever the swarm's size. A
replica we know nothing about yet gets the best rate and the shortest hop seen, so new
peers are probed early (SWARM's reference probes new peers first), and the draw keeps
probing every replica with a nonzero chance. A peer that failed is banned for ``ban_s``
seconds; whether it still counts as serving (``unresponsive``, what recovery reads) depends
also on whether it has spoken to us since. A peer caught misbehaving (poisoned weights, see
``swarm.screen``) is *quarantined* for longer: routing avoids it, gossip does not pair with
it, and the daemon refuses its requests with ``banned`` until the quarantine ends; a
``Leave`` does not lift it. With all peers equally fast and idle the draw is uniform,
which is what NoLoCo's seeded random permutation gives on average; with unequal peers the
faster ones get proportionally more work. A replica that cannot be dialled and is reached
through a relay (``PeerRecord.relays``) is chosen half as often as an equal direct one until
its hop time, relay included, is measured.

**Our departure, on request: far slower replicas left out of the draw** (``cut_weights``,
``train.route_cutoff``; 0, the default, keeps SWARM's draw). A replica whose expected time
to finish our microbatch is more than ``cutoff`` times the best candidate's (2 measured) is
not drawn while its figures are fresh. Why: a sender keeps a bounded window of microbatches
in flight, and one drawn to a replica 17 times slower holds its slot 17 times as long;
SWARM's draw sends it about 3 % of them, which costs a quarter of the fast pair's rate at
two in flight and 8 % at six (``bench/routing_window.py``, the daemon's own weights under a
window). Among the replicas kept the draw stays proportional, so senders acting on the same
stale figures still spread (taking only the largest weight herds: 1.67 against the draw's
1.96 there with eight senders of one in flight each). A replica left out is not sent to, so
its figures age; once they are older than ``RECHECK_S`` it is drawn again by its weight, and
its next acknowledgement tells whether it is still slow (a replica that sped up is not
shunned for good). Replicas no more than ``cutoff`` times slower are drawn as SWARM draws
them. Not the default: a replica left out takes fewer inner steps, and in three live pairs
of runs of ``bench/sync_unequal.py`` the NoLoCo stage with a 4x-slow replica spread further
with the cut in two (3.15x the equal stage on average against 1.89x), though the fast
replicas took 8 to 12 % more steps. ``Router.num_left_out`` counts what the cut leaves out
(``murmur_route_left_out_total``) and ``Router.left_out`` names it for ``node status``.

Pure policy: callers pass ``now`` and a seeded ``random.Random``.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from protocol.messages import PeerRecord

RECHECK_S = 30.0
"""Seconds after its last acknowledgement to us that a replica ``cut_weights`` leaves out
is drawn by its weight again, so that figures we stopped refreshing are checked."""

RELAY_PENALTY = 2.0
"""How much less often a replica reached through a relay is chosen than an equal one reached
directly: each hop to it is two network hops (Petals down-weights relayed servers too). Not
applied when this node is the relay: then the hop is one WebSocket message."""


@dataclass
class PeerStats:
    """What this node observed of one peer."""

    num_in_flight: int = 0
    num_failures: int = 0
    banned_until: float = float("-inf")
    quarantined_until: float = float("-inf")
    """Until then the peer is banned for misbehaviour, not merely backed off after a failure."""
    avoided_until: float = float("-inf")
    """Until then nothing is routed to it: its address did not take a connection."""
    failed_s: float = float("-inf")
    """When a request to it last failed."""
    heard_s: float = float("-inf")
    """When it last spoke to us: a reply to our request, or a request of its own."""
    latency_ema_s: float | None = None
    queue: int = 0
    """The peer's jobs queued or running, ours included, as its last ack said (``queue_s``)."""
    queue_s: float | None = None
    """When that ack came (None: no ack has said; the record's queue stands)."""
    rate: float = 0.0
    """The peer's compute rate as its last ack said, samples/s (0: the record's stands)."""


def route_weights(
    candidates: Sequence[PeerRecord],
    stats: dict[str, PeerStats],
    now: float,
    here: str = "",
    samples: float = 1.0,
) -> list[float]:
    """Relative chance of each candidate: one over the time it should take to finish our
    microbatch of ``samples``, its work ahead of ours (``1 + queue + our in-flight``) at its
    service rate (its last ack's figures, the queue drained since, else its record's) plus
    how much longer its hop takes than the shortest measured among the candidates; 0 if
    banned.

    A peer whose hop time is not measured yet gets the smallest measured one (optimism, so
    it is tried); one also reached through a relay other than this node (``here``: this
    node's address) has its weight divided by ``RELAY_PENALTY`` until then. With no hop
    times measured, or all equal, the weight is ``rate / (1 + queue + in-flight)`` (over
    ``samples``)."""
    known = [r for c in candidates if (r := _rate(c, stats.get(c.peer_id))) > 0]
    probe_rate = max(known) if known else 1.0
    trips = [
        s.latency_ema_s
        for c in candidates
        if (s := stats.get(c.peer_id)) is not None and s.latency_ema_s is not None
    ]
    probe_trip = min(trips) if trips else 0.0
    weights = []
    for c in candidates:
        s = stats.get(c.peer_id, PeerStats())
        if s.banned_until > now:
            weights.append(0.0)
            continue
        rate = _rate(c, s) or probe_rate
        compute_s = (1.0 + _queue(c, s, now, rate, samples) + s.num_in_flight) * samples / rate
        extra_trip_s = 0.0 if s.latency_ema_s is None else s.latency_ema_s - probe_trip
        weight = 1.0 / (compute_s + extra_trip_s)
        if c.relays and here not in c.relays and s.latency_ema_s is None:
            weight /= RELAY_PENALTY
        weights.append(weight)
    return weights


def cut_weights(
    candidates: Sequence[PeerRecord],
    stats: dict[str, PeerStats],
    weights: Sequence[float],
    now: float,
    cutoff: float,
    recheck_s: float = RECHECK_S,
) -> list[float]:
    """``weights`` (``route_weights``' figures for ``candidates``) with each candidate set to
    0 whose weight is below the largest over ``cutoff`` (its expected time to finish our
    microbatch more than ``cutoff`` times the best one's) while its acknowledged figures are
    at most ``recheck_s`` old. ``cutoff`` 0: unchanged, SWARM's draw. The best candidate is
    never left out, nor one we have no acknowledgement from (its weight is optimistic)."""
    if cutoff <= 0 or not weights:
        return list(weights)
    floor = max(weights) / cutoff
    out = []
    for c, w in zip(candidates, weights, strict=True):
        s = stats.get(c.peer_id)
        fresh = s is not None and s.queue_s is not None and now - s.queue_s <= recheck_s
        out.append(0.0 if fresh and w < floor else w)
    return out


def _rate(c: PeerRecord, s: PeerStats | None) -> float:
    """The candidate's compute rate: as its last ack said, else as its record says."""
    return s.rate if s is not None and s.rate > 0 else c.throughput


def _queue(c: PeerRecord, s: PeerStats, now: float, rate: float, samples: float) -> float:
    """The candidate's queue now: as its last ack said, less what it has computed since at
    ``rate`` (each job ``samples / rate`` seconds, as ``route_weights`` counts them); else
    as its record says."""
    if s.queue_s is None:
        return float(c.queue)
    return max(0.0, s.queue - (now - s.queue_s) * rate / samples)


class Router:
    """Keeps per-peer observations and draws next hops."""

    def __init__(
        self,
        rng: random.Random,
        ban_s: float = 10.0,
        ema: float = 0.3,
        silent_s: float = 2.0,
        cutoff: float = 0.0,
    ) -> None:
        self.rng = rng
        self.cutoff = cutoff
        """Replicas this many times slower than the best are left out (``cut_weights``; 0:
        SWARM's draw)."""
        self.ban_s = ban_s
        self.ema = ema
        self.silent_s = silent_s
        """A peer whose request failed still counts as serving while it spoke to us this
        recently (``unresponsive``): the daemon's is two membership heartbeats."""
        self.stats: dict[str, PeerStats] = {}
        self.here = ""
        """This node's address (a relayed replica whose relay is this node costs no more)."""
        self.samples = 1.0
        """Samples in a microbatch (``data.batch_size``): compute time = samples / rate."""
        self.num_left_out = 0
        """Candidates the cut has left out of this router's draws, one per draw each."""

    def choose(
        self, candidates: Sequence[PeerRecord], now: float, exclude: Collection[str] = ()
    ) -> PeerRecord | None:
        """A weighted random candidate not in ``exclude``, far slower ones left out
        (``cut_weights``); ``None`` if none is usable.

        When every remaining candidate is banned, the least recently banned one is tried
        rather than giving up: a swarm with one replica per stage must retry it.
        """
        pool = [c for c in candidates if c.peer_id not in exclude]
        if not pool:
            return None
        drawn, weights = self._weights(pool, now)
        if self.cutoff > 0:
            self.num_left_out += sum(w > 0 and not k for w, k in zip(drawn, weights, strict=True))
        if sum(weights) <= 0:
            return min(pool, key=lambda c: self._stats(c.peer_id).banned_until)
        return self.rng.choices(pool, weights=weights, k=1)[0]

    def left_out(self, candidates: Sequence[PeerRecord], now: float) -> set[str]:
        """The candidates a draw among ``candidates`` would leave out now for being far
        slower than the best (``cut_weights``; none while the cutoff is 0)."""
        if self.cutoff <= 0:  # the default: no weights to work out for every status call
            return set()
        drawn, weights = self._weights(candidates, now)
        return {
            c.peer_id for c, w, k in zip(candidates, drawn, weights, strict=True) if w > 0 and not k
        }

    def _weights(
        self, candidates: Sequence[PeerRecord], now: float
    ) -> tuple[list[float], list[float]]:
        """SWARM's weights for ``candidates`` and the draw's after the cut (the same list
        while the cutoff is 0, the default: no second pass per hop)."""
        drawn = route_weights(candidates, self.stats, now, self.here, self.samples)
        if self.cutoff <= 0:
            return drawn, drawn
        return drawn, cut_weights(candidates, self.stats, drawn, now, self.cutoff)

    def started(self, peer_id: str) -> None:
        self._stats(peer_id).num_in_flight += 1

    def finished(
        self,
        peer_id: str,
        ok: bool,
        now: float,
        latency_s: float | None = None,
        queue: int = -1,
        rate: float = 0.0,
    ) -> None:
        """Record the outcome of one request to ``peer_id``; a failure bans it for a while.
        ``queue`` and ``rate``: the figures its ack gave (-1 and 0: none)."""
        s = self._stats(peer_id)
        s.num_in_flight = max(0, s.num_in_flight - 1)
        if ok:
            s.num_failures = 0
            s.heard_s = now
            if queue >= 0:
                s.queue, s.queue_s = queue, now
            if rate > 0:
                s.rate = rate
            if latency_s is not None:
                prev = s.latency_ema_s
                s.latency_ema_s = (
                    latency_s if prev is None else prev + self.ema * (latency_s - prev)
                )
        else:
            s.num_failures += 1
            s.failed_s = now
            s.banned_until = max(now + self.ban_s, s.quarantined_until)

    def heard(self, peer_id: str, now: float) -> None:
        """``peer_id`` sent us a request (admitted): it is alive, whatever our requests to it
        met. Only peers we have sent to are noted (a stranger's hello adds nothing here)."""
        s = self.stats.get(peer_id)
        if s is not None:
            s.heard_s = max(s.heard_s, now)

    def unresponsive(self, now: float) -> set[str]:
        """Peers not to count as serving now: quarantined, avoided (their address takes no
        connection), or failed a request in the last ``ban_s`` and silent since, for more
        than ``silent_s``.

        A failed request alone does not tell a dead peer from a slow path: the hop of a
        node behind a thin uplink times out in its own upload queue while the receiver is
        fine, and keeps speaking to us (its own hops, its membership pings). A peer that
        spoke to us after the failure, or in the last ``silent_s``, is alive; one that did
        not is counted out at once, the failure detection CheckFree's refill starts from
        (a killed peer's next hop is refused, so it is counted out about ``silent_s`` after
        its last word at the latest; a frozen one's hop times out, long after its last)."""
        return {
            peer_id
            for peer_id, s in self.stats.items()
            if s.quarantined_until > now
            or s.avoided_until > now
            or (
                now - s.failed_s < self.ban_s
                and s.heard_s <= s.failed_s
                and now - s.heard_s > self.silent_s
            )
        }

    def avoid(self, peer_id: str, now: float, seconds: float) -> None:
        """Route nothing to ``peer_id`` for ``seconds`` (it could not be dialled back: its
        address does not take connections). Unlike a quarantine, its requests are welcome."""
        s = self._stats(peer_id)
        s.avoided_until = max(s.avoided_until, now + seconds)
        s.banned_until = max(s.banned_until, s.avoided_until)

    def quarantine(self, peer_id: str, now: float, seconds: float) -> None:
        """Ban ``peer_id`` for misbehaviour for ``seconds`` (routing skips it meanwhile too)."""
        s = self._stats(peer_id)
        s.quarantined_until = max(s.quarantined_until, now + seconds)
        s.banned_until = max(s.banned_until, s.quarantined_until)

    def is_quarantined(self, peer_id: str, now: float) -> bool:
        s = self.stats.get(peer_id)
        return s is not None and s.quarantined_until > now

    def forget(self, peer_id: str) -> None:
        """Drop what we observed of a peer that left; a quarantine outlives its leaving."""
        s = self.stats.get(peer_id)
        if s is not None and s.quarantined_until == float("-inf"):
            del self.stats[peer_id]

    def _stats(self, peer_id: str) -> PeerStats:
        return self.stats.setdefault(peer_id, PeerStats())
