"""Ring all-reduce over the daemon's own transport (the baseline NoLoCo replaces).

The classic ring (Patarasuk and Yuan, 2009, as used by Baidu and Horovod; ``docs/algorithms.md``
section 5): the flat tensor is cut into ``N`` chunks (the first ``numel % N`` one
element longer); in ``N - 1`` scatter-reduce steps member ``r`` sends chunk ``r - t`` to
its right neighbour and adds the chunk ``r - t - 1`` that arrives from its left; member
``r`` then holds the finished sum of chunk ``r + 1``; ``N - 1`` all-gather steps pass the
finished chunks around. Each member sends ``2 (N - 1) / N`` of the data whatever ``N`` is,
but pays ``2 (N - 1)`` message latencies and waits for the slowest link.

A round may also carry a few scalars beside the tensor (``side``: with
``sync.diloco_share_schedule`` the daemon's DiLoCo rounds send each member's place in the
learning-rate schedule, which an int8 chunk could not carry exactly). They ride the reduce
steps as running sums, in fp64 and never quantized: member ``r`` sends its own values plus
what came from its left, so after the ``N - 1`` reduce steps each member holds every
member's sum (added in another order by each, so equal to the last bit only where the sums
are exact, as for whole step counts) and returns the mean. When one member sends none (an
older or differently configured node), no member gets a mean.

What a real network adds: every member must agree on the member list (each chunk carries
a hash of it, and a mismatch aborts the round), a chunk may arrive before its receiver has
started the round (it waits in a mailbox), and a member may die mid-ring: every wait has a
deadline, and the round then fails with ``RingFailed`` so the caller can take its defined
fallback (a solo step). What waits in mailboxes is bounded: at most 64 rounds, and
``max_held_bytes`` of chunks not yet taken (more is refused with ``ring_overload``), so
peers cannot make a node hold unbounded memory. A member sends its chunk of a step and waits for its neighbour's at
the same time. Chunk arithmetic runs through the ``compute`` seam (the daemon's
compute thread), never on the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch

from protocol.messages import Hop, RingChunk
from protocol.quant import decode_tensor, encode_tensor, tensor_bytes
from swarm.seams import Clock, Refused, Transport, TransportError

log = logging.getLogger(__name__)

T = TypeVar("T")
_MAX_RING_STEPS = 1024
"""Steps per phase a chunk may name (a ring of more than 1025 members is not supported)."""
Compute = Callable[[Callable[[], T]], Awaitable[T]]
_Chunk = tuple[torch.Tensor, list[float]]
"""A received step: the chunk's tensor and its side values."""


class RingFailed(Exception):
    """The round could not complete (member lost, timeout, disagreement)."""


