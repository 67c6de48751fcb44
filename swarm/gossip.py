"""NoLoCo matchmaking: pair with one random live replica of the stage, on a real network.

NoLoCo (arXiv 2506.10911) replaces all-reduce by averaging with one random partner every
``H`` inner steps. Its reference code pairs replicas in lockstep from a shared counter with
blocking sends and hangs if a partner never comes. This module is the protocol that does
not hang. Round ``r`` of a replica is its outer step after ``r * H`` inner steps.

1. At its boundary a replica freezes its contribution (slow weights ``phi`` and
   pseudo-gradient ``theta - phi``) and becomes *seeking* for round ``r``. Its pipeline
   keeps running meanwhile; only its optimizer steps wait for the outer step.
2. It listens for a short random time (``listen_s``): a proposal for round ``r`` already
   waiting here, or arriving now, is accepted (the earliest one).
3. Otherwise it *proposes* to a random live replica not excluded this round: a small
   ``GossipRequest`` (``propose``) that carries no tensors, with a deadline. The answer is
   one of:
   - an empty ``GossipReply``: a promise. The proposer then sends its contribution in a
     second ``GossipRequest`` and the partner's comes back in the ``GossipReply``: paired;
   - an empty ``GossipReply`` marked ``incoming``: the partner is sending its contribution
     to this replica already (it heard ``lapsed`` from here, or its agreed exchange outlived
     this replica's promise) and keeps sending for at most ``upload_s`` more seconds. This
     replica waits for it as for a promised one (point 4), that long and at most
     ``max_upload_wait_s``, proposing to nobody meanwhile. One that does not come lapses
     like a promise, and that partner's ``incoming`` is not waited for again for
     ``lapse_ban_s``;
   - ``busy``: the partner is paired or promised already, or is proposing to someone else;
     try another (it may be asked again later in the round: its own attempt may fail);
   - ``not_ready``: the partner is behind and did not reach ``r`` in time; it too may be
     asked again;
   - ``stale``: the partner is past round ``r``; it is excluded for the round;
   - ``lapsed``: this replica's last promised contribution never reached the partner:
     it sends its contribution in one request at once (point 4), then excludes the
     partner for the round;
   - a timeout or an unreachable partner (it died, perhaps mid-exchange): excluded;
   before each new attempt it listens again, so a replica that was refused can still be
   claimed by someone else.
   Agreeing first with a few bytes is what keeps the exchange's cost flat in the number of
   replicas: a refusal costs a round trip, not an upload of twice the stage (issue 22
   measured the one-message protocol at 0.67 s for N = 2 and 6.66 s for N = 8 with a
   113 MB stage, most of it contributions sent to replicas that answered ``busy``).
4. A proposal for round ``r`` arriving at a replica that is
   - seeking ``r``, not promised to anyone, with no proposal out: accepted; the replica
     is then *promised* and waits for that sender's contribution (at most
     ``request_timeout_s`` plus its upload time, point 5) instead of proposing. Two
     replicas that proposed to each other
     (each finds its own proposal out *to that very sender*) settle it by peer id: the
     larger accepts, the smaller answers ``busy`` and its own proposal is the one accepted,
     so they pair once and each contribution travels once. A promise whose contribution
     does not come in time lapses, and that proposer's proposals are refused with
     ``lapsed`` for ``lapse_ban_s`` (counted in ``num_lapsed``): a member that proposes and
     never sends holds one round up for that long at most, once. A refused proposer is
     not shut out: it sends its contribution at once in one unannounced request, which is
     taken like any contribution without a promise (below) and holds nobody up, and asks
     that replica no more that round whatever the answer (it may still be proposed to: a
     replica that died mid-exchange and came back can pair meanwhile). Honest replicas
     lapse too, on an uplink slower than the allowance: two such replicas that had each
     let the other's promise lapse refused each other's proposals as ``busy`` for ten
     minutes, live, over a hundred times a round, and paired in no round (``bench/gossip_thin.py``);
   - sending its contribution to that very proposer already (an unannounced one, after
     ``lapsed``, or an agreed one still in flight): ``incoming``, whatever the ids, with
     the seconds it will keep sending. Otherwise the proposer asked again and
     again while the upload crossed a thin uplink (``busy``: tens of proposals a round,
     live), or, promised, sent its own contribution, whose reply carried this replica's a
     second time over the same thin uplink, beside the first;
   - seeking ``r`` but paired, promised to another, or proposing to a third replica:
     ``busy`` (so three replicas that choose each other in a cycle all hear ``busy`` and
     move on: no deadlock);
   - past ``r``: ``stale``;
   - not yet at ``r``: held until it gets there (at most ``hold_s``), then judged as
     above; if it does not arrive in time, ``not_ready``. At most ``max_held`` requests
     are held at once; more are ``busy``.
   A contribution is accepted from the replica it was promised to, or, without a promise,
   by the same rules as a proposal (a single-message exchange, as older nodes send).
5. Contributions are large (twice the stage: 200 MB for a 100 MB stage in fp32) and cross
   volunteers' uplinks, so every transfer of one is allowed its size at the slowest rate
   waited for (``min_rate_bytes_s``, 10 Mbit/s) on top of ``request_timeout_s``: the
   proposer's contribution request (its upload and the reply's), and the promise (the
   upload). ``round_deadline_s`` bounds the search for a partner, not the transfer: a
   promise given before it is kept past it, and an agreed exchange runs to its end.
   With the fixed 10 s timeout alone a 100 MB stage at 100 Mbit/s (16 s each way) could
   never pair. A proposer whose uplink is slower than that says so: its proposal carries
   its upload's expected seconds (``upload_s``, at the rate its own uploads get), and the
   acceptor waits that long plus ``request_timeout_s`` where it is longer, up to
   ``max_upload_wait_s`` (60 s): a volunteer's 2.4 MB int8 contribution takes 19 s on a
   1 Mbit/s uplink, against 11.9 s allowed at 10 Mbit/s. The acceptor's promise says the
   same of its own upload, which comes back in the reply, and the proposer waits for the
   reply accordingly. A proposer that
   announces a long upload and sends nothing holds its partner that long once, then lapses
   (point 4); the same bound holds an ``incoming`` one.
6. When every replica is excluded, or the round's deadline passes, the replica takes a
   solo outer step (``G = {i}``): the odd replica out and the replica whose partner died
   both end this way. Each round ends as exactly one of paired or solo.

7. A replica may also *follow* a partner in a round (``follow``): it sends a
   ``GossipFollow`` that carries nothing, and the partner answers with its contribution to
   that round, which it keeps until its next round begins, whether it is still seeking,
   paired already, or past its outer step. The partner neither waits for nor pairs with the
   follower; the follower steps with what it received, a one-sided pairing on purpose. A
   replica whose exchange outlasts the stage's round takes every 2nd, 4th ... round in full
   and follows in the rounds between (``node.services.sync``): a download crosses its
   downlink, not its thin uplink, and its fast partners pair among themselves meanwhile. A
   replica answers each follower at most once a round and at most ``max_followers`` of
   them (``busy`` beyond): a few bytes cannot buy more than one contribution's upload per
   replica and round. A follow for a round not reached yet is held as a proposal is; one
   for a round whose contribution is gone (a later round began) is ``stale``. Such a
   replica may also follow in a round it sought in full and found no partner for
   (``exchange(follow_if_solo=True)``: its fast partners met each other first): for at
   most ``request_timeout_s`` past the round's deadline it follows instead of stepping
   solo, still holding its own contribution for its followers.

An accepted contribution whose reply is lost leaves the acceptor paired and the asker solo;
both are valid NoLoCo steps. The service moves opaque contributions (tensors and their
codec metadata); encoding and the maths happen in the caller's compute thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from protocol.messages import GossipFollow, GossipReply, GossipRequest, PeerRecord, expect
from protocol.quant import tensor_bytes
from swarm.seams import Clock, Refused, Transport, TransportError

log = logging.getLogger(__name__)

_TRANSIENT = ("busy", "not_ready")
"""Refusals that may change within the round: such a peer may be asked again."""


@dataclass(frozen=True)
class Contribution:
    """What a replica offers for one round: encoded tensors plus their codec metadata."""

    tensors: Mapping[str, torch.Tensor]
    meta: dict[str, Any]
    upload_s: float = 0.0
    """Seconds its upload takes at the rate this replica's uploads get (0: not known),
    announced with its proposals. On a partner's contribution received: what that partner
    announced, in its proposal or its promise (0: it said nothing, as in a one-message
    exchange)."""

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors: what the wire carries, give or take the headers."""
        return tensor_bytes(self.tensors)


