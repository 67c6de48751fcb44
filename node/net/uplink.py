"""Turns on a thin uplink: this node's long uploads one at a time, gradients first.

Owns ``UplinkTurns``, the order in which the hop sender's uploads take the uplink once
one upload takes long there (``node.pipeline.HopSender`` decides when, from the rate its
receivers report).

Why turns: TCP shares a bottleneck about evenly among the connections crossing it. ``k``
uploads of ``B`` bytes each, started together over an uplink of ``R`` bytes/s, all end
near ``k * B / R``; taken in turn, the ``i``-th ends at ``i * B / R``. Where ``k * B / R``
is past a hop's deadline (``train.hop_timeout_s``) and ``B / R`` is not, sharing makes
every one of them late and turns make the first ones in time: the same bytes cross the
link, in another order. Serving one job at a time to completion beats sharing the server
among them for mean completion time whenever the jobs are of equal size (the case of
shortest-remaining-processing-time first, Schrage 1968; Harchol-Balter et al., ACM TOCS
21(2), 2003, apply it to a web server's uplink). Gradients go before outputs: a gradient
ends the work of a microbatch that has already spent its forward pass, as SWARM's nodes
run backward before forward (arXiv 2301.11913, section 3).

Does not own: when an upload counts as long, the upload itself, or what a late one costs
(the caller's hop deadline and its retries).
"""

from __future__ import annotations

import asyncio
import heapq


class UplinkTurns:
    """At most one holder at a time; waiters served by priority (lower first), then in the
    order they came. ``acquire`` and ``release`` pair like a lock's."""

    def __init__(self) -> None:
        self._held = False
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = 0

    @property
    def held(self) -> bool:
        """Whether an upload holds the turn now (one asking then waits)."""
        return self._held

    @property
    def waiting(self) -> int:
        """Uploads waiting for their turn now."""
        return sum(1 for _, _, f in self._waiting if not f.done())

    async def acquire(self, priority: int, timeout_s: float) -> bool:
        """Wait for the turn, at most ``timeout_s`` seconds: True once this caller holds it
        (it then calls ``release``), False when the time ran out first (it holds nothing)."""
        if not self._held and not self._waiting:
            self._held = True
            return True
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._seq += 1
        heapq.heappush(self._waiting, (priority, self._seq, turn))
        try:
            await asyncio.wait({turn}, timeout=max(0.0, timeout_s))
        except asyncio.CancelledError:
            self._give_up(turn)
            raise
        if turn.done():
            return True
        self._give_up(turn)
        return False

    def release(self) -> None:
        """End this holder's turn: the next waiter takes it, or the uplink is free."""
        while self._waiting:
            _, _, turn = heapq.heappop(self._waiting)
            if not turn.done():
                turn.set_result(None)  # held passes on
                return
        self._held = False

    def _give_up(self, turn: asyncio.Future[None]) -> None:
        """A waiter that leaves: a turn handed to it just now passes on; else it is dropped
        from the line (``release`` skips it)."""
        if turn.done() and not turn.cancelled():
            self.release()
        else:
            turn.cancel()