def chunk_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of ``n`` chunks; the first ``numel % n`` are one longer."""
    base, extra = divmod(numel, n)
    bounds, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def ring_steps(rank: int, n: int) -> list[tuple[str, int, int, int]]:
    """``(phase, step, send_chunk, recv_chunk)`` for member ``rank`` of an ``n``-ring."""
    steps = [("reduce", t, (rank - t) % n, (rank - t - 1) % n) for t in range(n - 1)]
    steps += [("gather", t, (rank + 1 - t) % n, (rank - t) % n) for t in range(n - 1)]
    return steps


def members_hash(round_id: str, members: Sequence[str]) -> str:
    return hashlib.sha256("\n".join([round_id, *members]).encode()).hexdigest()[:16]


@dataclass
class _Round:
    members_hash: str
    inbox: dict[tuple[str, int], asyncio.Future[_Chunk]]
    held: dict[tuple[str, int], int] = field(default_factory=dict)
    """Bytes of each delivered chunk not yet taken by the round."""


class RingAllReduce:
    """Mean of a flat tensor across ring members; one instance per node."""

    def __init__(
        self,
        transport: Transport,
        clock: Clock,
        self_id: str,
        *,
        codec: str = "fp32",
        step_timeout_s: float = 10.0,
        compute: Compute[Any] | None = None,
        max_held_bytes: int = 1 << 30,
        min_rate_bytes_s: float = 1.25e6,
    ) -> None:
        """``step_timeout_s``: what one step may take on top of its chunk's size at
        ``min_rate_bytes_s`` (the slowest link a round waits for, 10 Mbit/s: a 100 MB stage
        in a ring of 2 sends 50 MB chunks, 40 s on such a link)."""
        self.transport = transport
        self.clock = clock
        self.self_id = self_id
        self.codec = codec
        self.step_timeout_s = step_timeout_s
        self.min_rate_bytes_s = min_rate_bytes_s
        self.compute: Compute[Any] = compute or _inline
        self._rounds: dict[str, _Round] = {}
        self.max_held_bytes = max_held_bytes
        self.held_bytes = 0
        """Bytes of delivered chunks waiting in mailboxes."""
        self.bytes_sent = 0
        self.bytes_received = 0

    def deliver(self, chunk: RingChunk) -> None:
        """Accept a chunk for a round (started here or not yet)."""
        rnd = self._rounds.get(chunk.round_id)
        if rnd is None:
            if len(self._rounds) > 64:
                raise Refused("ring_overload", "too many ring rounds pending", 503)
            rnd = self._rounds[chunk.round_id] = _Round(chunk.members_hash, {})
        if chunk.members_hash != rnd.members_hash:
            raise Refused("ring_mismatch", f"round {chunk.round_id}: members differ")
        if chunk.phase not in ("reduce", "gather") or not 0 <= chunk.step < _MAX_RING_STEPS:
            raise Refused("bad_ring_step", f"no ring step {chunk.phase[:16]}/{chunk.step}", 400)
        key = (chunk.phase, chunk.step)
        fut = rnd.inbox.setdefault(key, _future())
        if fut.done():
            raise Refused("ring_duplicate", f"chunk {chunk.phase}/{chunk.step} already received")
        nbytes = tensor_bytes(chunk.tensors)
        if self.held_bytes + nbytes > self.max_held_bytes:
            raise Refused(
                "ring_overload",
                f"{self.held_bytes} bytes of ring chunks already wait here; {nbytes} more would "
                f"pass the limit of {self.max_held_bytes} (sync.ring_inbox_bytes)",
                503,
            )
        fut.set_result((decode_tensor(chunk.tensors, chunk.meta), chunk.side))
        rnd.held[key] = nbytes
        self.held_bytes += nbytes
        self.bytes_received += nbytes

    async def allreduce(
        self, round_id: str, members: Sequence[Hop], flat: torch.Tensor
    ) -> torch.Tensor:
        """The mean of ``flat`` over ``members`` (sorted by peer id, including us)."""
        mean, _ = await self.allreduce_with_side(round_id, members, flat)
        return mean

    async def allreduce_with_side(
        self, round_id: str, members: Sequence[Hop], flat: torch.Tensor, side: Sequence[float] = ()
    ) -> tuple[torch.Tensor, list[float] | None]:
        """The means of ``flat`` and of the scalars ``side`` over ``members`` (sorted by peer
        id, including us); the second is None when ``side`` is empty or a member sent no side
        values or another count of them."""
        ids = [m.peer_id for m in members]
        assert ids == sorted(ids) and self.self_id in ids, "members must be sorted and include us"
        own = [float(v) for v in side]
        n = len(members)
        if n == 1:
            return flat.clone(), own or None
        h = members_hash(round_id, ids)
        rnd = self._rounds.setdefault(round_id, _Round(h, {}))
        try:
            if rnd.members_hash != h:
                raise RingFailed(f"round {round_id}: a peer started it with other members")
            rank = ids.index(self.self_id)
            right = members[(rank + 1) % n]
            bounds = chunk_bounds(flat.numel(), n)
            work: torch.Tensor = await self.compute(flat.clone)
            carry: list[float] | None = own  # running side sums, None once a member sent none
            for phase, step, send_i, recv_i in ring_steps(rank, n):
                s0, s1 = bounds[send_i]
                tensors, meta = await self.compute(
                    partial(encode_tensor, work[s0:s1], self.codec, name="c")
                )
                msg = RingChunk(
                    round_id=round_id,
                    members_hash=h,
                    phase=phase,
                    step=step,
                    meta=meta,
                    tensors=tensors,
                    side=(carry or []) if phase == "reduce" else [],
                )
                got, got_side = await self._exchange(rnd, right, msg, self._step_s(tensors))
                if phase == "reduce":
                    carry = _side_sum(own, carry, got_side)
                r0, r1 = bounds[recv_i]
                combine = work[r0:r1].add_ if phase == "reduce" else work[r0:r1].copy_
                await self.compute(partial(combine, got))
            await self.compute(partial(work.div_, n))
            return work, None if carry is None else [v / n for v in carry]
        finally:
            self._drop(round_id)

    def _step_s(self, tensors: Mapping[str, torch.Tensor]) -> float:
        """Time allowed for one step that moves ``tensors`` (its neighbour's are as large)."""
        return self.allowed_s(tensor_bytes(tensors))

    def allowed_s(self, nbytes: float) -> float:
        """Time a member waits for a chunk of ``nbytes``: ``step_timeout_s`` plus its size
        at ``min_rate_bytes_s``."""
        rate = self.min_rate_bytes_s
        return self.step_timeout_s + (nbytes / rate if rate > 0 else 0.0)

    async def _exchange(self, rnd: _Round, right: Hop, msg: RingChunk, timeout_s: float) -> _Chunk:
        """Send our chunk of this step while waiting for our left neighbour's: one step costs
        the slower of the two, not their sum. The first failure of either ends the round."""
        send = asyncio.ensure_future(self._send(right, msg, timeout_s))
        receive = asyncio.ensure_future(self._receive(rnd, msg.phase, msg.step, timeout_s))
        try:
            await asyncio.wait({send, receive}, return_when=asyncio.FIRST_EXCEPTION)
            for task in (send, receive):
                if task.done():
                    task.result()  # raises the RingFailed that ended the wait, if any
            await send
            return await receive
        finally:
            for task in (send, receive):
                task.cancel()

    async def _send(self, hop: Hop, msg: RingChunk, timeout_s: float) -> None:
        try:
            await self.transport.request(hop.address, msg, timeout_s, hop.peer_id)
        except TransportError as e:
            raise RingFailed(f"sending {msg.phase}/{msg.step} to {hop.peer_id[:8]}: {e}") from None
        self.bytes_sent += tensor_bytes(msg.tensors)

    async def _receive(self, rnd: _Round, phase: str, step: int, timeout_s: float) -> _Chunk:
        fut = rnd.inbox.setdefault((phase, step), _future())
        try:
            got = await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            raise RingFailed(f"no {phase}/{step} chunk within {timeout_s:.0f}s") from None
        self.held_bytes -= rnd.held.pop((phase, step), 0)
        return got

    def round_ids(self) -> list[str]:
        """Rounds with a mailbox here: started here, or by a peer whose chunks came first."""
        return list(self._rounds)

    def forget_stale(self, keep: Callable[[str], bool]) -> None:
        """Drop mailboxes of rounds ``keep`` rejects (chunks for rounds we will never run)."""
        for round_id in [r for r in self._rounds if not keep(r)]:
            self._drop(round_id)

    def _drop(self, round_id: str) -> None:
        rnd = self._rounds.pop(round_id, None)
        if rnd is not None:
            self.held_bytes -= sum(rnd.held.values())


def _side_sum(own: list[float], carry: list[float] | None, got: list[float]) -> list[float] | None:
    """The side sums to send on (and, after the last reduce step, the total): ours plus what
    came from the left, or None once any member sent none or another count (``carry`` None
    or ``got`` of another length: our left neighbour then sends none on, so every member
    that had values ends with None too)."""
    if carry is None or not own or len(got) != len(own):
        return None
    return [a + b for a, b in zip(own, got, strict=True)]


def _future() -> asyncio.Future[_Chunk]:
    return asyncio.get_running_loop().create_future()


async def _inline(fn: Callable[[], T]) -> T:
    return fn()
