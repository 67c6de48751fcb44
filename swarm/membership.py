"""Membership: bootstrap, failure detection by probes, and news spread by gossip.

Owns the protocol that keeps every node's ``PeerTable`` converging on the whole swarm (or on
its neighbourhood of stages, with summaries of the rest), at a cost per node that does not
grow with the swarm when it is quiet. After SWIM (Das, Gupta and
Motivala 2002, "SWIM: Scalable Weakly-consistent Infection-style Process Group Membership
Protocol"), ``docs/algorithms.md`` section 11:

- **Joining.** A node says ``Hello`` (its record and table) to every bootstrap or
  LAN-sighted address that no member holds; the ``Welcome`` carries the other side's table.
  One contact is enough to learn the whole swarm; the greeted node spreads the join (the
  tables exchanged are merged, not spread again).
- **News, not tables.** Every record carries a ``version`` only its peer raises; a node
  publishes a new one when something that matters to others changed (stage, readiness,
  address, relays, leaving...) and, for its changing figures (step, throughput, queue...), at
  most every ``refresh_s`` - an interval set so that spreading everyone's figures fits
  ``budget_bytes_per_s``. A node that learns something new (a newer record, a death)
  pushes it at once to ``fanout`` random members (infect and die), and piggybacks it on
  its next few pings and replies (``PIGGYBACK_MULT`` times log10 of the swarm's size), so
  news reaches every table in a few network round trips, no node misses it but with
  probability about e^-(fanout + piggybacks), and a quiet swarm repeats nothing. A
  piggyback counts as spent only when its message was answered: a member that cannot be
  dialled (behind a NAT, or down) does not use up news it never got.
- **Anti-entropy.** News that missed a node anyway (it could not be dialled while the news
  was fresh, and heard of it in none of the replies to its own requests) would be missed
  for good in a quiet swarm. So every ``sync_s`` or so (jittered; the first within one
  interval of starting) a node greets a random dialable member with its table and takes
  the member's table back, as hashicorp/memberlist's push-pull does. The node starts the
  exchange itself, so it works from behind a NAT. ``sync_s`` is at least ``SYNC_EVERY_S``
  and grows with the table so that the exchanges take at most ``SYNC_SHARE`` of the budget.
- **Failure detection.** Every ``heartbeat_s`` (jittered) a node pings the next member of a
  shuffled round-robin list (every member is pinged within one pass), and the member it
  *watches* (the next on the ring of its own stage's peer ids) when nothing has passed
  between them for ``WATCH_ROUNDS`` rounds: a bare ping, no news. Random pings alone reach
  each member about once a round, so the wait for a death's first miss is exponential, and
  one death in a hundred waits over 4.6 rounds at any size; a watcher misses it within
  about two rounds. Rapid (Suresh et al. 2018, "Stable and Consistent Membership at Scale
  with Rapid") watches each member from its neighbours on rings of ids. A member that does
  not answer is probed through ``indirect_probes`` others (a ``Probe``: maybe only our path
  to it is broken) and pinged again every round; one that no probe reaches for ``ttl_s``,
  and that has not spoken to the prober itself in that time, is buried and its
  ``Obituary`` spread (a member's own ping is proof of life: a node behind a NAT with no
  relay yet can be heard though not dialled). A member that hears its own obituary (a false
  alarm) publishes a higher ``incarnation`` (SWIM's), which outranks it: an obituary buries
  every record of its incarnation or below, so a prober that held an older version of a
  dead peer's record still buries the newer ones others hold; a node holding a newer
  incarnation than an obituary's probes the member at once and buries it if nothing
  reaches it. ``Leave`` buries at once.
- The address of a peer that was buried (not one that left) is greeted again, with a
  backoff from ``ttl_s`` up to ``LOST_RETRY_MAX_S``, for ``LOST_FORGET_S``: after a network
  partition heals, that is how the two sides find each other again when nothing else would.
- Only peers of the same swarm name and model fingerprint are admitted (``Hello``); others
  are refused with ``wrong_swarm``. News is taken only from members: a ``Ping`` from a
  stranger is refused ``unknown_peer`` (it says hello first), a ``Probe`` may only name a
  member (a helper dials the address it holds, never one it is given).

- **Neighbourhoods.** With a ``Neighbourhood`` scope on the table (``swarm.peers``), a node
  holds only its own stage and the stages next to it, so what it holds and the news it
  carries grow with a few stages, not the swarm. News goes only to members holding the
  stage it is about; a probe carries ``SUMMARIES_PER_MESSAGE`` ``StageSummary`` s of stages
  the receiver does not hold (a welcome all of them), and each node keeps the freshest of
  each; every ``FAR_EVERY_S`` or so it greets a random far stage's contact for its welcome's
  summaries (long links: otherwise a summary crosses the ring one neighbourhood a hop). A
  ``Hello`` carries the greeter's count of its own stage, which a receiver that does not
  hold it keeps (nothing else from it): a stage with no neighbour's replica yet is held by
  nobody else, and its replicas' greetings are how their bootstrap sees it. A
  newcomer whose bootstrap holds another neighbourhood greets a member of its own
  (a summary's contact, or a greeter its bootstrap kept in its lobby; failing both, the
  contact of the nearest stage it knows, nearer each time), who spreads the join; a node
  that moves tells its old neighbourhood itself. ``view`` is what the daemon's planners
  read of every stage (the table where held, the freshest summary elsewhere), and
  ``arrive`` is how a node that took a stage meets its new neighbourhood before it copies
  weights. ``docs/algorithms.md`` section 11.

- **Clocks.** Every ``Pong`` carries the replier's wall clock, so a pinger learns how far
  each member's clock is from its own at no extra message (``swarm.schedule.ClockOffsets``);
  ``stage_offset_s`` is what a replica adds to its clock to read its stage's, on which the
  outer rounds' grid is laid.

Departure from SWIM: there is no separate "suspect" state spread to others; the prober that
misses a member keeps probing it, directly and through others, for ``ttl_s`` before it
declares it gone, which buys the same protection against a slow node or a lossy path
without a third kind of news.

``IntroducingTransport`` applies one rule of this protocol to every other request: a peer
that refuses us as ``unknown_peer`` (it has not heard of us yet; keyed swarms refuse
strangers' microbatches and gossip) is sent one ``Hello`` and asked once more.

Does not own discovery on the LAN (``swarm.discovery`` feeds addresses in through
``add_address``), nor sockets (the ``Transport`` seam), nor what the table is used for.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from protocol.messages import (
    Hello,
    Leave,
    Message,
    Obituary,
    PeerRecord,
    Ping,
    Pong,
    Probe,
    StageSummary,
    Welcome,
    expect,
)
from swarm.peers import NEW, PeerTable, dialled_first
from swarm.schedule import ClockOffsets
from swarm.seams import NO_ANSWER, Clock, Refused, Transport, TransportError

log = logging.getLogger(__name__)

LOST_RETRY_MAX_S = 30.0
"""Longest wait between two contacts of a buried peer's address."""
LOST_FORGET_S = 3600.0
"""How long a buried peer's address is greeted again before it is forgotten."""
STAGE_CLOCK_HOLD_S = 60.0
"""How long a replica that dropped out of the table without leaving (no probe reached it for
``ttl_s``: a stalled machine, a lost link) still counts in its stage's clock
(``stage_offset_s``). Without it, of two replicas whose clocks differ by D, one that misses
the other's pings for a few seconds reads the stage's clock jump by D/2 and back: it takes an
outer round at a boundary D/2 ahead, then waits out ``CLOCK_BACK_WAIT_S`` (``node.services
.sync``) to restart its rounds, and the pair goes solo meanwhile (seen in the clock set-back
process test: 17 s and two solo rounds lost). A replica that left (a goodbye) or moved to
another stage stops counting at once."""
RECORD_BYTES = 250
"""About what one record costs on the wire (msgpack with field names), for the budget."""
EXCHANGE_BYTES = 300
"""About what HTTP adds to one request and its reply (request line, status line, headers):
a push pays it (its reply carries no record), a piggyback rides on a ping sent anyway."""
PIGGYBACK_MULT = 4
"""Each piece of news rides on ``PIGGYBACK_MULT * ceil(log10(n + 1))`` messages per node (SWIM's
lambda log n; hashicorp/memberlist uses a multiplier of 4 with 3 gossip targets; with 3 a
death went unheard by one node of 60 in the benchmark's smoke run)."""
LOBBY_PER_STAGE = 2
"""Greeters a node keeps per stage outside its neighbourhood, to introduce to later greeters
of that neighbourhood."""
SUMMARY_BYTES = 90
"""About what one stage summary costs on the wire."""
SUMMARIES_PER_MESSAGE = 4
"""Stage summaries one probe carries (in turn over the stages the receiver does not hold),
when tables hold a neighbourhood: every node sends one probe a round and is probed about
once, so it hears of every stage every ``stages / SUMMARIES_PER_MESSAGE`` rounds or so."""
WATCH_ROUNDS = 1.5
"""A node pings the member it watches (the next on its stage's ring of ids) once they have
not spoken for this many rounds: every two rounds at most, if nothing else passes between
them."""
FAR_EVERY_S = 30.0
"""Mean seconds between a node's greetings of a far stage's contact (with neighbourhood
tables), whose welcome brings its summaries of every stage: news of a stage otherwise travels
the ring of stages one neighbourhood at a time, a minute and more across 80 stages."""
BOOTSTRAP_ADVICE = {
    "auth_stale": "a keyed swarm refuses requests stamped more than a minute off its clock "
    "(this node takes the swarm's time from the refusal's seal and greets it again): set "
    "this machine's clock (NTP: timedatectl set-ntp true)",
}
"""What a volunteer can do about a bootstrap's refusal, by code, where the refusal (written
from the refusing node's side) does not say it."""
MAX_NEWS = 64
"""Most news items one message carries (a burst, such as a healed partition, takes turns)."""
PUSH_DELAY_S = 0.1
"""How long news waits before it is pushed on, so news arriving together travels together."""
SYNC_EVERY_S = 30.0
"""Shortest mean interval between a node's whole-table exchanges (anti-entropy, above)."""
SYNC_SHARE = 0.2
"""Of ``budget_bytes_per_s``, what whole-table exchanges may take (in and out): in a larger
table they are rarer, so that they cost a node the same at any size."""
FIGURES = frozenset(
    {
        "step",
        "throughput",
        "queue",
        "grad_norm",
        "loss",
        "step_s",
        "relay_slots",
        "incarnation",
        "version",
    }
)
"""Record fields that change all the time: republished every ``refresh_s``, not at once."""


