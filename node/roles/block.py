"""A block stage's role: a microbatch's forward and backward through this stage's blocks.

Forward: the activations go through the blocks (kept for the backward under the
microbatch's id, with the weights they were made with: ``node.stage.runner``), and the
output goes on to a replica of the next stage in the microbatch's route, or home to the
head that issued it after the last block stage. Backward: the gradient goes back through
the same blocks and on to the previous hop of the recorded path. When an output or a
gradient goes nowhere, the head is told, so it re-issues the microbatch at once. Both
messages are built and encoded on the compute thread, so the event loop only sends them.

Does not own the weights or the maths (``node.stage.runner``), the queue or the sending
(``node.pipeline``).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

from node.context import NodeContext
from node.pipeline import HopSender, Job, Send
from node.stage.runner import StageRunner
from protocol.messages import Backward, Forward, Hop, prepare
from protocol.quant import WireTensor, encode_tensor
from swarm.seams import Refused

HEAD_NEEDS_NO_WORD = frozenset(
    {"stale_microbatch", "unreachable", "banned", "unknown_peer", "identity_mismatch"}
)
"""Why a hop to the head itself failed, when a drop notice to it would do nothing: it no
longer waits for the microbatch (``stale_microbatch``: its deadline or an earlier notice
re-issued it), or it would refuse or never get the notice for the same reason as the hop."""


class BlockRole:
    """One block-stage replica's jobs."""

    forward_kind = "forward"

    def __init__(self, ctx: NodeContext, runner: StageRunner, hops: HopSender) -> None:
        self.ctx = ctx
        self.runner = runner
        self.hops = hops

    def forward_job(self, msg: Forward, x: WireTensor) -> Job:
        runner, stage = self.runner, self.runner.stage
        codec = self.hops.codec(math.prod(x.shape), runner.job_s)
        path = [*msg.path, Hop(stage, self.ctx.peer_id, self.ctx.state.address)]
        route = msg.route or list(range(1, self.ctx.num_stages))
        hop = len(msg.path) - 1  # our position in the route
        nxt = route[hop + 1] if hop + 1 < len(route) else 0

        def compute() -> Forward:
            out = runner.block_forward(msg.mb_id, x.decode(), train=not msg.eval)
            tensors, meta = encode_tensor(out, codec, name="h")
            onward = Forward(
                mb_id=msg.mb_id,
                target_stage=nxt,
                path=path,
                eval=msg.eval,
                meta=meta,
                tensors=tensors,
                route=msg.route,
            )
            return prepare(onward)

        async def job() -> Send:
            out = await runner.compute(compute)
            if nxt == 0:
                return self._send(lambda: self.hops.send_to(path[0], out), msg, stage, True)
            return self._send(lambda: self.hops.send_to_stage(nxt, out), msg, stage, False)

        return job

    def backward_job(self, msg: Backward, g: WireTensor) -> Job:
        runner = self.runner
        if not runner.has_saved(msg.mb_id):
            raise Refused(
                "unknown_microbatch",
                f"no saved activations for {msg.mb_id} (expired or never seen)",
                410,
            )
        codec = self.hops.codec(math.prod(g.shape), runner.job_s)

        def compute() -> Backward:
            grad = runner.block_backward(msg.mb_id, g.decode())
            tensors, meta = encode_tensor(grad, codec, name="g")
            back = Backward(
                mb_id=msg.mb_id, index=msg.index - 1, path=msg.path, meta=meta, tensors=tensors
            )
            return prepare(back)

        async def job() -> Send:
            back = await runner.compute(compute)
            prev = msg.path[msg.index - 1]
            to_head = msg.index - 1 == 0
            return self._send(lambda: self.hops.send_to(prev, back), msg, runner.stage, to_head)

        return job

    def _send(
        self,
        hop: Callable[[], Awaitable[str | None]],
        msg: Forward | Backward,
        stage: int,
        to_head: bool,
    ) -> Send:
        """A job's send: the ``hop`` (``to_head``: to the microbatch's head itself), and if
        it went nowhere, a word to that head, so it re-issues the microbatch now. Also after
        a hop to the head, which may not know: an upload this node's thin uplink had no time
        for, or one the head turned away as ``overloaded``, would otherwise wait out its
        deadline. Not where the head already knows or would not take the word either
        (``HEAD_NEEDS_NO_WORD``)."""

        async def send() -> None:
            error = await hop()
            if error is None:
                return
            if to_head and error in HEAD_NEEDS_NO_WORD:
                self.ctx.counters["drop_notices_needless"] += 1
                return
            await self.hops.tell_head(msg.path[0], msg.mb_id, stage)

        return send
