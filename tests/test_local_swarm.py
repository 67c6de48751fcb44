"""The local swarm's plumbing (``node.demo``): ports for its nodes, and a clear start-up failure."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from node.demo import LocalSwarm, _ephemeral_low, free_port, wait_ready

pytestmark = pytest.mark.timeout(60)


def test_free_ports_are_below_the_range_outgoing_connections_draw_from() -> None:
    # a port in that range can be handed to another process's connect() before the node
    # binds it: the node then exits with "address in use" (a CI failure of the poison test)
    low = _ephemeral_low()
    if low <= 12000:
        pytest.skip(f"this kernel's ephemeral range starts at {low}")
    for _ in range(20):
        port = free_port()
        assert 10000 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_node_that_exits_at_start_up_is_reported_with_its_log(tmp_path: Path) -> None:
    swarm = LocalSwarm(tmp_path, {"swarm.num_block_stages": "3"})
    try:
        address = swarm.start_node(5)
        with pytest.raises(RuntimeError) as e:
            wait_ready(address, 30, swarm)
        assert "exited during start-up" in str(e.value)
        assert "got '5'" in str(e.value)  # the node's own error, from its log
    finally:
        swarm.stop(grace_s=1)
