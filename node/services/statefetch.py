"""Copying a stage's state from a live replica, with its weights screened first.

Owns the one way a node takes weights from a peer: when it joins a stage that has a live
replica (plain state sync), when CheckFree rebuilds a stage from its neighbours, and when a
head stage is rebuilt from a backup. The replicas of the stage are tried in order of their
step, most advanced first, skipping banned ones; each answer's weights pass ``swarm.screen``
(non-finite ones, or ones further from this replica's current weights than
``recovery.screen_multiple`` times their RMS, are refused) and a refused source is banned
(``node.services.guard``). A peer that does not answer is marked failed for the router.

Does not own what the weights are used for (the daemon loads them, recovery averages them).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

import torch

from node.context import NodeContext
from node.services.guard import RequestGuard
from node.stage.runner import params_of
from protocol.messages import FetchState, StageState, expect
from swarm.screen import ScreenConfig, WeightScreen
from swarm.seams import TransportError

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 60.0
"""Deadline of one state transfer (a whole stage's weights and Adam moments)."""


class StateFetcher:
    """Fetches stage states from live replicas and screens the weights in them."""

    def __init__(self, ctx: NodeContext, guard: RequestGuard) -> None:
        self.ctx = ctx
        self.guard = guard
        # no history: every source is judged against the weights' own scale
        self.screen_config = ScreenConfig(multiple=ctx.config.recovery.screen_multiple, warmup=1)

    async def screened(self, peer_id: str, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether the weights in ``tensors`` (a state's ``param.*`` entries) may be used; if
        not, the source is banned. ``ValueError`` when they do not fit this stage at all."""
        runner = self.ctx.state.the_runner()
        distance, scale = await runner.compute(runner.distance_to, params_of(tensors))
        screen = WeightScreen(self.screen_config)
        return self.guard.screen(screen, peer_id, "recovery", distance, scale)

    async def fetch(
        self, stage: int, use: Callable[[StageState], Awaitable[None]] | None = None
    ) -> StageState | None:
        """The state of the most advanced live replica of ``stage`` that answers with
        weights that pass the screen (and that ``use`` takes without a ``ValueError``), or
        None when none does. Replicas the router counts out (``Router.unresponsive``:
        poisoned weights before, or failed and silent since) are not asked: a vanished
        host would hold the copy for ``FETCH_TIMEOUT_S``."""
        ctx = self.ctx
        unresponsive = ctx.router.unresponsive(ctx.clock.now())
        for peer in sorted(ctx.table.replicas(stage), key=lambda p: -p.step):
            if peer.peer_id in unresponsive:
                continue
            try:
                state = await self.fetch_from(peer.address, peer.peer_id, stage)
                if not await self.screened(peer.peer_id, state.tensors):
                    continue  # poisoned: refused and banned
                if use is not None:
                    await use(state)
            except (TransportError, ValueError) as e:
                log.warning("fetching stage %d from %s failed: %s", stage, peer.peer_id[:8], e)
                ctx.router.finished(peer.peer_id, False, ctx.clock.now())  # likely dead: ban
                continue
            log.info("copied stage %d state (step %d) from %s", stage, state.step, peer.peer_id[:8])
            return state
        return None

    async def fetch_from(self, address: str, peer_id: str, stage: int) -> StageState:
        """One peer's state of ``stage`` (unscreened); ``TransportError`` or ``ValueError``."""
        reply = await self.ctx.transport.request(
            address, FetchState(stage=stage), FETCH_TIMEOUT_S, peer_id
        )
        return expect(reply, StageState)