Tables = Literal["neighbourhood", "swarm"]


def _contactable(record: PeerRecord) -> bool:
    """Whether a summary may name ``record`` as its stage's contact: ready, and dialled
    directly (a relayed peer's address is private)."""
    return record.ready and not record.relays and bool(record.address)


@dataclass(frozen=True)
class MembershipConfig:
    heartbeat_s: float = 1.0
    """Seconds between probe rounds (each round is jittered by +-20 %)."""
    ttl_s: float = 8.0
    """A member that no probe (direct or through others) reached for this long is gone."""
    fanout: int = 4
    """Members a node pushes each piece of news to when it first learns it."""
    indirect_probes: int = 3
    """Members asked to probe a member that did not answer our own ping."""
    probe_timeout_s: float = 1.0
    """Deadline of one ping (a probe through others gets twice as long, and a bit)."""
    request_timeout_s: float = 3.0
    """Deadline of one hello or leave, and of a push of news."""
    budget_bytes_per_s: float = 2000.0
    """Membership traffic per node that spreading everyone's changing figures (step,
    throughput...) may take, in and out together: it sets ``refresh_s`` from the swarm's size."""
    max_peers: int = 16384
    """Most peers a table holds: news of more is ignored until some are buried or leave."""
    tables: Tables = "neighbourhood"
    """What a node's table holds: "neighbourhood" (records of its own stage and the stages
    next to it, summaries of the rest; with three stages or fewer that is everyone) or
    "swarm" (everyone's records, whatever the size)."""


