"""The time a keyed swarm's proofs are stamped with, learned from its members' seals.

A keyed swarm refuses a request stamped more than a minute from the receiver's clock
(``protocol.auth``: the window bounds what a replay cache must remember). A volunteer whose
clock is hours off (a dual-boot machine whose hardware clock keeps local time, a virtual
machine restored from a snapshot, a board with no battery-backed clock) was refused by
every member and could only be told to set its clock. Now it joins anyway:

- every sealed reply carries its sealer's time (``Outgoing.sealed_ts``), and a refusal as
  stale is sealed too (``SwarmAuth.seal_refusal``), so each exchange with a member is a
  sample of that member's proof clock against this machine's wall clock, measured as
  membership's pings measure wall clocks (``swarm.schedule.ClockOffsets``: NTP's on-wire
  estimate, the least delayed of a peer's last few samples);
- the proofs are stamped with the time most measured members agree on
  (``swarm.schedule.agreed_offset_s``: this machine's own clock counts half a member, so a
  joiner that knows only its bootstrap takes the bootstrap's time, and a lone member with a
  wrong clock moves nobody). A clock that agrees with most members gets no correction.
  What members measure is each other's proof clocks, so a correction feeds back: in a
  swarm split half and half between two clock settings each half first takes the other's
  time, but the halves do not swap for ever; the first members to agree draw the rest, and
  every member's proofs settle on one of the two times within seconds (checked by
  simulation with these classes, ``tests/test_swarmtime.py``; about 2 s for six members
  exchanging ten times a second in all, 23 s at worst for ten).

Only seals count: a member's time is bound to the request's nonce under the swarm key, so
a stranger answering at a peer's old address cannot move this node's time. Nothing else
reads the correction: the machine's clock stays as it is, and outer rounds follow the
stage's clock as before (``node.services.sync``). The operator is told (log, ``node
status``, ``murmur_proof_clock_offset_seconds``) and should still set the clock.

Owns: the proof-clock samples, the offset set on ``SwarmAuth.clock_offset_s``, telling the
operator. Does not own proofs (``protocol.auth``) or sending (``node.net.transport``, which
reports each sealed reply here).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from protocol.auth import SwarmAuth
from swarm.schedule import AGREE_S, ClockOffsets, agreed_offset_s

log = logging.getLogger(__name__)

UPDATE_S = 1.0
"""Seconds between two estimates of the swarm's time (each reads every measured member)."""


class SwarmTime:
    """This node's estimate of its keyed swarm's time, applied to the proofs it makes."""

    def __init__(self, auth: SwarmAuth, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.auth = auth
        self._monotonic = monotonic
        self.clocks = ClockOffsets()
        """Members' proof clocks against this machine's wall clock."""
        self._updated = float("-inf")
        self.corrections = 0
        """Times the offset changed by a second or more."""

    def observe(self, peer_id: str, sent_s: float, sealed_s: float, received_s: float) -> None:
        """A reply sealed at ``sealed_s`` by ``peer_id`` to a request sent at ``sent_s`` and
        answered at ``received_s`` (this machine's wall clock); the estimate is renewed at
        most every ``UPDATE_S``."""
        now = self._monotonic()
        self.clocks.observe(peer_id, sent_s, sealed_s, received_s, now)
        if now - self._updated >= UPDATE_S:
            self.update(now)

    def update(self, now: float) -> float:
        """Set the proofs' offset from the members measured; returns it."""
        self._updated = now
        offsets = self.clocks.offsets(now)
        offset = agreed_offset_s(offsets.values())
        old, self.auth.clock_offset_s = self.auth.clock_offset_s, offset
        if abs(offset - old) >= 1.0:
            self.corrections += 1
            if offset:
                agree = sum(abs(o - offset) <= AGREE_S for o in offsets.values())
                log.warning(
                    "this machine's clock is %.0f s %s the swarm's (%d of %d members measured "
                    "agree): proofs are stamped with the swarm's time; set this machine's "
                    "clock (NTP: timedatectl set-ntp true)",
                    abs(offset),
                    "behind" if offset > 0 else "ahead of",
                    agree,
                    len(offsets),
                )
            else:
                log.info("this machine's clock agrees with the swarm's again")
        return offset

    def status(self) -> dict[str, Any]:
        now = self._monotonic()
        return {
            "offset_s": round(self.auth.clock_offset_s, 3),
            "members_measured": len(self.clocks.offsets(now)),
            "corrections": self.corrections,
        }
