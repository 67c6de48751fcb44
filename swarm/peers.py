"""The peer table: who is in the swarm, at which stage, and how recently we heard of them.

Pure data structure with explicit ``now`` arguments (no clock, no I/O). Liveness is gossiped:
a relayed record carries its age, so information only ever comes from a peer's own
heartbeats and cannot be kept alive by relaying alone; a peer silent for ``ttl_s`` expires
everywhere. A peer that said goodbye leaves a tombstone so that stale relays do not
resurrect it. A relay cannot move a peer we hear from directly: while its own heartbeats
are fresh, the address and traffic relays they came with stand (a member passing on a false
address or relay for another peer's id cannot draw that peer's work).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from protocol.messages import PeerRecord


@dataclass
class _Entry:
    record: PeerRecord
    last_seen: float
    direct_s: float | None = None
    """When the peer itself last told us about itself (None: only relays so far)."""


class PeerTable:
    """Known peers other than ourselves, keyed by peer id."""

    def __init__(self, self_id: str, ttl_s: float, max_peers: int = 4096) -> None:
        self.self_id = self_id
        self.ttl_s = ttl_s
        self.max_peers = max_peers
        self.num_refused_full = 0
        """New peers ignored because the table was full (a flood of made-up records)."""
        self._entries: dict[str, _Entry] = {}
        self._left: dict[str, float] = {}

    def observe(
        self, record: PeerRecord, now: float, age_s: float = 0.0, *, relayed: bool = False
    ) -> bool:
        """Take a record heard ``age_s`` seconds ago, from the peer itself or ``relayed`` by
        another; returns True if the peer is new to us.

        A peer on its way out (``leaving``) is never added, only marked, and no new peer is
        added to a table that holds ``max_peers`` already. A peer that said
        goodbye comes back only by contacting us itself, not leaving, after the goodbye: a
        relay may carry news from just before the goodbye, dated late by its transit time.
        """
        if record.peer_id == self.self_id:
            return False
        seen = now - max(0.0, age_s)
        if now - seen > self.ttl_s:
            return False
        left = self._left.get(record.peer_id)
        if left is not None and (relayed or record.leaving or seen <= left):
            return False
        entry = self._entries.get(record.peer_id)
        if entry is None:
            if record.leaving:
                return False
            if len(self._entries) >= self.max_peers:
                self.num_refused_full += 1
                return False
            self._entries[record.peer_id] = _Entry(record, seen, None if relayed else seen)
            return True
        if not relayed:
            entry.direct_s = seen
        elif (
            entry.direct_s is not None
            and now - entry.direct_s <= self.ttl_s
            and (record.address, record.relays) != (entry.record.address, entry.record.relays)
        ):
            record = replace(record, address=entry.record.address, relays=entry.record.relays)
        if seen >= entry.last_seen:
            entry.record, entry.last_seen = record, seen
        return False

    def remove(self, peer_id: str, now: float) -> bool:
        """Forget a peer that left; relayed news older than ``now`` will not bring it back."""
        self._left[peer_id] = now
        return self._entries.pop(peer_id, None) is not None

    def expire(self, now: float) -> list[str]:
        """Drop peers silent for longer than ``ttl_s``; returns their ids."""
        dead = [pid for pid, e in self._entries.items() if now - e.last_seen > self.ttl_s]
        for pid in dead:
            del self._entries[pid]
        self._left = {pid: t for pid, t in self._left.items() if now - t <= self.ttl_s}
        return dead

    def get(self, peer_id: str) -> PeerRecord | None:
        entry = self._entries.get(peer_id)
        return entry.record if entry else None

    def age_s(self, peer_id: str, now: float) -> float | None:
        entry = self._entries.get(peer_id)
        return None if entry is None else now - entry.last_seen

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

    def for_exchange(self, now: float) -> list[PeerRecord]:
        """Our table as relayable records, each stamped with its age."""
        return [replace(e.record, age_s=now - e.last_seen) for e in self._entries.values()]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._entries
