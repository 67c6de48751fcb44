"""The stage-role interface: the two jobs every stage makes of a microbatch.

A microbatch arrives at a node as a ``Forward`` (activations going down the pipeline, or
final hidden states coming home to the head) or a ``Backward`` (a gradient going back up).
The server (``node.server``) checks it and asks the node's role for the job to queue:

- ``node.roles.block.BlockRole`` (block stages): run the blocks forward and send the output
  to the next stage; run them backward and send the gradient to the previous hop;
- ``node.roles.head.HeadRole`` (the head stage): a forward that came home gets its loss and
  its gradient sent back; a backward that came home finishes the microbatch in the
  embedding.

Each job computes on the compute thread and returns the send to run after it
(``node.pipeline.Job``).
"""

from __future__ import annotations

from typing import Protocol

from node.pipeline import Job
from protocol.messages import Backward, Forward
from protocol.quant import WireTensor


class StageRole(Protocol):
    forward_kind: str
    """The queue kind of this role's forward jobs (``node.pipeline.PRIORITY``)."""

    def forward_job(self, msg: Forward, x: WireTensor) -> Job:
        """The job for a forward that reached this node with activations ``x``."""
        ...

    def backward_job(self, msg: Backward, g: WireTensor) -> Job:
        """The job for a backward that reached this node with gradient ``g``; ``Refused``
        when this node cannot take it (it kept nothing of that microbatch)."""
        ...
