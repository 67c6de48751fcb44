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
                return self._send(lambda: self.hops.send_to(path[0], out), msg, stage)
            return self._send(lambda: self.hops.send_to_stage(nxt, out), msg, stage)

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
            return self._send(lambda: self.hops.send_to(prev, back), msg, runner.stage)

        return job

    def _send(
        self, hop: Callable[[], Awaitable[bool]], msg: Forward | Backward, stage: int
    ) -> Send:
        """A job's send: the ``hop``, and if it went nowhere, a word to the microbatch's head
        (also when the hop was to the head itself: an upload this node's thin uplink had no
        time for is never refused by the head, so it would only wait out its deadline)."""

        async def send() -> None:
            if not await hop():
                await self.hops.tell_head(msg.path[0], msg.mb_id, stage)

        return send