@dataclass(frozen=True)
class GossipConfig:
    request_timeout_s: float = 10.0
    """Deadline of one request to a candidate partner (includes its hold time)."""
    hold_s: float = 5.0
    """How long a request for a round we have not reached yet waits here."""
    round_deadline_s: float = 20.0
    """After this long without a partner, take a solo step."""
    listen_s: float = 0.3
    """Before asking, and between refusals, wait up to this long (random) for a request."""
    max_held: int = 4
    """Most requests for a round not reached yet held at once; more are answered busy."""
    min_rate_bytes_s: float = 1.25e6
    """The slowest link a contribution is given time to cross (10 Mbit/s): sending one, and
    waiting for a promised one, may take its size at this rate on top of
    ``request_timeout_s``. A 100 MB stage's contribution (its slow weights and its
    pseudo-gradient, 200 MB in fp32) takes 16 s each way on a 100 Mbit/s uplink; a fixed
    timeout of seconds would end every such exchange solo."""

    lapse_ban_s: float = 600.0
    """How long a proposer whose promise lapsed has its proposals refused here. The wait for
    a promised contribution grows with its size (above), so a member that proposes and never
    sends must not be able to hold every round up for that long: one lapse, and it is
    refused for this long (an honest proposer lapses only when it died, or its uplink is
    slower than ``min_rate_bytes_s``)."""

    max_followers: int = 4
    """Most replicas this one answers a ``GossipFollow`` in one round (``busy`` beyond):
    each answer uploads a contribution."""

    max_upload_wait_s: float = 60.0
    """The longest a promised contribution is waited for when its sender announced an
    upload slower than ``allowed_s`` gives (a proposal's ``upload_s``), or an ``incoming``
    one. A sender whose contribution then never comes holds a round up this long once; it
    lapses like any promise. Below ``allowed_s``: nothing longer than ``allowed_s``."""

    def transfer_s(self, nbytes: float) -> float:
        """Time allowed for ``nbytes`` to cross the slowest link we wait for."""
        return nbytes / self.min_rate_bytes_s if self.min_rate_bytes_s > 0 else 0.0

    def allowed_s(self, nbytes: float) -> float:
        """How long a promised contribution of ``nbytes`` is waited for:
        ``request_timeout_s`` plus its time at ``min_rate_bytes_s``."""
        return self.request_timeout_s + self.transfer_s(nbytes)

    def promise_s(self, nbytes: float, upload_s: float = 0.0) -> float:
        """How long a promised contribution of ``nbytes`` whose sender announced an upload
        of ``upload_s`` seconds (0: none) is waited for: ``allowed_s``, or the announced
        upload plus ``request_timeout_s`` where that is longer, up to
        ``max_upload_wait_s``."""
        announced = 0.0
        if upload_s > 0:
            announced = min(self.request_timeout_s + upload_s, self.max_upload_wait_s)
        return max(self.allowed_s(nbytes), announced)


