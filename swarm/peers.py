"""The peer table: who is in the swarm, at which stage, in which state of their record.

Pure data structure with explicit ``now`` arguments (no clock, no I/O). A record is a peer's
own statement about itself, ordered by ``(incarnation, version)``, both raised only by the
peer: a newer record replaces an older one whoever relays it, an older or equal one changes
nothing, so news never goes backwards and a quiet swarm has nothing to repeat. A peer found
gone (``bury``: it left, or probes could not reach it) leaves a tombstone at its incarnation
for ``grave_s``: every record of that incarnation or below, however recent its version, is
refused, so news still travelling does not bring it back; only the peer itself returns, by
speaking to us or by publishing a higher incarnation (it answers a false report of its
death, or it restarted). A peer that speaks to us directly is taken at its word for its
figures of the moment. A relay cannot move a peer we hear from directly: while its own
messages are fresh (``ttl_s``), the address and relays they came with stand (a member
passing on a false address or relay for another peer's id cannot draw that peer's work).

A table may hold only a ``Neighbourhood`` of stages (its own and those within a radius of
it on the ring of stages): records of other stages are not taken, and one it held that moves
away is dropped (not buried: the peer lives on elsewhere). Without one it holds the whole
swarm.

Liveness is not decided here: ``swarm.membership`` probes peers and buries the ones that no
probe reaches.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, replace

from protocol.messages import PeerRecord, StageSummary

NEW = "new"
"""``observe`` result: a peer we did not hold."""
NEWER = "newer"
"""``observe`` result: a newer record of a peer we held."""


@dataclass(frozen=True)
class Neighbourhood:
    """The stages a node holds records of: those within ``radius`` of its own on the ring of
    ``num_stages`` stages (a microbatch goes 0 -> 1 -> ... -> n-1 -> 0; CheckFree+ swaps
    neighbours, so its routes reach two stages on). A node with no stage yet (< 0) holds
    every stage, and a peer with none is held by every node."""

    num_stages: int
    radius: int = 1

    def covers(self, own: int, stage: int) -> bool:
        if own < 0 or stage < 0:
            return True
        d = abs(own - stage) % self.num_stages
        return min(d, self.num_stages - d) <= self.radius


@dataclass
class _Entry:
    record: PeerRecord
    updated_s: float
    """When the record we hold reached us."""
    direct_s: float | None = None
    """When the peer itself last spoke to us (None: only relays so far)."""


class PeerTable:
    """Known peers other than ourselves, keyed by peer id."""

    def __init__(
        self,
        self_id: str,
        ttl_s: float,
        max_peers: int = 16384,
        grave_s: float | None = None,
        scope: Neighbourhood | None = None,
    ) -> None:
        self.self_id = self_id
        self.scope = scope
        """The stages held (None: every stage)."""
        self.stage = -1
        """Our own stage, the centre of ``scope`` (``set_stage``)."""
        self.ttl_s = ttl_s
        self.max_peers = max_peers
        self.grave_s = max(4 * ttl_s, 30.0) if grave_s is None else grave_s
        """How long a tombstone outlives the peer (longer than any news takes to spread)."""
        self.num_refused_full = 0
        """New peers ignored because the table was full (a flood of made-up records)."""
        self.num_moved_away = 0
        """Peers dropped because they moved to a stage outside ``scope``."""
        self._entries: dict[str, _Entry] = {}
        self._graves: dict[str, tuple[int, float]] = {}  # peer id -> (incarnation, buried at)
        self._moved: dict[str, tuple[tuple[int, int], float]] = {}  # moved away: (key, when)

    def observe(self, record: PeerRecord, now: float, *, direct: bool = False) -> str | None:
        """Take a record, from the peer itself (``direct``) or relayed by another: ``NEW``
        for a peer we did not hold, ``NEWER`` for a newer record, None if it told us
        nothing (ours, older, buried, leaving, or the table is full).

        A peer on its way out (``leaving``) is never added, only marked.
        """
        if record.peer_id == self.self_id:
            return None
        entry = self._entries.get(record.peer_id)
        if not self.covers(record.stage):
            if entry is None or _key(record) <= _key(entry.record):
                return None
            del self._entries[record.peer_id]  # newer, and moved out of our neighbourhood
            self._moved[record.peer_id] = (_key(record), now)
            self.num_moved_away += 1
            return NEWER
        if entry is None:
            moved = self._moved.get(record.peer_id)
            if moved is not None and _key(record) <= moved[0]:
                return None  # news from before its move, still travelling
            grave = self._graves.get(record.peer_id)
            buried = grave is not None and record.incarnation <= grave[0]
            if record.leaving or (buried and not direct):
                return None
            if len(self._entries) >= self.max_peers:
                self.num_refused_full += 1
                return None
            self._graves.pop(record.peer_id, None)
            self._entries[record.peer_id] = _Entry(record, now, now if direct else None)
            return NEW
        if direct:
            entry.direct_s = now
            if _key(record) == _key(entry.record):
                entry.record = record  # its figures of the moment, from itself: not news
                return None
        if _key(record) <= _key(entry.record):
            return None
        if (
            not direct
            and entry.direct_s is not None
            and now - entry.direct_s <= self.ttl_s
            and (record.address, record.relays) != (entry.record.address, entry.record.relays)
        ):
            record = replace(record, address=entry.record.address, relays=entry.record.relays)
        entry.record, entry.updated_s = record, now
        return NEWER

    def covers(self, stage: int, own: int | None = None) -> bool:
        """Whether a table centred on ``own`` (ours by default) holds ``stage``."""
        return self.scope is None or self.scope.covers(self.stage if own is None else own, stage)

    def set_stage(self, stage: int) -> None:
        """Centre the neighbourhood on ``stage``, dropping the records it no longer covers."""
        self.stage = stage
        far = [p for p, e in self._entries.items() if not self.covers(e.record.stage)]
        for peer_id in far:
            del self._entries[peer_id]

    def heard_from(self, peer_id: str, now: float) -> None:
        """The peer itself spoke to us (it answered a probe, or sent us something)."""
        entry = self._entries.get(peer_id)
        if entry is not None:
            entry.direct_s = now

    def bury(self, peer_id: str, incarnation: int, now: float) -> bool:
        """The peer is gone as of ``incarnation``; True if that is news to us (we held it in
        that incarnation or below, or had no tombstone that high). A record of a higher
        incarnation means the peer has answered since: the notice is stale."""
        if peer_id == self.self_id:
            return False
        entry = self._entries.get(peer_id)
        if entry is not None and entry.record.incarnation > incarnation:
            return False
        grave = self._graves.get(peer_id)
        if entry is None and grave is not None and grave[0] >= incarnation:
            return False
        self._entries.pop(peer_id, None)
        self._graves[peer_id] = (incarnation, now)
        return True

    def forget_graves(self, now: float) -> None:
        """Drop tombstones (and marks of peers that moved away) older than ``grave_s``."""
        self._graves = {p: g for p, g in self._graves.items() if now - g[1] <= self.grave_s}
        self._moved = {p: m for p, m in self._moved.items() if now - m[1] <= self.grave_s}

    def grave(self, peer_id: str) -> int | None:
        """The incarnation a peer was buried in, while its tombstone stands."""
        grave = self._graves.get(peer_id)
        return None if grave is None else grave[0]

    def get(self, peer_id: str) -> PeerRecord | None:
        entry = self._entries.get(peer_id)
        return entry.record if entry else None

    def graves(self) -> dict[str, int]:
        """Every standing tombstone: peer id -> incarnation."""
        return {p: g[0] for p, g in self._graves.items()}

    def incarnation(self, peer_id: str) -> int | None:
        entry = self._entries.get(peer_id)
        return None if entry is None else entry.record.incarnation

    def silent_s(self, peer_id: str, now: float) -> float | None:
        """Seconds since the peer itself last spoke to us (None: never, or not held)."""
        entry = self._entries.get(peer_id)
        if entry is None or entry.direct_s is None:
            return None
        return now - entry.direct_s

    def age_s(self, peer_id: str, now: float) -> float | None:
        """Seconds since the peer's current record reached us, or since it last spoke to
        us directly, whichever is later."""
        entry = self._entries.get(peer_id)
        if entry is None:
            return None
        return now - max(entry.updated_s, entry.direct_s or entry.updated_s)

    def records(self) -> list[PeerRecord]:
        return [e.record for e in self._entries.values()]

    def replicas(self, stage: int, *, ready_only: bool = True) -> list[PeerRecord]:
        """Live peers serving ``stage`` (by default only those ready for work, not leaving)."""
        return [
            r
            for r in self.records()
            if r.stage == stage and not r.leaving and (r.ready or not ready_only)
        ]

    def stage_counts(self, num_stages: int, extra: Iterable[int] = ()) -> dict[int, int]:
        """Replicas per stage ``0..num_stages-1``, counting peers of unknown stages nowhere."""
        counts = dict.fromkeys(range(num_stages), 0)
        for stage in [r.stage for r in self.records() if not r.leaving] + list(extra):
            if stage in counts:
                counts[stage] += 1
        return counts

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._entries


def dialled_first(records: Iterable[PeerRecord], rng: random.Random) -> list[PeerRecord]:
    """Members to ask something of, most likely to answer first: those serving a stage and
    dialled directly (they passed a reachability check), then the other direct ones (a
    fresh joiner may sit behind a NAT it has not found yet), then the relayed; at random
    within each. Leaving members and those with no address are left out."""
    out = [r for r in records if r.address and not r.leaving]
    rng.shuffle(out)
    out.sort(key=lambda r: (bool(r.relays), not r.ready))  # stable: at random within
    return out


def stand_ins(summary: StageSummary) -> list[PeerRecord]:
    """Records standing in for the replicas of a stage known only by its summary, for the
    planners that count replicas and add rates (balancing, refilling): ``ready`` ready ones
    sharing its throughput equally, the rest joining. They are not movable and have no
    address; their ids (``~stage.i``) are no real peer's, whose ids are hex or base32."""
    ready = summary.ready
    rate = summary.throughput / ready if ready else 0.0
    return [
        PeerRecord(
            peer_id=f"~{summary.stage}.{i}",
            address="",
            stage=summary.stage,
            step=summary.step,
            throughput=rate if i < ready else 0.0,
            ready=i < ready,
            movable=False,
        )
        for i in range(summary.replicas)
    ]


def _key(record: PeerRecord) -> tuple[int, int]:
    return record.incarnation, record.version
