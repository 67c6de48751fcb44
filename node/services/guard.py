"""The daemon's guard against broken and hostile peers: admission of requests, and bans.

Owns what happens to a well-formed request before a handler works on it, and the bans
that follow misbehaviour (issue 7, "A swarm of strangers"). Policies are pure and live in
``protocol.auth.claimed_sender`` (who a message says sent it), ``swarm.admission`` (token
buckets, recent ids),
``swarm.screen`` (poisoned weights) and ``swarm.routing.Router`` (quarantine); this module
applies them to the node's state and turns them into ``Refused`` with a stable code:

==========================  ======  =======================================================
code                        status  when
==========================  ======  =======================================================
``banned``                  403     the claimed sender is quarantined (poisoned weights)
``unknown_peer``            403     a microbatch, drop notice, gossip, head backup,
                                    rollback, dial-back or move request sender not in our
                                    peer table
``rate_limited``            429     the sender's token bucket is empty
``bad_microbatch_id``       400     an empty or overlong microbatch id (a hop's or a drop
                                    notice's)
``bad_path``                400     a path longer than the pipeline
``not_on_path``             400     a microbatch coming home to a head that did not issue it
``duplicate_microbatch``    409     a forward or backward already accepted here
==========================  ======  =======================================================

The daemon counts every refusal as ``rejected_<code>`` and logs it rate-limited. Frame
and message faults (``protocol.errors``), shapes, dtypes, stages and NaN in activations
(``node.server``) and the queue bounds (``busy``, ``overloaded``) are refused elsewhere.

``screen`` puts a peer's weights (a gossip partner's offer, a state or rebuild source)
through a ``swarm.screen.WeightScreen``; ``ban`` quarantines a peer whose weights were
refused: it is counted (``weights_refused:<source>:<reason>``, ``peers_banned``), logged,
and its requests are refused with ``banned`` for ``net.ban_s``.
"""

from __future__ import annotations

import logging

from node.context import NodeContext
from protocol.auth import claimed_sender
from protocol.messages import (
    Backward,
    DialBack,
    Dropped,
    Forward,
    GossipFollow,
    GossipRequest,
    HeadBackup,
    Message,
    MoveRequest,
    Rollback,
)
from swarm.admission import RecentIds, TokenBuckets
from swarm.screen import WeightScreen
from swarm.seams import Refused

log = logging.getLogger(__name__)

MAX_MB_ID_CHARS = 128
"""Longest microbatch id accepted (ours are ``<peer>.<seq>.<issue>.<16 random hex digits>``,
about 40 characters)."""

_NEEDS_KNOWN = (
    Forward,
    Backward,
    Dropped,
    GossipRequest,
    GossipFollow,
    HeadBackup,
    Rollback,
    DialBack,
    MoveRequest,
)
"""Requests only a peer in our table may send (a stranger says ``Hello`` first)."""


class RequestGuard:
    """Admission checks and bans for one node."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        net = ctx.config.net
        self.net = net
        self.buckets = TokenBuckets(net.rate_limit_per_s, net.rate_limit_burst)
        self.seen = RecentIds()

    def admit(self, msg: Message, peer_host: str) -> str | None:
        """Refuse ``msg`` (``Refused``) unless its sender may send it now and it is new;
        the peer it says it comes from (None: it names none)."""
        ctx = self.ctx
        now = ctx.clock.now()
        sender = claimed_sender(msg)
        if sender is not None and ctx.router.is_quarantined(sender, now):
            raise Refused("banned", f"peer {sender[:16]} is banned from this node", 403)
        if (
            self.net.refuse_unknown_peers
            and isinstance(msg, _NEEDS_KNOWN)
            and sender is not None
            and sender != ctx.peer_id
            and sender not in ctx.table
        ):
            raise Refused(
                "unknown_peer",
                f"{msg.TYPE} from peer {sender[:16]}, which this node has not heard of "
                "(send hello first)",
                403,
            )
        if not self.buckets.allow((peer_host, sender), now):
            raise Refused(
                "rate_limited",
                f"more than {self.net.rate_limit_per_s:g} requests/s from {str(sender)[:16]}",
                429,
            )
        if isinstance(msg, Forward | Backward | Dropped):
            _check_microbatch_id(msg.mb_id)
        if isinstance(msg, Forward | Backward):
            self._check_microbatch(msg)
        return sender

    def _check_microbatch(self, msg: Forward | Backward) -> None:
        num_stages = self.ctx.num_stages
        if len(msg.path) > num_stages:
            raise Refused(
                "bad_path",
                f"path of {len(msg.path)} hops in a {num_stages}-stage pipeline",
                400,
            )
        home = isinstance(msg, Forward) and msg.target_stage == 0 == self.ctx.stage
        if home and msg.path and msg.path[0].peer_id != self.ctx.peer_id:
            raise Refused(
                "not_on_path", f"microbatch {msg.mb_id[:32]} was not issued by this node", 400
            )
        if (msg.TYPE, msg.mb_id) in self.seen:
            raise Refused(
                "duplicate_microbatch",
                f"{msg.TYPE} of microbatch {msg.mb_id[:32]} was already accepted here",
                409,
            )

    def accepted(self, msg: Forward | Backward) -> None:
        """Remember a microbatch hop that was queued, so a copy of it is refused."""
        self.seen.add((msg.TYPE, msg.mb_id))

    def screen(
        self,
        screen: WeightScreen,
        peer_id: str,
        source: str,
        distance: float,
        scale: float,
        movement: float = 0.0,
    ) -> bool:
        """Whether ``peer_id``'s weights, ``distance`` from ours (``swarm.screen``), may be
        used; if not, the peer is banned (``source``: gossip or recovery)."""
        reason = screen.judge(distance, scale, movement)
        if reason is not None:
            self.ban(peer_id, source, reason, screen.describe(distance, scale, movement))
        return reason is None

    def ban(self, peer_id: str, source: str, reason: str, detail: str) -> None:
        """Quarantine ``peer_id`` whose weights ``source`` (gossip, recovery) refused."""
        ctx = self.ctx
        ctx.counters[f"weights_refused:{source}:{reason}"] += 1
        if not ctx.router.is_quarantined(peer_id, ctx.clock.now()):
            ctx.counters["peers_banned"] += 1
        ctx.router.quarantine(peer_id, ctx.clock.now(), self.net.ban_s)
        log.warning(
            "refused %s weights from %s (%s: %s); banned for %.0fs",
            source,
            peer_id[:8],
            reason,
            detail,
            self.net.ban_s,
        )


def _check_microbatch_id(mb_id: str) -> None:
    if not 0 < len(mb_id) <= MAX_MB_ID_CHARS:
        raise Refused(
            "bad_microbatch_id",
            f"microbatch id of {len(mb_id)} characters (1..{MAX_MB_ID_CHARS} allowed)",
            400,
        )