@dataclass
class RoundOutcome:
    """How one round ended: the partner's id and contribution, or solo."""

    round: int
    partner_id: str | None
    contribution: Contribution | None
    num_attempts: int = 0
    """Proposals made."""
    num_sent: int = 0
    """Times this replica's contribution was sent (requests and the reply as acceptor)."""
    refusals: dict[str, int] = field(default_factory=dict)
    num_follows: int = 0
    """``GossipFollow`` requests made (point 7)."""
    followed: bool = False
    """The contribution came from a replica followed (point 7), not from an exchange."""


class GossipService:
    """One replica's side of the matchmaking protocol (see the module docstring)."""

    def __init__(
        self,
        config: GossipConfig,
        *,
        transport: Transport,
        clock: Clock,
        rng: random.Random,
        self_id: str,
        stage: int,
        replicas: Callable[[], list[PeerRecord]],
    ) -> None:
        """``transport`` should introduce this replica to a partner that does not know it
        yet (``swarm.membership.IntroducingTransport``), as the daemon's does."""
        self.config = config
        self.transport = transport
        self.clock = clock
        self.rng = rng
        self.self_id = self_id
        self.stage = stage
        self.replicas = replicas
        self.completed = -1
        self._round = -1
        self._mine: Contribution | None = None
        self._target: str | None = None
        """The replica we are proposing to (or sending our contribution to) now."""
        self._promised: str | None = None
        """The replica whose proposal we accepted and whose contribution we wait for."""
        self._promise_until = 0.0
        self._promised_upload_s = 0.0
        """The upload the replica we promised to announced (0: none)."""
        self._incoming: str | None = None
        """The replica that answered ``incoming``: the promise we keep is to it."""
        self._sent_as_acceptor = False
        self._lapsed: dict[str, float] = {}
        """Proposers whose contribution never came, and until when their proposals are
        refused (``lapse_ban_s``): a member cannot hold our rounds by proposing and not
        sending, again and again."""
        self.num_lapsed = 0
        """Promises that lapsed: proposers that did not send (they died, or misbehave)."""
        self._false_incoming: dict[str, float] = {}
        """Replicas whose ``incoming`` never came, and until when it is not waited for."""
        self._sending_to: str | None = None
        """The replica our contribution is on its way to now (an agreed or unannounced
        exchange, not a proposal)."""
        self._sending_until = 0.0
        """When we stop sending it, if it has not arrived."""
        self._partner: asyncio.Future[tuple[str, Contribution]] | None = None
        self._reached = asyncio.Event()
        self._num_held = 0
        self._last_offered_bytes = 0
        """Bytes of the last contribution this replica offered: what a followed one weighs."""
        self._followers: set[str] = set()
        """The replicas this one answered a ``GossipFollow`` in its current round."""
        self.num_followers = 0
        """``GossipFollow`` requests answered with a contribution, over all rounds."""
        self.bytes_to_followers = 0
        """Bytes of the contributions those answers carried."""

    @property
    def seeking(self) -> bool:
        return self._partner is not None and not self._partner.done()

    async def exchange(
        self, round_: int, mine: Contribution, follow_if_solo: bool = False
    ) -> RoundOutcome:
        """Find a partner for ``round_`` and swap contributions, or end solo; with
        ``follow_if_solo``, follow a replica instead of ending solo (point 7)."""
        assert round_ > self.completed, "rounds only move forward"
        self._promised, self._incoming, self._sent_as_acceptor = None, None, False
        now = self.clock.now()
        self._lapsed = {p: until for p, until in self._lapsed.items() if until > now}
        self._false_incoming = {p: t for p, t in self._false_incoming.items() if t > now}
        partner: asyncio.Future[tuple[str, Contribution]]
        partner = asyncio.get_running_loop().create_future()
        self._begin(round_, mine, partner)
        outcome = RoundOutcome(round_, None, None)
        deadline = self.clock.now() + self.config.round_deadline_s
        excluded: set[str] = set()  # stale, unreachable or timed out: not asked again
        try:
            # a promise given before the deadline is kept past it: its contribution may be
            # on the wire (a round's deadline is for finding a partner, not for the transfer)
            while not partner.done() and (
                self.clock.now() < deadline or self._promised is not None
            ):
                # Listen first: replicas that reach the round together would otherwise all
                # be asking at once, and an asking replica answers "busy".
                await self._listen(partner, self.rng.uniform(0.0, self.config.listen_s))
                if partner.done():
                    break
                if self._promised is not None:
                    await self._keep_promise(partner)
                    continue
                peer = self._pick(excluded)
                if peer is None:
                    break
                outcome.num_attempts += 1
                code = await self._ask(peer, round_, mine, deadline, outcome)
                if code not in _TRANSIENT:
                    excluded.add(peer.peer_id)
            if partner.done():
                outcome.partner_id, outcome.contribution = partner.result()
        finally:
            if not partner.done():
                partner.cancel()
            self.completed = round_
            self._target = self._promised = self._incoming = None
        outcome.num_sent += self._sent_as_acceptor
        if outcome.partner_id is None and follow_if_solo:
            follow_deadline = self.clock.now() + self.config.request_timeout_s
            await self._follow_until(round_, follow_deadline, outcome)
        return outcome

    async def follow(self, round_: int) -> RoundOutcome:
        """Ask live replicas, one at a time in random order, for their contribution to
        ``round_`` without sending ours (a ``GossipFollow``), until one answers or the
        round's deadline passes; the outcome names that replica and its contribution, or
        ends solo. This replica offers nothing in the round: it is not proposed to
        (``busy``), and answers no follower."""
        assert round_ > self.completed, "rounds only move forward"
        self._begin(round_, None, None)
        outcome = RoundOutcome(round_, None, None)
        try:
            deadline = self.clock.now() + self.config.round_deadline_s
            await self._follow_until(round_, deadline, outcome)
        finally:
            self.completed = round_
        return outcome

    async def _follow_until(self, round_: int, deadline: float, outcome: RoundOutcome) -> None:
        """Ask live replicas for their contribution to ``round_``, one at a time in random
        order, until one answers (recorded in ``outcome`` as followed) or ``deadline``."""
        excluded: set[str] = set()
        request = GossipFollow(stage=self.stage, round=round_, sender=self.self_id)
        while self.clock.now() < deadline:
            peer = self._pick(excluded)
            if peer is None:
                return
            outcome.num_follows += 1
            answer = await self._request(
                peer, request, deadline, outcome, self._follow_timeout_s(deadline)
            )
            if isinstance(answer, GossipReply):
                outcome.partner_id = peer.peer_id
                outcome.contribution = Contribution(answer.tensors, answer.meta)
                outcome.followed = True
                return
            if answer not in _TRANSIENT:
                excluded.add(peer.peer_id)
            await self.clock.sleep(self.rng.uniform(0.0, self.config.listen_s))

    def _pick(self, excluded: set[str]) -> PeerRecord | None:
        """A live replica at random, not ``excluded`` this round (None: none is left)."""
        pool = [
            p for p in self.replicas() if p.peer_id not in excluded and p.peer_id != self.self_id
        ]
        return self.rng.choice(pool) if pool else None

    def _follow_timeout_s(self, deadline: float) -> float:
        """How long a follow request may take: ``request_timeout_s`` (cut at the round's
        deadline) for a hold, plus a contribution as large as the last one this replica
        offered coming down at the slowest rate waited for."""
        size = self._last_offered_bytes
        left_s = max(0.0, deadline - self.clock.now())
        return min(self.config.request_timeout_s, left_s) + self.config.transfer_s(size)

    def _begin(
        self,
        round_: int,
        mine: Contribution | None,
        partner: asyncio.Future[tuple[str, Contribution]] | None,
    ) -> None:
        """Round ``round_`` begins here, offering ``mine`` and seeking ``partner`` (both
        None: following, so proposals are refused); the requests held for a round this
        replica had not reached wake and look again."""
        self._round, self._mine, self._partner, self._followers = round_, mine, partner, set()
        if mine is not None:
            self._last_offered_bytes = mine.nbytes
        self._reached.set()
        self._reached = asyncio.Event()

    def rewind(self, round_: int) -> None:
        """The stage's clock was set back and its rounds restart from ``round_`` (a grid
        boundary): rounds after it may be sought again, and a request for one is held until
        this replica reaches it, as for any round ahead. Between rounds only."""
        assert not self.seeking, "rewound while seeking a partner"
        self.completed = min(self.completed, round_)
        self._round = min(self._round, round_)

    async def _keep_promise(self, partner: asyncio.Future[tuple[str, Contribution]]) -> None:
        """Wait for the contribution of the replica we promised to; release the promise if
        it does not come in time (the proposer gave up, or died)."""
        promised = self._promised
        wait_s = self._promise_until - self.clock.now()
        if wait_s > 0:
            await self._listen(partner, wait_s)
        if not partner.done() and self._promised == promised:
            log.info("gossip round %d: %s never sent its contribution", self._round, promised)
            self._promised = None
            if promised is not None:
                until = self.clock.now() + self.config.lapse_ban_s
                self._lapsed[promised] = until
                if promised == self._incoming:  # it said so itself: not believed again soon
                    self._false_incoming[promised] = until
                self.num_lapsed += 1

    async def _listen(
        self, partner: asyncio.Future[tuple[str, Contribution]], seconds: float
    ) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(partner), seconds)

    async def _ask(
        self,
        peer: PeerRecord,
        round_: int,
        mine: Contribution,
        deadline: float,
        outcome: RoundOutcome,
    ) -> str | None:
        """Propose to ``peer``, then send our contribution for its own; ``None`` if paired,
        else the refusal's code."""
        partner = self._partner
        assert partner is not None
        self._target = peer.peer_id
        try:
            propose = GossipRequest(
                stage=self.stage,
                round=round_,
                sender=self.self_id,
                meta={},
                propose=True,
                upload_s=mine.upload_s,
            )
            answer = await self._request(peer, propose, deadline, outcome)
            if isinstance(answer, GossipReply) and answer.incoming:
                # its contribution is on its way here: wait for it as for a promised one
                outcome.refusals["incoming"] = outcome.refusals.get("incoming", 0) + 1
                if peer.peer_id not in self._false_incoming:
                    self._promised = self._incoming = peer.peer_id
                    wait_s = min(answer.upload_s, self.config.max_upload_wait_s)
                    self._promise_until = self.clock.now() + wait_s
                return "incoming"
            lapsed = answer == "lapsed"  # no promise for us there: ours goes unannounced
            back_s = answer.upload_s if isinstance(answer, GossipReply) else 0.0
            if isinstance(answer, str) and not lapsed:
                return answer  # refused
            if partner.done():
                return None  # it sent us its contribution itself (a one-message exchange)
            request = GossipRequest(
                stage=self.stage,
                round=round_,
                sender=self.self_id,
                meta=mine.meta,
                tensors=mine.tensors,
            )
            outcome.num_sent += 1
            # agreed: the exchange may finish past the round's deadline. Ours goes up, then
            # the partner's comes back in the reply: each is allowed what its sender
            # announced, as a promise is (of the same stage: the same size, unless its
            # codec differs)
            cfg = self.config
            transfer_s = cfg.promise_s(mine.nbytes, mine.upload_s) + (
                cfg.promise_s(mine.nbytes, back_s) - cfg.request_timeout_s
            )
            self._sending_to = peer.peer_id
            self._sending_until = self.clock.now() + transfer_s
            reply = await self._request(peer, request, deadline, outcome, transfer_s)
            if isinstance(reply, str):
                return "lapsed" if lapsed else reply  # not asked again this round
        finally:
            self._target = self._sending_to = None
        if not partner.done():
            partner.set_result((peer.peer_id, Contribution(reply.tensors, reply.meta, back_s)))
        return None

    async def _request(
        self,
        peer: PeerRecord,
        request: GossipRequest | GossipFollow,
        deadline: float,
        outcome: RoundOutcome,
        timeout_s: float | None = None,
    ) -> GossipReply | str:
        """One request to ``peer``: its reply, or the refusal's code (counted). Without
        ``timeout_s`` it may take ``request_timeout_s``, cut at the round's deadline."""
        if timeout_s is None:
            timeout_s = min(self.config.request_timeout_s, deadline - self.clock.now())
        timeout = max(0.1, timeout_s)
        try:
            answer = await self.transport.request(peer.address, request, timeout, peer.peer_id)
            return expect(answer, GossipReply)
        except (TransportError, ValueError) as e:
            code = e.code if isinstance(e, TransportError) else "bad_reply"
            outcome.refusals[code] = outcome.refusals.get(code, 0) + 1
            log.debug("gossip round %d: %s answered %s", request.round, peer.peer_id[:8], code)
            return code

    async def handle_request(self, req: GossipRequest) -> GossipReply:
        """Answer a replica that wants to pair with us for ``req.round``."""
        if req.stage != self.stage:
            raise Refused("wrong_stage", f"this replica serves stage {self.stage}, not {req.stage}")
        if req.round <= self.completed:
            raise Refused("stale", f"round {req.round} is over here (at {self.completed})")
        await self._reach(req.round)
        partner = self._partner
        if partner is None:  # reached, with nothing sought: it follows in this round
            raise Refused("busy", f"round {req.round}: following here, nothing offered", 409)
        if partner.done():
            raise Refused("busy", f"round {req.round}: already paired", 409)
        promised = self._promised
        if promised is not None and self.clock.now() >= self._promise_until:
            promised = None  # lapsed: its proposer did not send in time
        if promised != req.sender and (
            promised is not None or self._target not in (None, req.sender)
        ):
            raise Refused(
                "busy", f"round {req.round}: promised to, or asking, another replica", 409
            )
        if req.propose:
            if self._sending_to == req.sender:  # ours is on its way to it: it should wait
                left_s = max(0.0, self._sending_until - self.clock.now())
                return GossipReply(round=req.round, meta={}, incoming=True, upload_s=left_s)
            if self._lapsed.get(req.sender, -math.inf) > self.clock.now():
                raise Refused(
                    "lapsed",
                    f"round {req.round}: your last promised contribution never came here; "
                    "send yours with the request (no promise is given)",
                    409,
                )
            if self._target == req.sender and self.self_id < req.sender:
                # we proposed to each other: the larger id accepts, so only ours stands
                raise Refused("busy", f"round {req.round}: our own proposal to you stands", 409)
            self._promised, self._promised_upload_s = req.sender, req.upload_s
            # its contribution is as large as ours (same stage; with sync.codec = auto a
            # partner on a faster uplink may send a larger codec, which that uplink carries
            # sooner): allow its upload, or what it says its uplink takes, within bounds
            assert self._mine is not None
            wait_s = self.config.promise_s(self._mine.nbytes, req.upload_s)
            self._promise_until = self.clock.now() + wait_s
            return GossipReply(round=req.round, meta={}, upload_s=self._mine.upload_s)
        assert self._mine is not None
        upload_s = self._promised_upload_s if promised == req.sender else 0.0
        partner.set_result((req.sender, Contribution(req.tensors, req.meta, upload_s)))
        self._sent_as_acceptor = True
        return GossipReply(round=req.round, meta=self._mine.meta, tensors=self._mine.tensors)

    async def handle_follow(self, req: GossipFollow) -> GossipReply:
        """Answer a replica that follows us in ``req.round``: our contribution to that
        round, if we still hold it (module docstring, point 7)."""
        if req.stage != self.stage:
            raise Refused("wrong_stage", f"this replica serves stage {self.stage}, not {req.stage}")
        if req.round < self._round or (req.round == self._round and self._mine is None):
            raise Refused("stale", f"round {req.round}: no contribution to it is kept here")
        await self._reach(req.round)
        mine = self._mine
        if mine is None:  # this replica follows in this round itself
            raise Refused("stale", f"round {req.round}: this replica offers nothing in it")
        if req.sender in self._followers:
            raise Refused("stale", f"round {req.round}: you were answered already", 409)
        if len(self._followers) >= self.config.max_followers:
            raise Refused(
                "busy", f"round {req.round}: {len(self._followers)} replicas follow here", 409
            )
        self._followers.add(req.sender)
        self.num_followers += 1
        self.bytes_to_followers += mine.nbytes
        return GossipReply(round=req.round, meta=mine.meta, tensors=mine.tensors)

    async def _reach(self, round_: int) -> None:
        """Return once this replica is in ``round_``: at once if it is; a request for a
        round it has not reached is held until it gets there, at most ``hold_s``
        (``not_ready``; ``busy`` when ``max_held`` wait already), and one for a round it
        skipped is ``stale``."""
        if round_ <= self._round:
            return
        if self._num_held >= self.config.max_held:
            raise Refused("busy", f"{self._num_held} requests already wait here", 409)
        self._num_held += 1
        try:
            async with asyncio.timeout(self.config.hold_s):
                while round_ > self._round:
                    await self._reached.wait()
        except TimeoutError:
            raise Refused(
                "not_ready",
                f"round {round_} not reached within {self.config.hold_s:.0f}s",
                503,
            ) from None
        finally:
            self._num_held -= 1
        if round_ != self._round:
            raise Refused("stale", f"round {round_} skipped here")
