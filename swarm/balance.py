"""Throughput balancing: which stage a joining node takes, and when a serving node moves.

The policy follows Petals' block selection (Borzunov et al., "Petals: Collaborative
Inference and Fine-tuning of Large Models", arXiv 2209.01188, and "Distributed Inference and
Fine-tuning of Large Language Models Over The Internet", arXiv 2312.08361; ``docs/algorithms.md``
section 3), which SWARM (arXiv 2301.11913) describes but never shipped:

- a stage's throughput is the sum of its replicas' service rates (samples per second of
  compute); the pipeline runs at the pace of its weakest block stage;
- a joining node takes an empty stage if there is one, else the block stage with the lowest
  total throughput (nodes that choose at the same moment take turns: ``settle_join``);
- a serving node simulates leaving its stage for the weakest one and moves only if the
  bottleneck rises by a clear margin: ``current_min / new_min < quality`` (Petals: 0.75),
  never emptying its own stage.

Two guards keep the swarm calm. Every node evaluates the same rule for every movable replica
in its table and only the single best move (highest new bottleneck, ties to the lowest peer
id) may happen, so many peers never jump at the same gap together (the herd); and the caller
adds a cool-down after each move, so a peer does not flip back and forth.

The first guard alone is not enough: nodes plan from rates of different ages (a peer's
figures as of its last publication or its last direct ping, its own of the moment), so two
replicas of one stage with close rates can each see itself as the one to move, and both go
(seen in 3 of 38 logged runs of ``tests/test_balance_processes.py``'s slowed stage, each
emptying stage 1 until recovery refilled it), and replicas of two stages can each move to
one target on figures a few seconds old. So a replica the plan names first asks each
replica of the stage it leaves and of the stage it joins, and moves only if all of them
let it (``MoveLock``): a replica that wants to move too lets the lower peer id go and
stays itself; one that has let a replica move does not move, nor let another move, for
``hold_s``. One replica at a time leaves or joins a stage. Petals' rule has no such step;
it costs one round trip to the two stages' replicas per move. With neighbourhood tables a
target outside the mover's neighbourhood is known only by a summary, so its replicas are
not asked: two moves into a far stage are bounded by the cool-down only, as before.

A replica's rate is taken to be the same on every block stage (block stages hold equal
numbers of identical blocks). Pure functions over plain records; the daemon's
``node.services.balance`` measures, publishes and moves.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, replace

from protocol.messages import PeerRecord
from swarm.assignment import first_drawn

EPS = 1e-3
"""Slack on the quality test so that an exact tie never triggers a move (Petals uses 1e-3)."""


@dataclass(frozen=True)
class Replica:
    """One live replica as the balancer sees it."""

    peer_id: str
    stage: int
    rate: float
    """Service rate in samples per second; 0 when not measured yet."""
    movable: bool = True
    """False for nodes pinned to their stage (``--stage N``) and for head nodes."""


@dataclass(frozen=True)
class Move:
    """The one move the swarm should make now."""

    peer_id: str
    source: int
    target: int
    current_min: float
    new_min: float

    @property
    def quality(self) -> float:
        """``current_min / new_min``: below the threshold means a clear gain."""
        return self.current_min / self.new_min if self.new_min > 0 else 1.0


def fill_unknown(replicas: Sequence[Replica], default: float) -> list[Replica]:
    """Replicas whose rate is not measured yet (0) get the median of the measured ones, or
    ``default`` when nothing is measured: a peer that just joined counts as a typical one."""
    known = [r.rate for r in replicas if r.rate > 0]
    guess = statistics.median(known) if known else default
    return [r if r.rate > 0 else Replica(r.peer_id, r.stage, guess, r.movable) for r in replicas]


def stage_totals(replicas: Iterable[Replica], stages: Iterable[int]) -> dict[int, float]:
    """Total service rate per stage (every stage in ``stages`` is a key)."""
    totals = dict.fromkeys(stages, 0.0)
    for r in replicas:
        if r.stage in totals:
            totals[r.stage] += r.rate
    return totals


def join_stage(
    replicas: Sequence[Replica], num_stages: int, rng: random.Random, own_rate: float = 1.0
) -> int:
    """The stage a joining node takes: an empty stage (the head included) chosen at random,
    else the block stage with the lowest total throughput (ties at random)."""
    if num_stages < 2:
        raise ValueError("a swarm needs a head stage and at least one block stage")
    counts = dict.fromkeys(range(num_stages), 0)
    for r in replicas:
        if r.stage in counts:
            counts[r.stage] += 1
    empty = [s for s, n in counts.items() if n == 0]
    if empty:
        return first_drawn(empty, counts, rng)
    blocks = [r for r in replicas if r.stage > 0]  # head rates measure different work
    totals = stage_totals(fill_unknown(blocks, own_rate), range(1, num_stages))
    low = min(totals.values())
    return first_drawn([s for s, t in totals.items() if t <= low * (1 + EPS)], counts, rng)


def settle_join(
    me: str,
    stage: int,
    others: Sequence[Replica],
    settling: Collection[str],
    pick: Callable[[Sequence[Replica], random.Random], int],
) -> int:
    """One round of turn-taking among nodes that announced a stage at the same moment:
    where ``me``, announced on ``stage``, should go. The ``settling`` nodes announced on
    ``stage`` take their turns in peer-id order: each lower id than ours takes ``pick``
    (the joining rule) over ``others`` and the turns before it, then we do; higher ids come
    after us and are not counted. In a turn a joiner counts as a typical replica
    (``fill_unknown``): its rate is a start-up benchmark, published as a figure seconds old,
    and every member of the group must compute the same turns. Everyone else in ``others``
    counts at its stage, at its rate. Ties go by an order drawn from the chooser's id
    (``swarm.assignment.first_drawn``), so a pick stays when a tied stage it did not pick
    drops out.

    Only the joiners announced on our own stage are ordered: they are the ones we always
    hold records of (with neighbourhood tables a far stage is known by its summary, which
    counts its joiners but does not name them). A node whose answer is another stage
    announces that one and asks again after the next quiet spell; when the answer is the
    stage it announced, it takes it (``node.settle_s``, at most ``SETTLE_ROUNDS`` rounds).

    Petals has no such step. Without it, six nodes started together split 3, 2, 1 over
    three block stages in 12 of 40 logged test runs; it costs every ``--stage auto`` join
    at least one quiet spell."""
    group = {r.peer_id: r for r in others if r.peer_id in settling and r.stage == stage}
    placed = [r for r in others if r.peer_id not in group and r.peer_id != me]
    for peer_id in sorted(p for p in group if p < me):  # their turns, as they take them
        turn = pick(placed, random.Random(f"join-{peer_id}"))
        placed.append(replace(group[peer_id], stage=turn, rate=0.0))  # a typical replica
    return pick(placed, random.Random(f"join-{me}"))


SETTLE_ROUNDS = 4
"""Most rounds a joiner announces and re-picks before it takes the stage it last chose."""


def plan_move(
    replicas: Sequence[Replica], num_stages: int, quality: float = 0.75, by_stage: bool = False
) -> Move | None:
    """The single best move between block stages, or None when no move clears the margin.

    Candidates are movable replicas of block stages with at least two replicas (a move never
    empties a stage); each is simulated leaving for the weakest block stage. With an empty
    block stage there is no plan: refilling it is the recovery service's job.

    ``by_stage``: the rule for nodes that know most stages only by their totals
    (neighbourhood tables, where far stages are ``swarm.peers.stand_ins``). Every node
    still has to name the same single move, but each knows individual rates only near its
    own stage, so the best replica of the whole swarm is something no node can see. So the
    source stage is chosen first, from what every node knows alike: each block stage's
    total and replica count, a typical replica (the stage's mean rate) simulated leaving
    it; then the best replica of that stage, which its own replicas all hold records of.
    This departs from Petals' rule (the best replica anywhere) only in which stage gives
    up a replica; nodes that disagree on a far stage's totals (summaries are seconds to
    minutes old) can still pick two sources at once, and the cool-down bounds that.
    """
    blocks = range(1, num_stages)
    block_replicas = [r for r in replicas if r.stage in blocks]
    counts = {s: sum(r.stage == s for r in block_replicas) for s in blocks}
    if not block_replicas or min(counts.values()) == 0:
        return None
    filled = fill_unknown(block_replicas, 1.0)
    totals = stage_totals(filled, blocks)
    current_min = min(totals.values())
    target = min(blocks, key=lambda s: (totals[s], s))
    if by_stage:
        source = _source_stage(totals, counts, target)
        filled = [r for r in filled if r.stage == source]
    best: Move | None = None
    for r in filled:
        if not r.movable or r.stage == target or counts[r.stage] < 2:
            continue
        after = dict(totals)
        after[r.stage] -= r.rate
        after[target] += r.rate
        move = Move(r.peer_id, r.stage, target, current_min, min(after.values()))
        if best is None or (move.new_min, best.peer_id) > (best.new_min, move.peer_id):
            best = move
    if best is None or best.quality >= quality - EPS:
        return None
    return best


def _source_stage(totals: dict[int, float], counts: dict[int, int], target: int) -> int | None:
    """The block stage whose typical replica moving to ``target`` raises the bottleneck
    most (ties to the lowest stage); None if no stage can give one up."""
    best: tuple[float, int] | None = None
    for s, total in totals.items():
        if s == target or counts[s] < 2:
            continue
        typical = total / counts[s]
        after = dict(totals)
        after[s] -= typical
        after[target] += typical
        key = (min(after.values()), -s)
        if best is None or key > best:
            best = key
    return None if best is None else -best[1]


MOVE_HOLD_S = 10.0
"""How long a replica that let another move lets nobody else move, nor moves itself: the
mover hears every answer within a request timeout (3 s by default) and its record, no
longer ready, reaches the planners within a heartbeat or two; from then on their plans wait
for it (no plan while a block replica is joining or moving). Asking again does not extend
it, so two movers that each hold one of a stage's replicas are both refused for no longer
than this."""


class MoveLock:
    """Which replica may leave or join one stage now: at most one at a time.

    Owns this replica's side of the exchange before a rebalancing move: its own wish to
    move (``want``), the answer to a replica that asks to leave or join its stage
    (``answer``), and the verdict once everyone asked has answered (``conclude``). Does not
    own the messages, the plan or the move (``node.services.balance``).

    Why it admits one: two moves that touch one stage (each leaves or joins it) both ask
    every replica of it other than themselves, and a mover that is a replica of it is asked
    by the other (a move's target always has a replica: plans never name an empty stage). A replica lets at most one move within ``hold_s`` and gives up its own
    wish when it does; it refuses everyone while it is moving, and a higher id while it
    wants to move itself. So of two moves that touch one stage at most one is made, and of
    the two replicas of a stage that both want to leave it exactly one goes (the lower id,
    when both wanted to before either was asked).
    A replica that was asked before it wanted to move wants nothing for ``hold_s``: time
    enough for the mover's new state to reach everyone, whose plans then count it moved.
    """

    def __init__(self, self_id: str, hold_s: float = MOVE_HOLD_S) -> None:
        self.self_id = self_id
        self.hold_s = hold_s
        self.wanting = False
        """Asking the replicas concerned now."""
        self.moving = False
        """Concluded that it goes: refuse everyone until the node has moved (``reset``)."""
        self.let_go: dict[str, float] = {}
        """Replicas this one let move, with when that lapses."""

    def _holding(self, now: float) -> dict[str, float]:
        self.let_go = {p: t for p, t in self.let_go.items() if t > now}
        return self.let_go

    def want(self, now: float) -> bool:
        """Start asking to move; False when another replica was let move within ``hold_s``
        or a request of ours is already out."""
        if self.wanting or self.moving or self._holding(now):
            return False
        self.wanting = True
        return True

    def answer(self, asker: str, now: float) -> tuple[bool, str]:
        """Whether ``asker`` may leave or join our stage, and why not."""
        if self.moving:
            return False, "this replica is moving itself"
        others = [p for p in self._holding(now) if p != asker]
        if others:
            return False, f"replica {others[0][:8]} moves first"
        if self.wanting and self.self_id < asker:
            return False, "this replica wants to move too and has the lower peer id"
        self.wanting = False  # we yield: our own request, if out, concludes no
        self.let_go.setdefault(asker, now + self.hold_s)  # asking again does not extend it
        return True, ""

    def conclude(self, all_agreed: bool) -> bool:
        """After everyone asked answered: True when this replica goes (it still wanted to,
        and nobody refused)."""
        go = self.wanting and all_agreed
        self.wanting = False
        self.moving = go
        return go

    def reset(self) -> None:
        """The node took another stage: a new stage, a new lock state."""
        self.wanting = self.moving = False
        self.let_go.clear()


TRANSIT_LIMIT_S = 300.0
"""How long a block replica that is not ready is waited for (``Transit``). An honest one is
ready well within it: meeting its new neighbourhood (two membership TTLs), one state
transfer (a minute at most per source tried) and, for a move, draining first."""


class Transit:
    """Which block replicas the planners wait for: those joining or moving (their records
    not ready), each for at most ``limit_s`` from when this node first saw it so.

    Owns, per replica not ready now (its peer id, incarnation and stage), when it was first
    seen not ready; a replica seen ready, or gone, is forgotten, so a later move waits
    afresh. Does not own the records (the caller passes the swarm as it reads it now) nor
    what waiting means (``node.services``: no rebalancing and no refill while one is).

    Why a limit: a record says only what its peer publishes. A peer stuck while joining, or
    one that heartbeats "not ready" on purpose, would otherwise hold every rebalancing move
    and every refill of an empty stage, swarm-wide, for as long as it stays. Past the limit
    it is not waited for (``overdue``); it still counts nowhere as a ready replica.
    """

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.since: dict[tuple[str, int, int], float] = {}
        """(peer id, incarnation, stage) -> when first seen not ready, for those not ready now."""

    def waiting(self, records: Iterable[PeerRecord], now: float) -> list[PeerRecord]:
        """The block replicas of ``records`` to wait for now: not ready, not leaving, and
        first seen so less than ``limit_s`` ago (a record seen for the first time: now)."""
        pending = [r for r in records if r.stage > 0 and not r.ready and not r.leaving]
        since = {}
        for r in pending:
            key = (r.peer_id, r.incarnation, r.stage)
            since[key] = self.since.get(key, now)
        self.since = since
        return [
            r for r in pending if now - since[(r.peer_id, r.incarnation, r.stage)] < self.limit_s
        ]

    def overdue(self, now: float) -> list[tuple[str, int, int]]:
        """The replicas not ready now that are no longer waited for: (peer id, incarnation,
        stage), as of the last ``waiting``."""
        return [key for key, t in self.since.items() if now - t >= self.limit_s]