class MembershipService:
    """Keeps ``table`` current by talking to peers through ``transport``."""

    def __init__(
        self,
        config: MembershipConfig,
        *,
        swarm: str,
        fingerprint: str,
        table: PeerTable,
        transport: Transport,
        clock: Clock,
        self_record: Callable[[], PeerRecord],
        rng: random.Random,
        first_incarnation: int = 1,
    ) -> None:
        self.config = config
        self.swarm = swarm
        self.fingerprint = fingerprint
        self.table = table
        self.transport = transport
        self.clock = clock
        self.self_record = self_record
        self.rng = rng
        self.bootstrap: list[str] = []
        self._sighted: set[str] = set()
        self._lost: dict[str, _Lost] = {}  # addresses of buried peers, greeted with backoff
        self.observed_host: str | None = None
        self.num_rounds = 0
        self.num_buried = 0
        """Members this node found gone (no probe reached them for ``ttl_s``)."""
        self._incarnation = first_incarnation
        self._version = 0
        self._published: PeerRecord | None = None
        self._published_s = -math.inf
        self._pace = 1.0  # this interval's share of refresh_s, drawn in [0.5, 1.5)
        self._news: dict[str, _News] = {}  # peer id -> the latest news about it to pass on
        self._far: dict[int, tuple[StageSummary, float]] = {}  # stage not held -> (summary, as of)
        self._summary_turn = 0
        self._centred_s = -math.inf  # when our table was last centred on a stage
        self._greeted_contacts: dict[str, float] = {}  # contact address -> when greeted
        self._answered_far: set[str] = set()  # addresses that welcomed us from outside our scope
        self._lobby: dict[int, list[tuple[PeerRecord, float]]] = {}  # far greeters per stage
        self._far_next_s: float | None = None  # when we next greet a far stage's contact
        self._far_failed: dict[str, float] = {}  # far contacts that failed -> when
        self._sync_next_s: float | None = None  # when we next exchange tables with a member
        self._push: asyncio.Task[None] | None = None
        self._order: list[str] = []  # this pass of the round-robin, next target last
        self._missing: dict[str, float] = {}  # member -> when a probe first missed it
        self._others_missed: set[str] = set()  # missing members others could not reach either
        self._probing: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._leaving = False
        self.clocks = ClockOffsets()
        """How far each member's wall clock is from ours, measured on our pings."""
        self._clock_stage: int | None = None
        self._clock_peers: dict[str, float] = {}
        """Replicas of ``_clock_stage`` (the stage ``stage_offset_s`` last read) -> when
        it last found each in the table."""
        self._told: dict[str, str] = {}  # bootstrap address -> the outcome last logged

    # -- this node's record --------------------------------------------------------------

    def own(self) -> PeerRecord:
        """Our record as last published; a change that matters to others
        (anything but the figures) is published at once."""
        return self._own(self.self_record())

    def published(self) -> PeerRecord | None:
        """Our record as peers last had it, with no publishing (None before the first)."""
        return self._published

    def _own(self, record: PeerRecord) -> PeerRecord:
        if self._published is None or _essentials(record) != _essentials(self._published):
            self._publish(record, self.clock.now())
        assert self._published is not None
        return self._published

    def status(self) -> dict[str, float | int]:
        """What ``node status`` shows of membership."""
        own = self.own()
        return {
            "incarnation": own.incarnation,
            "version": own.version,
            "refresh_s": round(self.refresh_s(), 1),
            "sync_s": round(self.sync_s(), 1),
            "buried": self.num_buried,
            "news_waiting": len(self._news),
        }

    def current(self) -> PeerRecord:
        """Our record with its figures of the moment, as the published one otherwise: what
        we tell a peer directly (it takes figures from us at any time, news only when the
        record is newer)."""
        record = self.self_record()  # built once: the daemon makes it anew each call
        own = self._own(record)
        return replace(record, incarnation=own.incarnation, version=own.version)

    def refresh_s(self) -> float:
        """How often our changing figures are republished: everyone's figures, each pushed
        ``fanout`` times and piggybacked by every node that takes it, in and out, within
        the budget (less what stage summaries take, with neighbourhood tables)."""
        n = len(self.table) + 1
        pushes = min(self.config.fanout, max(1, n - 1))
        per_node = pushes * (RECORD_BYTES + EXCHANGE_BYTES) + self._piggybacks(n) * RECORD_BYTES
        budget = self.config.budget_bytes_per_s
        others = 2 * self._sync_bytes() / self.sync_s()  # we start one, are asked about one
        if self.table.scope is not None:  # each probe carries some, in and out, and each
            others += 2 * SUMMARIES_PER_MESSAGE * SUMMARY_BYTES / self.config.heartbeat_s
            far = len(self._stages()) * SUMMARY_BYTES + RECORD_BYTES + EXCHANGE_BYTES
            others += 2 * far / FAR_EVERY_S  # far greeting brings all (we answer as many)
        budget = max(budget / 2, budget - others)
        return max(self.config.heartbeat_s, n * per_node * 2 / budget)

    def _sync_bytes(self) -> int:
        """About what one whole-table exchange costs: our table out, the member's back."""
        return 2 * (len(self.table) + 1) * RECORD_BYTES + EXCHANGE_BYTES

    def sync_s(self) -> float:
        """Mean seconds between our whole-table exchanges: at least ``SYNC_EVERY_S``, and
        as long as the exchanges we start and those we answer (about as many) need to fit
        into ``SYNC_SHARE`` of the budget."""
        share = SYNC_SHARE * self.config.budget_bytes_per_s
        return max(SYNC_EVERY_S, 2 * self._sync_bytes() / share)

    def _publish(self, record: PeerRecord, now: float) -> None:
        self._version += 1
        self._published = replace(record, incarnation=self._incarnation, version=self._version)
        self._published_s = now
        self._pace = 0.5 + self.rng.random()  # so that nodes started together drift apart
        left_behind: list[PeerRecord] = []
        if record.stage != self.table.stage:
            if self.table.scope is not None and self.table.stage >= 0:
                left_behind = self.table.records()
            self.table.set_stage(record.stage)
            self._centred_s = now
        self._tell(self._published)
        if left_behind:  # our old neighbourhood holds us no longer: tell it so
            msg = self._ping_msg([self._published], [], ask_record=False)
            timeout_s = self.config.request_timeout_s
            for peer in self.rng.sample(left_behind, min(self.config.fanout, len(left_behind))):
                self._spawn(self._tell_directly(peer, msg, timeout_s))

    def out_of_step(self, fraction: float) -> None:
        """Date our last publication ``fraction`` of the way through the current refresh
        interval (a simulation starting a swarm that has run for a while, its nodes'
        refreshes out of step)."""
        self.own()
        self._published_s = self.clock.now() - fraction * self._pace * self.refresh_s()

    def _refresh(self, now: float) -> None:
        record = self.self_record()
        published = self.own()
        if now - self._published_s >= self._pace * self.refresh_s() and record != replace(
            published, incarnation=record.incarnation, version=record.version
        ):
            self._publish(record, now)

    # -- news ------------------------------------------------------------------------------

    @staticmethod
    def _piggybacks(n: int) -> int:
        """Pings and replies one piece of news rides on, per node."""
        return PIGGYBACK_MULT * max(1, math.ceil(math.log10(n + 1)))

    def _tell(self, item: PeerRecord | Obituary, stages: tuple[int, ...] | None = None) -> None:
        """Pass ``item`` on: pushed soon to ``fanout`` members, then piggybacked; only to
        members whose tables hold one of ``stages`` (the stages of the peer it is about,
        before and after a move; None: any member, as for our own record)."""
        if stages is None and isinstance(item, PeerRecord) and item.peer_id != self.table.self_id:
            stages = (item.stage,)
        self._news[item.peer_id] = _News(item, self._piggybacks(len(self.table) + 1), stages)
        if self._push is None or self._push.done():
            self._push = self._spawn(self._push_news())

    def _wants(self, news: _News, stage: int) -> bool:
        """Whether a member of ``stage`` holds the stages ``news`` is about."""
        return news.stages is None or any(self.table.covers(s, stage) for s in news.stages)

    def _piggyback(self, stage: int = -1, heard: Ping | None = None) -> list[_News]:
        """News for one more message, to a member of ``stage``: up to ``MAX_NEWS`` items it
        wants, the least spread first, less what it has just told us (``heard``: a reply
        spent on news its asker brought would be spent for nothing). Counted as spent; a
        ping that is not answered gives them back (``_unspend``)."""
        known = {} if heard is None else _brought(heard)
        wanted = [
            n
            for n in self._news.values()
            if self._wants(n, stage) and known.get(n.item.peer_id) != _news_key(n.item)
        ]
        items = sorted(wanted, key=lambda n: -n.piggy_left)[:MAX_NEWS]
        for news in items:
            news.piggy_left -= 1
        self._drop_spent(items)
        return items

    def _unspend(self, items: list[_News]) -> None:
        """Give back the piggybacks of a message that was not answered (unless newer news
        of the same peer has taken an item's place meanwhile)."""
        for news in items:
            if self._news.setdefault(news.item.peer_id, news) is news:
                news.piggy_left += 1

    def _drop_spent(self, items: list[_News]) -> None:
        for news in items:
            if news.pushed and news.piggy_left <= 0:
                self._news.pop(news.item.peer_id, None)

    async def _push_news(self) -> None:
        """Push every item not pushed yet to ``fanout`` random members, ``MAX_NEWS`` items
        a message; a member that does not answer is probed from the next round on."""
        await self.clock.sleep(PUSH_DELAY_S)
        while True:
            items = [n for n in self._news.values() if not n.pushed][:MAX_NEWS]
            members = self.table.records()
            for news in items:
                news.pushed = True  # to nobody when we know nobody: it still rides on pings
            if not items or not members:
                self._drop_spent(items)
                return
            self._drop_spent(items)
            groups: dict[tuple[tuple[int, ...] | None, bool], list[_News]] = {}
            for news in items:  # whole-swarm tables: every member takes every item
                death = isinstance(news.item, Obituary)
                key = (news.stages, death) if self.table.scope else (None, False)
                groups.setdefault(key, []).append(news)
            batches: dict[str, tuple[PeerRecord, list[_News]]] = {}
            for group in groups.values():  # to fanout members that hold what it is about
                takers = [p for p in members if self._wants(group[0], p.stage)]
                fanout = self.config.fanout
                if self.table.scope is not None and isinstance(group[0].item, Obituary):
                    # a holder in a stage next to the news' own is held by two of the
                    # three holding stages, so it gets about 0.8 fanout pushes (the
                    # news' own stage 1.3): a death, the news routing needs soonest,
                    # goes to twice as many
                    fanout *= 2
                for p in self.rng.sample(takers, min(fanout, len(takers))):
                    batches.setdefault(p.peer_id, (p, []))[1].extend(group)
            targets = [p for p, _ in batches.values()]
            msgs = [
                self._ping_msg(*_split(batch), ask_record=False) for _, batch in batches.values()
            ]
            timeout_s, start = self.config.request_timeout_s, self.clock.now()
            answered = await asyncio.gather(
                *(self._ping(p, m, timeout_s) for p, m in zip(targets, msgs, strict=True))
            )
            for target, ok in zip(targets, answered, strict=True):
                if not ok:
                    self._missing.setdefault(target.peer_id, start)

    def _take(
        self, news: list[PeerRecord], deaths: list[Obituary], via: str, spread: bool = True
    ) -> None:
        """Merge news from a member (``via``: what it says of itself is its own word, the
        only way a NATed member's new relays reach a peer that dials its old address) and
        pass on what was new (what a greeting brings is merged, not passed on: a newcomer
        would repeat the whole swarm)."""
        now = self.clock.now()
        for record in news:
            held = self.table.get(record.peer_id)
            outcome = self.table.observe(record, now, direct=record.peer_id == via)
            if outcome is None or not spread:
                if outcome == NEW:
                    log.debug("learned of peer %s from %s's table", record.peer_id[:8], via[:8])
                continue
            if outcome == NEW:
                log.info(
                    "learned of peer %s: stage %d at %s via %s",
                    record.peer_id[:8],
                    record.stage,
                    record.address,
                    via[:8],
                )
            moved = held is not None and held.stage != record.stage
            self._tell(record, (held.stage, record.stage) if moved and held else None)
        for death in deaths:
            if death.peer_id == self.table.self_id:
                if death.incarnation >= self._incarnation and not self._leaving:
                    log.warning("reported gone by %s (false alarm): answering", via[:8])
                    self._incarnation = death.incarnation + 1
                    self._publish(self.self_record(), now)
                continue
            held = self.table.get(death.peer_id)
            if held is not None and held.incarnation > death.incarnation:
                # its prober held an older incarnation: probe it ourselves now, and bury it
                # at once if nothing reaches it (the prober has waited ttl_s already)
                self._missing.setdefault(death.peer_id, now - self.config.ttl_s)
                continue
            if death.left:
                self._left(death.peer_id)
            if self.table.bury(death.peer_id, death.incarnation, now):
                if held is not None:
                    log.info("peer %s %s", death.peer_id[:8], "left" if death.left else "gone")
                    if not death.left:
                        self._lose(held.address, now)
                if spread and held is not None:
                    self._tell(death, (held.stage,))
                elif spread and self.table.scope is None:
                    self._tell(death)  # whole-swarm tables: everyone holds it, or will

    # -- stage summaries -------------------------------------------------------------------

    def summaries(self) -> dict[int, StageSummary]:
        """What this node knows of each stage: computed from its table for the stages it
        holds, as last relayed by others (``age_s`` grown since) for the rest."""
        now = self.clock.now()
        known = (self._summary(stage, now) for stage in sorted(self._stages()))
        return {summary.stage: summary for summary in known if summary is not None}

    def _stages(self) -> set[int]:
        """The stages we hold or have a summary of."""
        scope = self.table.scope
        if scope is None:
            return {r.stage for r in (*self.table.records(), self.self_record()) if r.stage >= 0}
        if self.table.stage < 0:  # a newcomer holds what it met, not every stage
            return set(self._far) | {r.stage for r in self.table.records() if r.stage >= 0}
        return set(self._far) | {s for s in range(scope.num_stages) if self.table.covers(s)}

    def view(self) -> dict[int, StageSummary]:
        """Every stage this node knows of, as the daemon's planners read it: counted from the
        table (and our own record) for the stages it holds, the freshest summary relayed by
        others for the rest; a stage it knows nothing of is absent. Picks no contact (that
        is for greeting) and so draws nothing from ``rng``."""
        now, own = self.clock.now(), self.self_record()
        stages = sorted(self._stages())
        known = (self._summary(stage, now, pick=False, own=own) for stage in stages)
        return {summary.stage: summary for summary in known if summary is not None}

    def _summary(
        self, stage: int, now: float, pick: bool = True, own: PeerRecord | None = None
    ) -> StageSummary | None:
        """Counted from the table for a stage we hold; relayed for the rest, for a held
        stage we have not met yet (just after a join or a move), and, before we take a
        stage, for any stage a peer summarised for us."""
        far = self._far.get(stage)
        own = own or self.self_record()
        records = self.table.replicas(stage, ready_only=False) if self.table.covers(stage) else []
        if own.stage == stage and not own.leaving:
            records.append(own)
        # a newcomer (no stage yet) has met some replicas of many stages, all of few: it
        # counts a stage only when nobody has told it better
        newcomer = self.table.scope is not None and self.table.stage < 0
        if far is not None and (newcomer or not records):
            return replace(far[0], age_s=round(now - far[1], 3))
        if not self.table.covers(stage) or (newcomer and not records):
            return None  # not ours to count: a newcomer's "no replica" is only "not met"
        summary = StageSummary(
            stage=stage,
            replicas=len(records),
            ready=sum(r.ready for r in records),
            throughput=sum(r.throughput for r in records if r.ready),
            step=max((r.step for r in records), default=0),
            age_s=0.0,
        )
        return replace(summary, contact=self._contact(records, own, now)) if pick else summary

    def _contact(self, records: list[PeerRecord], own: PeerRecord, now: float) -> str:
        """A replica of ``records`` for a newcomer to greet: dialable and ready, and one
        that spoke to us lately (or we ourselves) if any, the least likely to be dead."""
        dialable = [r for r in records if _contactable(r)]
        lately = [
            r.address
            for r in dialable
            if r.peer_id == own.peer_id or self._spoke_lately(r.peer_id, now)
        ]
        contacts = lately or [r.address for r in dialable]
        return self.rng.choice(contacts) if contacts else ""

    def _summaries_for(self, stage: int, everything: bool = False) -> list[StageSummary]:
        """Summaries for a node of ``stage``: in a welcome (``everything``), of every stage
        whose records it does not get from us (it may hold them, we do not: their contacts
        lead it there); on a probe, ``SUMMARIES_PER_MESSAGE`` in turn of the stages it does
        not hold."""
        if self.table.scope is None:
            return []
        if everything:
            both = self.table.covers
            wanted = sorted(s for s in self._stages() if not (both(s) and both(s, stage)))
        else:
            wanted = sorted(s for s in self._stages() if not self.table.covers(s, stage))
        if not everything and len(wanted) > SUMMARIES_PER_MESSAGE:
            start = self._summary_turn % len(wanted)
            self._summary_turn += SUMMARIES_PER_MESSAGE
            wanted = (wanted[start:] + wanted[:start])[:SUMMARIES_PER_MESSAGE]
        now = self.clock.now()
        known = (self._summary(s, now) for s in wanted)
        return [summary for summary in known if summary is not None]

    def _own_stage(self) -> list[StageSummary]:
        """What a greeting carries of our stage: our count of its replicas (we among them),
        with ourselves as its contact when we can be dialled. A stage none of whose
        neighbours has a replica is held by nobody outside it; its replicas, holding nobody,
        greet their bootstrap every round, and this is how it hears of them (and of the
        moment they serve)."""
        own = self.self_record()
        if self.table.scope is None or own.stage < 0 or own.leaving:
            return []
        far = self._far.get(own.stage)  # others, said a summary, and we hold none of them:
        met = any(r.stage == own.stage for r in self.table.records())
        if far is not None and far[0].replicas > 1 and not met:  # our count would be short
            return []
        summary = self._summary(own.stage, self.clock.now(), pick=False, own=own)
        if summary is None:
            return []
        return [replace(summary, contact=own.address if _contactable(own) else "")]

    def _take_greeters_stage(self, sender: PeerRecord, summaries: list[StageSummary]) -> None:
        """Keep a greeter's summary of its own stage when we do not hold that stage; what it
        says of other stages is not taken, and it may name only itself as the stage's
        contact (a greeting is not a member's relay: a stranger must not steer joiners)."""
        for summary in summaries:
            if summary.stage == sender.stage and not self.table.covers(summary.stage):
                contact = summary.contact if summary.contact == sender.address else ""
                self._take_summaries([replace(summary, contact=contact)])

    def _take_summaries(self, summaries: list[StageSummary]) -> None:
        """Keep the freshest summary of each stage of the swarm (stages past the pipeline's
        last are not kept: a hostile peer cannot grow the map)."""
        scope = self.table.scope
        if scope is None:
            return
        now = self.clock.now()
        for summary in summaries:
            if summary.stage >= scope.num_stages:
                continue
            as_of = now - summary.age_s
            held = self._far.get(summary.stage)
            if held is None or as_of > held[1]:
                self._far[summary.stage] = (summary, as_of)

    def _far_contact(self, now: float, held: set[str]) -> tuple[int, str] | None:
        """Every ``FAR_EVERY_S`` or so (jittered, so that nodes do not bunch), a random stage
        we do not hold and its contact: random long links make the stages' summaries spread
        through the whole swarm in a few exchanges, not one neighbourhood per hop. A contact
        that failed (no welcome, another swarm, another stage) is not greeted again for
        ``LOST_FORGET_S``: a summary may name any address, and without that a member that
        lies in its summaries could turn every node's greetings on an outsider."""
        if self.table.scope is None or self.table.stage < 0:
            return None
        if self._far_next_s is None:  # just arrived: the welcome brought summaries
            self._far_next_s = now + FAR_EVERY_S * self.rng.random()
        if now < self._far_next_s:
            return None
        self._far_next_s = now + FAR_EVERY_S * (0.5 + self.rng.random())
        self._far_failed = {a: t for a, t in self._far_failed.items() if now - t < LOST_FORGET_S}
        contacts = sorted(
            (stage, summary.contact)
            for stage, (summary, _) in self._far.items()
            if not self.table.covers(stage)
            and summary.contact
            and summary.contact not in held
            and summary.contact not in self._far_failed
        )
        return self.rng.choice(contacts) if contacts else None

    async def _ask_far(self, stage: int, address: str) -> None:
        """Greet ``stage``'s contact for its summaries (not its table: it holds none of
        ours), taking nothing else from its welcome."""
        try:
            welcome = await self._hello(address, [], want_table=True)
        except (TransportError, ValueError) as e:
            log.debug("far hello to %s failed: %s", address, e)
            self._far_failed[address] = self.clock.now()
            return
        ours = (welcome.swarm, welcome.fingerprint) == (self.swarm, self.fingerprint)
        if not ours or welcome.sender.stage != stage:
            self._far_failed[address] = self.clock.now()
            return
        self._take_summaries(welcome.stages)

    def _contacts_due(self, now: float, held: set[str]) -> set[str]:
        """Addresses to greet for the stages we hold no record of though we should (we just
        joined or moved there): the contacts their summaries name, each at most every
        ``ttl_s``."""
        if self.table.scope is None or self.table.stage < 0:
            return set()
        ttl_s = self.config.ttl_s
        self._greeted_contacts = {
            a: t for a, t in self._greeted_contacts.items() if now - t < ttl_s
        }
        present = {r.stage for r in self.table.records()} | {self.table.stage}
        due: set[str] = set()
        for stage, (summary, _) in self._far.items():
            address = summary.contact
            if stage in present or not self.table.covers(stage) or not address or address in held:
                continue
            if address not in self._greeted_contacts:
                self._greeted_contacts[address] = now
                due.add(address)
        return due

    def _forget_met(self, now: float) -> None:
        """Drop relayed summaries of the stages we hold once we hold records of them, or
        once we have held them for ``2 ttl_s`` (their replicas are gone: our table says so)."""
        if self.table.scope is None or self.table.stage < 0:
            return
        present = {r.stage for r in self.table.records()}
        settled = now - self._centred_s > 2 * self.config.ttl_s
        for stage in [s for s in self._far if self.table.covers(s)]:
            if stage in present or settled:
                del self._far[stage]

    def unmet(self) -> list[int]:
        """Stages we hold but have no record of, though a summary says they have replicas
        (just after a join or a move: their records come from their contacts)."""
        if self.table.scope is None or self.table.stage < 0:
            return []
        present = {r.stage for r in self.table.records() if not r.leaving}
        return sorted(
            stage
            for stage, (summary, _) in self._far.items()
            if self.table.covers(stage) and stage not in present and summary.replicas > 0
        )

    async def arrive(self, timeout_s: float) -> bool:
        """Publish the stage just taken and, with neighbourhood tables, greet the contacts of
        the stages now held until the table has a record of each that has replicas (a mover
        needs its new neighbours' records before it copies or rebuilds weights). False if
        some are still unmet after ``timeout_s`` (their contacts are gone: the next rounds go
        on asking)."""
        self.own()  # re-centres the table on our new stage
        deadline = self.clock.now() + timeout_s
        while unmet := self.unmet():
            now = self.clock.now()
            if now >= deadline:
                log.warning("no record yet of held stage(s) %s after %.0fs", unmet, timeout_s)
                return False
            held = {p.address for p in self.table.records()} | {self.self_record().address}
            due = self._contacts_due(now, held) or self._nearest_contact(held)
            await asyncio.gather(*(self._greet(a) for a in sorted(due)))
            await self.clock.sleep(0.2)
        return True

    # -- rounds ----------------------------------------------------------------------------

    def add_bootstrap(self, addresses: list[str]) -> None:
        """Addresses to keep greeting while no member answers from them."""
        self.bootstrap.extend(a for a in addresses if a not in self.bootstrap)

    def add_address(self, address: str) -> None:
        """An address seen on the LAN; greeted in the next round unless already known."""
        if address != self.self_record().address:
            self._sighted.add(address)

    async def run(self) -> None:
        """Rounds until cancelled (a round's slow probes run on while the next one starts)."""
        try:
            while True:
                self._spawn(self.round())
                jitter = 1.0 + 0.2 * (2 * self.rng.random() - 1)
                await self.clock.sleep(self.config.heartbeat_s * jitter)
        finally:
            for task in list(self._tasks):
                task.cancel()

    async def round(self) -> None:
        """One round: republish if due, ping the next member and those that missed a ping,
        greet bootstrap, sighted and due buried addresses."""
        now = self.clock.now()
        self.table.forget_graves(now)
        self.clocks.forget([*(r.peer_id for r in self.table.records()), *self._clock_peers])
        self._forget_met(now)
        self._refresh(now)
        target = self._next_target()
        missing = [p for p in self._missing if p in self.table]
        self._missing = {p: self._missing[p] for p in missing}
        self._others_missed &= set(missing)
        probes = [self._probe_once(p) for p in dict.fromkeys([*missing, *target])]
        own = self.self_record()
        watched = self._watched(own.stage)
        if watched is not None and watched not in (*missing, *target) and self._due(watched, now):
            probes.append(self._probe_once(watched, bare=True))
        held = {p.address for p in self.table.records()} | {own.address}
        if not len(self.table):
            self._answered_far.clear()  # we hold nobody: greet everyone we know of again
        answered = held | self._answered_far  # a bootstrap outside our scope is not held
        greet = {a for a in (*self.bootstrap, *self._sighted) if a not in answered}
        greet |= self._lost_due(now, held) | self._contacts_due(now, held)
        self._sighted -= greet
        if (far := self._far_contact(now, held)) is not None:
            self._spawn(self._ask_far(*far))
        if (partner := self._sync_partner(now)) is not None:
            self._spawn(self._sync(partner))
        await asyncio.gather(*probes, *(self.contact(a) for a in sorted(greet)))
        self.num_rounds += 1

    def _tell_bootstrap(self, address: str, code: str, why: str) -> None:
        """Say (once per outcome) how greeting a bootstrap address went: a volunteer whose
        bootstrap refuses it (a wrong key or model, a clock too far off for a keyed swarm)
        or cannot be reached would otherwise serve alone and never know why. ``code``
        empty: it answered."""
        if address not in self.bootstrap or self._told.get(address, "") == code:
            return
        if code:
            log.warning(
                "bootstrap %s: %s (%s)%s; greeting it again every round",
                address,
                "did not answer" if code in NO_ANSWER else "refused us",
                why,
                f"; {BOOTSTRAP_ADVICE[code]}" if code in BOOTSTRAP_ADVICE else "",
            )
        else:
            log.info("bootstrap %s answered", address)
        self._told[address] = code

    def _sync_partner(self, now: float) -> str | None:
        """Every ``sync_s`` or so (jittered, the first within one interval), the address of
        a random member to exchange tables with: one dialled directly (a relayed member's
        address is private)."""
        if self._sync_next_s is None:
            self._sync_next_s = now + self.sync_s() * self.rng.random()
        if now < self._sync_next_s:
            return None
        self._sync_next_s = now + self.sync_s() * (0.5 + self.rng.random())
        members = sorted(r.address for r in self.table.records() if not r.relays and r.address)
        return self.rng.choice(members) if members else None

    async def refresh(self, tries: int = 3) -> bool:
        """Exchange whole tables now with a member that can be dialled (one serving a stage
        first), as the anti-entropy rounds do every ``sync_s``: for a decision that must see
        the swarm as it is, not as the news that happened to reach this node (a joiner
        choosing its stage). A node nobody could dial until its relay came missed the news
        pushed meanwhile, and a quiet swarm repeats none. False if none of ``tries``
        members answered."""
        members = [r for r in dialled_first(self.table.records(), self.rng) if not r.relays]
        for record in members[:tries]:
            if await self.contact(record.address):
                return True
        return False

    async def _sync(self, address: str) -> None:
        """Exchange whole tables with a member (anti-entropy): what either side missed of
        the news is merged, not spread again (the other nodes exchange tables too)."""
        if not await self.contact(address):
            log.debug("table exchange with %s failed", address)

    def _next_target(self) -> list[str]:
        """The next member of a shuffled round-robin pass (SWIM section 4.3)."""
        while self._order:
            peer_id = self._order.pop()
            if peer_id in self.table:
                return [peer_id]
        self._order = [p.peer_id for p in self.table.records()]
        self.rng.shuffle(self._order)
        return [self._order.pop()] if self._order else []

    def _watched(self, stage: int) -> str | None:
        """The member we watch: the one after us on the ring of our stage's peer ids (sorted,
        wrapping round), if our ``stage`` has another member."""
        if stage < 0:
            return None
        ring = sorted(r.peer_id for r in self.table.records() if r.stage == stage)
        me = self.table.self_id
        return next((p for p in ring if p > me), ring[0]) if ring else None

    def _due(self, watched: str, now: float) -> bool:
        """Whether the member we watch has been silent (no ping between us either way) for
        ``WATCH_ROUNDS`` rounds."""
        silent_s = self.table.silent_s(watched, now)
        return silent_s is None or silent_s >= WATCH_ROUNDS * self.config.heartbeat_s

    async def _probe_once(self, peer_id: str, bare: bool = False) -> None:
        task = self._probing.get(peer_id)
        if task is None or task.done():
            task = self._probing[peer_id] = self._spawn(self._probe(peer_id, bare))
        await asyncio.shield(task)

    async def _probe(self, peer_id: str, bare: bool = False) -> None:
        """Ping a member, then through others; bury it once none reached it for ``ttl_s``
        (checked after each failed ping, once others have failed to reach it too). A
        ``bare`` ping (a watcher's) carries no news or summaries and asks for no record."""
        record = self.table.get(peer_id)
        if record is None:
            return
        start = self.clock.now()
        items = [] if bare else self._piggyback(record.stage)
        if bare:
            msg = self._ping_msg([], [], ask_record=False)
        else:
            msg = self._ping_msg(*_split(items), stage=record.stage)
        if await self._ping(record, msg, news=items):
            self._found(peer_id)
            return
        since = self._missing.setdefault(peer_id, start)
        # one that spoke to us lately (its own ping) is alive, though we cannot dial it
        # (behind a NAT with no relay yet); others could not either: pinged again next round
        if not self._spoke_lately(peer_id, self.clock.now()):
            if peer_id in self._others_missed and self._bury_if_due(record, since):
                return
            if await self._probe_through_others(record):
                self._found(peer_id)
                return
            self._others_missed.add(peer_id)  # others could not reach it either
            if self._bury_if_due(record, since):
                return
        await self._last_chance(record, msg, since)

    async def _last_chance(self, record: PeerRecord, msg: Ping, since: float) -> None:
        """When the next round's probe would end past ``since + ttl_s``, probe once more
        (directly and through others) so as to end at that moment, and bury the member
        then if nothing reached it. Otherwise the burial waits for the first probe that
        fails after the deadline: with silent hosts (pings time out, and so do probes
        through others) up to a whole probe late, the tail of the death times
        (``docs/algorithms.md`` section 11). Members get the same ``ttl_s`` of failed
        probes as before, and the same proof of life (their own pings)."""
        peer_id, timeout_s = record.peer_id, self.config.probe_timeout_s
        due = since + self.config.ttl_s
        through_s = 2 * timeout_s + 0.5  # as _probe_through_others waits
        if self.clock.now() + 1.2 * self.config.heartbeat_s + timeout_s + through_s <= due:
            return  # the next rounds probe it again
        await self.clock.sleep(max(0.0, due - through_s - self.clock.now()))
        if self._missing.get(peer_id) != since or peer_id not in self.table:
            return  # buried meanwhile, or found alive
        direct, through = await asyncio.gather(
            self._ping(record, msg), self._probe_through_others(record)
        )
        if direct or through:
            self._found(peer_id)
            return
        self._others_missed.add(peer_id)
        await self.clock.sleep(max(0.0, due - self.clock.now()))  # failed before the deadline
        if not self._spoke_lately(peer_id, self.clock.now()):
            self._bury_if_due(record, since)

    def _found(self, peer_id: str) -> None:
        """A missing member answered (directly or through others)."""
        self._missing.pop(peer_id, None)
        self._others_missed.discard(peer_id)

    def _spoke_lately(self, peer_id: str, now: float) -> bool:
        """Whether the member's own ping reached us within ``ttl_s`` (0 s ago counts)."""
        silent_s = self.table.silent_s(peer_id, now)
        return silent_s is not None and silent_s < self.config.ttl_s

    def _bury_if_due(self, record: PeerRecord, since: float) -> bool:
        now = self.clock.now()
        peer_id = record.peer_id
        # a wake-up at the deadline may read a hair before it (float sums; asyncio runs a
        # timer up to its clock's resolution early): that is not a second early
        early = now - since < self.config.ttl_s - 1e-6
        if early or self.table.incarnation(peer_id) != record.incarnation:
            return False
        self._missing.pop(peer_id, None)
        self._others_missed.discard(peer_id)
        if self.table.bury(peer_id, record.incarnation, now):
            self.num_buried += 1
            log.info("peer %s gone: no probe reached it for %.0fs", peer_id[:8], now - since)
            self._lose(record.address, now)
            self._tell(Obituary(peer_id, record.incarnation), (record.stage,))
        return True

    async def _probe_through_others(self, record: PeerRecord) -> bool:
        others = [
            p
            for p in self.table.records()
            if p.peer_id != record.peer_id and self.table.covers(record.stage, p.stage)
        ]
        helpers = self.rng.sample(others, min(self.config.indirect_probes, len(others)))
        probe = Probe(sender=self.table.self_id, target=record.peer_id)
        timeout_s = 2 * self.config.probe_timeout_s + 0.5

        async def through(helper: PeerRecord) -> bool:
            try:
                reply = await self._ask(helper, probe, timeout_s)
                expect(reply, Pong)
            except (TransportError, ValueError):
                return False
            return True

        return any(await asyncio.gather(*(through(h) for h in helpers)))

    async def _tell_directly(self, record: PeerRecord, msg: Ping, timeout_s: float) -> None:
        await self._ping(record, msg, timeout_s)

    async def _ask_back(self, record: PeerRecord) -> None:
        await self._ping(record, replace(self._ping_msg([], []), pull=True))

    def _ping_msg(
        self,
        news: list[PeerRecord],
        deaths: list[Obituary],
        ask_record: bool = True,
        stage: int | None = None,
    ) -> Ping:
        """A ping; a probe of a member of ``stage`` brings it summaries of stages it does
        not hold."""
        own = self.own()
        return Ping(
            self.table.self_id,
            news,
            deaths,
            ask_record=ask_record,
            incarnation=own.incarnation,
            version=own.version,
            stages=[] if stage is None else self._summaries_for(stage),
        )

    async def _ping(
        self,
        record: PeerRecord,
        msg: Ping,
        timeout_s: float | None = None,
        news: list[_News] | None = None,
    ) -> bool:
        """Ping a member; True if it answered (its news taken). The piggybacked ``news``
        the ping carries is given back if it did not."""
        timeout_s = self.config.probe_timeout_s if timeout_s is None else timeout_s
        sent_s = self.clock.wall()
        try:
            pong = expect(await self._ask(record, msg, timeout_s), Pong)
        except (TransportError, ValueError) as e:
            log.debug("ping to %s failed: %s", record.peer_id[:8], e)
            self._unspend(news or [])
            return False
        now = self.clock.now()
        if pong.wall_ms:
            self.clocks.observe(record.peer_id, sent_s, pong.wall_ms / 1000, self.clock.wall(), now)
        if pong.sender is not None and pong.sender.peer_id == record.peer_id:
            self.table.observe(pong.sender, now, direct=True)
        self.table.heard_from(record.peer_id, now)
        self._take(pong.news, pong.deaths, record.peer_id)
        return True

    async def _ask(self, record: PeerRecord, msg: Message, timeout_s: float) -> Message:
        """A request to a member; one that has not heard of us yet gets a hello first."""
        try:
            return await self.transport.request(record.address, msg, timeout_s, record.peer_id)
        except TransportError as e:
            if e.code != "unknown_peer" or not await self.contact(record.address, introduce=True):
                raise
        return await self.transport.request(record.address, msg, timeout_s, record.peer_id)

    def _lose(self, address: str, now: float) -> None:
        wait_s = self.config.ttl_s
        self._lost.setdefault(address, _Lost(now, now + wait_s, wait_s))

    def _lost_due(self, now: float, held: set[str]) -> set[str]:
        """Addresses of buried peers due for another hello (at most ``fanout`` a round);
        each try doubles the next wait."""
        due: set[str] = set()
        for address, lost in list(self._lost.items()):
            if address in held or now - lost.since_s > LOST_FORGET_S:
                del self._lost[address]  # back in the table (or given up on)
            elif now >= lost.next_s and len(due) < self.config.fanout:
                due.add(address)
                lost.wait_s = min(2 * lost.wait_s, LOST_RETRY_MAX_S)
                lost.next_s = now + lost.wait_s
        return due

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- hello, ping, probe, leave ---------------------------------------------------------

    async def _hello(self, address: str, peers: list[PeerRecord], want_table: bool) -> Welcome:
        """Our record (and ``peers``) to ``address``; its welcome, not yet checked for our
        swarm. ``TransportError`` or ``ValueError`` when it does not welcome us."""
        hello = Hello(
            swarm=self.swarm,
            fingerprint=self.fingerprint,
            sender=self.current(),
            peers=peers,
            want_table=want_table,
            stages=self._own_stage(),
        )
        reply = await self.transport.request(address, hello, self.config.request_timeout_s)
        return expect(reply, Welcome)

    async def contact(self, address: str, introduce: bool = False, share: bool = True) -> bool:
        """Greet the node at ``address`` (our record and table, theirs back; an
        introduction sends neither table; without ``share``, ours is not sent: a stage's
        contact holds its stage better than we do); False if it did not answer."""
        try:
            peers = [] if introduce or not share else self.table.records()
            welcome = await self._hello(address, peers, want_table=not introduce)
        except (TransportError, ValueError) as e:
            log.debug("hello to %s failed: %s", address, e)
            code = e.code if isinstance(e, TransportError) else "malformed_message"
            self._tell_bootstrap(address, code, str(e))
            return False
        if (welcome.swarm, welcome.fingerprint) != (self.swarm, self.fingerprint):
            self._tell_bootstrap(
                address,
                "wrong_swarm",
                f"it is in swarm {welcome.swarm!r} with model {welcome.fingerprint}; "
                f"this node is in {self.swarm!r} with {self.fingerprint}",
            )
            return False
        self._tell_bootstrap(address, "", "")
        self.observed_host = welcome.observed_host
        if not self.table.covers(welcome.sender.stage):
            self._answered_far.add(address)
        self._take([], welcome.deaths, welcome.sender.peer_id, spread=False)
        self._greeted(welcome.sender, welcome.peers, welcome.sender.address)
        self._take_summaries(welcome.stages)
        records = self.table.records()
        held = {p.address for p in records} | {self.self_record().address}
        due = self._contacts_due(self.clock.now(), held)
        if address in self._answered_far:
            # it holds another neighbourhood than ours: one of ours has our table and
            # spreads our join (it may have named some, from its lobby), and one more
            # is introduced to us, to spread it too if the first is gone
            ours = sorted({r.address for r in records if not r.relays and r.address} - due)
            picked = self.rng.sample(ours, min(1 if due else 2, len(ours)))
            if not due and picked:
                due = {picked.pop()}
            elif not due:  # it knows no contact of ours: greet the nearest stage it knows,
                due = self._nearest_contact(held)  # whose summaries of ours are fresher
            for other in picked:
                self._spawn(self._greet(other, table=False))
        for contact in sorted(due):
            self._spawn(self._greet(contact))
        return True

    def _nearest_contact(self, held: set[str]) -> set[str]:
        """The contact of the stage nearest ours on the ring that we have a summary of (and
        have not greeted lately): summaries travel stage to stage, so its holders know our
        stages better than a far node does."""
        scope = self.table.scope
        if scope is None or self.table.stage < 0:
            return set()
        now = self.clock.now()

        def distance(stage: int) -> int:
            d = abs(stage - self.table.stage) % scope.num_stages
            return min(d, scope.num_stages - d)

        known = [
            (distance(stage), summary.contact)
            for stage, (summary, _) in self._far.items()
            if summary.contact
            and summary.contact not in held
            and summary.contact not in self._greeted_contacts
        ]
        if not known:
            return set()
        address = min(known)[1]
        self._greeted_contacts[address] = now
        return {address}

    async def _greet(self, address: str, table: bool = True) -> None:
        """Greet a member of our neighbourhood for its table (or, without ``table``, just
        introduce ourselves); if it does not answer, greet another member (or the
        bootstrap) for fresh summaries, which name other contacts."""
        if await self.contact(address, introduce=not table, share=False):
            return
        others = [r.address for r in self.table.records() if not r.relays] or self.bootstrap
        if others:
            await self.contact(self.rng.choice(others), share=False)

    async def introduce(self, address: str) -> bool:
        """Make ourselves known to a member that refused us as ``unknown_peer``."""
        return await self.contact(address, introduce=True)

    def handle_hello(self, hello: Hello, observed_host: str) -> Welcome:
        """Answer a greeting: take its news and return ours."""
        if hello.swarm != self.swarm or hello.fingerprint != self.fingerprint:
            raise Refused(
                "wrong_swarm",
                f"this node is in swarm {self.swarm!r} with model {self.fingerprint}; "
                f"you are in {hello.swarm!r} with {hello.fingerprint}",
            )
        deaths = self._obituaries(hello.sender.peer_id)
        self._greeted(hello.sender, hello.peers, hello.sender.address)
        stage = hello.sender.stage
        self._take_greeters_stage(hello.sender, hello.stages)
        peers = [r for r in self.table.records() if self.table.covers(r.stage, stage)]
        peers += self._lobby_for(hello.sender)
        return Welcome(
            swarm=self.swarm,
            fingerprint=self.fingerprint,
            sender=self.current(),
            peers=peers if hello.want_table else [],
            observed_host=observed_host,
            deaths=deaths,
            stages=self._summaries_for(stage, everything=True) if hello.want_table else [],
        )

    def _greeted(self, sender: PeerRecord, peers: list[PeerRecord], address: str) -> None:
        now = self.clock.now()
        outcome = self.table.observe(sender, now, direct=True)
        if outcome == NEW:
            log.info("peer %s joined: stage %d at %s", sender.peer_id[:8], sender.stage, address)
        if outcome is not None:
            self._tell(self.table.get(sender.peer_id) or sender)
        self._take(peers, [], sender.peer_id, spread=False)

    def _lobby_for(self, greeter: PeerRecord) -> list[PeerRecord]:
        """The last few greeters of stages outside our scope that ``greeter``'s table holds
        (a swarm's first nodes, all greeting one bootstrap, find each other this way before
        any summary names them); ``greeter`` joins the lobby if we do not hold it."""
        if self.table.scope is None:
            return []
        now = self.clock.now()
        found = [
            record
            for stage, waiting in self._lobby.items()
            for record, since in waiting
            if self.table.covers(stage, greeter.stage)
            and record.peer_id != greeter.peer_id
            and now - since < LOST_FORGET_S
        ]
        in_pipeline = 0 <= greeter.stage < self.table.scope.num_stages  # bounds the lobby
        if in_pipeline and not self.table.covers(greeter.stage):
            waiting = [
                w for w in self._lobby.get(greeter.stage, []) if w[0].peer_id != greeter.peer_id
            ]
            self._lobby[greeter.stage] = [*waiting, (greeter, now)][-LOBBY_PER_STAGE:]
        return found

    def _obituaries(self, greeter: str) -> list[Obituary]:
        """The deaths a greeter should know: every standing tombstone (its table may hold a
        peer buried before it arrived), its own included (it answers that)."""
        graves = self.table.graves()
        if greeter in self.table:
            graves.pop(greeter, None)
        return [Obituary(peer_id, incarnation) for peer_id, incarnation in graves.items()]

    def handle_ping(self, ping: Ping) -> Pong:
        """Answer a member's ping with our record and news; a buried sender is told so."""
        if ping.sender not in self.table:
            grave = self.table.grave(ping.sender)
            own = [r.incarnation for r in ping.news if r.peer_id == ping.sender]
            if grave is not None and not (own and own[0] > grave):
                return Pong(
                    sender=self.current(),
                    deaths=[Obituary(ping.sender, grave)],
                    wall_ms=self._wall_ms(),
                )
            if grave is None:
                raise Refused(
                    "unknown_peer",
                    f"ping from peer {ping.sender[:16]}, which this node has not heard of "
                    "(send hello first)",
                    403,
                )
            # else a member we buried answers the false alarm with a higher incarnation
        self.table.heard_from(ping.sender, self.clock.now())
        self._take(ping.news, ping.deaths, ping.sender)
        self._take_summaries(ping.stages)
        held = self.table.get(ping.sender)
        if held is not None and (held.incarnation, held.version) < (
            ping.incarnation,
            ping.version,
        ):
            # its reply brings its own record (a plain ping: no suspicion if it fails)
            self._spawn(self._ask_back(held))
        stage = -1 if held is None else held.stage
        news, deaths = ([], []) if ping.pull else _split(self._piggyback(stage, heard=ping))
        sender = self.current() if ping.ask_record else None
        return Pong(sender=sender, news=news, deaths=deaths, wall_ms=self._wall_ms())

    def _wall_ms(self) -> int:
        """Our wall clock for a ``Pong``, ms since the epoch."""
        return max(0, round(self.clock.wall() * 1000))

    def stage_offset_s(self, stage: int) -> float:
        """What to add to this machine's wall clock to read ``stage``'s (the median of its
        replicas' clocks, this one's included: ``swarm.schedule.ClockOffsets``). A replica
        that dropped out of the table without leaving still counts for
        ``STAGE_CLOCK_HOLD_S`` after a reading last found it there."""
        now = self.clock.now()
        if stage != self._clock_stage:  # this node moved: its old partners do not count
            self._clock_stage, self._clock_peers = stage, {}
        seen = self._clock_peers
        for record in self.table.replicas(stage, ready_only=False):
            seen[record.peer_id] = now
        for peer_id, when in list(seen.items()):
            held = self.table.get(peer_id)
            elsewhere = held is not None and (held.leaving or held.stage != stage)
            if elsewhere or now - when > STAGE_CLOCK_HOLD_S:
                del seen[peer_id]
        return self.clocks.stage_offset_s(seen, now)

    def _left(self, peer_id: str) -> None:
        """``peer_id`` said goodbye: it no longer counts in the stage's clock."""
        self._clock_peers.pop(peer_id, None)

    async def handle_probe(self, probe: Probe) -> Pong:
        """Ping a member for a member whose own ping did not reach it."""
        if probe.sender not in self.table:
            raise Refused("unknown_peer", f"probe from unknown peer {probe.sender[:16]}", 403)
        record = self.table.get(probe.target)
        if record is None:
            raise Refused("unknown_target", f"this node holds no peer {probe.target[:16]}", 404)
        items = self._piggyback(record.stage)
        if not await self._ping(record, self._ping_msg(*_split(items)), news=items):
            raise Refused("unreachable", f"peer {probe.target[:16]} did not answer", 504)
        return Pong()

    def handle_leave(self, leave: Leave) -> None:
        incarnation = leave.incarnation or self.table.incarnation(leave.peer_id)
        held = self.table.get(leave.peer_id)
        now = self.clock.now()
        if incarnation is not None and self.table.bury(leave.peer_id, incarnation, now):
            log.info("peer %s left", leave.peer_id[:8])
            self._left(leave.peer_id)
            stages = None if held is None else (held.stage,)
            self._tell(Obituary(leave.peer_id, incarnation, left=True), stages)

    async def leave_all(self, timeout_s: float) -> None:
        """Tell members we are leaving (best effort, bounded time): ``2 * fanout`` of them,
        who pass it on."""
        self._leaving = True
        msg = Leave(peer_id=self.table.self_id, incarnation=self._incarnation)
        members = self.table.records()
        told = self.rng.sample(members, min(2 * self.config.fanout, len(members)))

        async def tell(address: str) -> None:
            try:
                await self.transport.request(address, msg, timeout_s)
            except TransportError as e:
                log.debug("leave to %s failed: %s", address, e)

        await asyncio.gather(*(tell(p.address) for p in told))


