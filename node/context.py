"""What a node's parts share: its identity, its view of the swarm and its changing state.

Owns two small objects that the daemon (``node.daemon``) builds once and hands to the parts
that need them, so that no part ever holds the daemon itself:

- ``NodeState``: what changes while the node runs: the stage it serves, whether it is
  ready, leaving or draining, the address it announces, and its stage runner. Only the
  daemon writes it; everyone else reads it.
- ``NodeContext``: what does not change: the resolved config, the peer id, the clock and
  random source, the peer table and router, the transport that requests to peers go
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
from swarm.peers import PeerTable
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
