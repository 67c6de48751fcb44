"""What a node's parts share: its identity, its view of the swarm and its changing state.

Owns two small objects that the daemon (``node.daemon``) builds once and hands to the parts
that need them, so that no part ever holds the daemon itself:

- ``NodeState``: what changes while the node runs: the stage it serves, whether it is
  ready, leaving or draining, the address it announces, and its stage runner. Only the
  daemon writes it; everyone else reads it.
- ``NodeContext``: what does not change: the resolved config, the peer id, the clock and
  random source, the peer table, the view of every stage, the router, the transport that requests to peers go
  through (it says hello to a peer that does not know us yet), the shared counters, and
  ``spawn``, which runs a task the node owns (drained, then cancelled, at shutdown).

Does not own behaviour: the HTTP server, the hop sender, the stage roles and the services
read these; what each does with them is theirs.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from node.config import Config
from node.stage.runner import StageRunner
from protocol.messages import PeerRecord, StageSummary
from swarm.peers import PeerTable, stand_ins
from swarm.routing import Router
from swarm.seams import Clock, Refused, Transport


@dataclass
class NodeState:
    """The node's changing state (written by the daemon only)."""

    stage: int = -1
    """The stage served, -1 before joining."""
    stage_since: float = field(default_factory=time.monotonic)
    """When the node took its current stage (monotonic seconds)."""
    ready: bool = False
    """Serving: peers may route work here."""
    leaving: bool = False
    """Shutting down: no new work is taken."""
    settling: bool = False
    """Joining ``--stage auto``: ``stage`` is announced and may still change (``node.settle_s``)."""
    draining: bool = False
    """Moving to another stage: the backwards of forwards made here are still taken."""
    address: str = ""
    """HOST:PORT peers reach this node at."""
    runner: StageRunner | None = None
    """The current stage's weights and compute thread (None before joining)."""

    @property
    def serving(self) -> bool:
        return self.ready and not self.leaving

    def check_serving(self) -> None:
        """``Refused`` unless the node takes new work now."""
        if self.leaving:
            raise Refused("leaving", "this node is shutting down", 503)
        if not self.ready:
            raise Refused("not_ready", "this node has not finished joining", 503)

    def the_runner(self) -> StageRunner:
        """The runner of a node that has joined (an invariant where this is called)."""
        assert self.runner is not None, "no stage yet"
        return self.runner


@dataclass(frozen=True)
class NodeContext:
    """What a node's parts read (see the module docstring)."""

    config: Config
    peer_id: str
    num_stages: int
    """1 head stage + ``swarm.num_block_stages``."""
    state: NodeState
    clock: Clock
    rng: random.Random
    table: PeerTable
    """Records of the peers this node talks to (with neighbourhood tables: its own stage
    and the stages next to it)."""
    stages: Callable[[], dict[int, StageSummary]]
    """Every stage this node knows of (``MembershipService.view``): counted from the table
    where it holds the stage, else the freshest summary peers relayed. Read this, not the
    table, for anything about the whole pipeline."""
    router: Router
    transport: Transport
    """Requests to peers: introduces this node to a peer that does not know it yet."""
    counters: Counter[str]
    """Named event counts, exported by ``node status`` and the metrics."""
    spawn: Callable[[Coroutine[Any, Any, None]], None]
    """Run a coroutine as a task the node owns."""

    @property
    def stage(self) -> int:
        return self.state.stage

    @property
    def partial(self) -> bool:
        """Whether some stages are known only by their summaries (neighbourhood tables on a
        pipeline longer than a neighbourhood)."""
        return not all(self.table.covers(s) for s in range(self.num_stages))

    def everyone(self) -> dict[int, list[PeerRecord]]:
        """The swarm as a planner reads it, by stage: the table's live (not leaving) records
        of each stage it has records of, stand-ins (``swarm.peers.stand_ins``) for the
        replicas of a stage known only by a summary. Present, if empty, are the stages the
        table holds (every stage with whole tables); absent, a stage it knows nothing of.
        Before it takes a stage, a node with a neighbourhood table reads every stage as
        its view counts it (stand-ins only). This node itself is not in it."""
        table, own = self.table, self.stage
        if table.scope is not None and own < 0:  # a newcomer has met some of many stages:
            return {s: stand_ins(summary) for s, summary in self.stages().items()}  # counts
        by_stage: dict[int, list[PeerRecord]] = {
            s: [] for s in range(self.num_stages) if table.covers(s)
        }
        for r in table.records():
            if not r.leaving and table.covers(r.stage) and 0 <= r.stage < self.num_stages:
                by_stage.setdefault(r.stage, []).append(r)
        for stage, summary in self.stages().items():
            if not by_stage.get(stage) and stage != own:
                by_stage[stage] = stand_ins(summary)
        return by_stage