def _essentials(record: PeerRecord) -> PeerRecord:
    """``record`` with its changing figures zeroed: what must be published at once."""
    return replace(record, **_ZEROED)


_ZEROED: dict[str, Any] = {f.name: f.default for f in fields(PeerRecord) if f.name in FIGURES}


@dataclass
class _News:
    """One piece of news this node passes on."""

    item: PeerRecord | Obituary
    piggy_left: int
    """Pings and replies it still rides on."""
    stages: tuple[int, ...] | None = None
    """The stages it is about: only members holding one of them take it (None: all)."""
    pushed: bool = False


def _news_key(item: PeerRecord | Obituary) -> tuple[bool, int, int]:
    """Which news an item is: of a death or a record, and how new."""
    if isinstance(item, Obituary):
        return True, item.incarnation, 0
    return False, item.incarnation, item.version


def _brought(ping: Ping) -> dict[str, tuple[bool, int, int]]:
    """The news a ping brings, by the peer it is about."""
    brought = {r.peer_id: _news_key(r) for r in ping.news}
    brought.update({d.peer_id: _news_key(d) for d in ping.deaths})
    return brought


def _split(items: list[_News]) -> tuple[list[PeerRecord], list[Obituary]]:
    records = [n.item for n in items if isinstance(n.item, PeerRecord)]
    deaths = [n.item for n in items if isinstance(n.item, Obituary)]
    return records, deaths


@dataclass
class _Lost:
    """A buried peer's address: when it was lost, and when to try it next."""

    since_s: float
    next_s: float
    wait_s: float


class IntroducingTransport:
    """A ``Transport`` that says hello to a peer that does not know this node yet.

    A request refused with ``unknown_peer`` is followed by ``introduce(address)`` (a
    membership ``Hello``, ``MembershipService.contact``) and, if the peer answered it, sent
    once more within what is left of the same deadline. Hops, gossip and recovery requests
    go through it; membership itself uses the plain transport (a refused hello is final).
    """

    def __init__(
        self, inner: Transport, introduce: Callable[[str], Awaitable[bool]], clock: Clock
    ) -> None:
        self.inner = inner
        self.introduce = introduce
        self.clock = clock

    async def request(
        self, address: str, msg: Message, timeout_s: float, peer_id: str = ""
    ) -> Message:
        start = self.clock.now()
        try:
            return await self.inner.request(address, msg, timeout_s, peer_id)
        except TransportError as e:
            if e.code != "unknown_peer" or not await self.introduce(address):
                raise
        left_s = max(0.1, timeout_s - (self.clock.now() - start))
        return await self.inner.request(address, msg, left_s, peer_id)
