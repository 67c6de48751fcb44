"""What a node's heartbeats say about it while it takes a stage (a real ``Node``, in process)."""

from __future__ import annotations

import pytest

from node.config import resolve_config
from node.daemon import Node
from node.stage.runner import StageRunner

pytestmark = pytest.mark.timeout(60)


async def test_a_new_block_replica_publishes_its_benchmark_while_its_module_builds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Heartbeats go out while the stage's module is built on the compute thread (seconds on
    # a loaded machine); a record with no rate then made balancing count the replica as a
    # typical one and failed tests/test_balance_processes.py in CI.
    config = {"net.listen": "127.0.0.1:0", "net.zeroconf": False, "balance.benchmark_s": 0}
    node = Node(resolve_config(overrides={**config, "swarm.num_block_stages": 2}))
    node.balancer.block_rate = 40.0  # as if measured by the start-up benchmark
    published: list[float] = []
    build = StageRunner.start

    async def start(runner: StageRunner) -> None:
        published.append(node.record().throughput)
        await build(runner)

    monkeypatch.setattr(StageRunner, "start", start)
    try:
        await node.take_stage(1)
        assert published == [40.0]
        assert node.record().throughput == 40.0
    finally:
        await node.close()
