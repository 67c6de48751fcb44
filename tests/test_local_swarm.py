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


def test_no_port_is_handed_out_twice_even_when_the_draw_repeats(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a swarm draws every node's port before any node binds one: two equal draws left one of
    # seven nodes unable to start ("address already in use", seen in a balance test)
    if _ephemeral_low() <= 12000:
        pytest.skip("this kernel's ephemeral range starts too low for drawn ports")
    free = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free.append(s.getsockname()[1])
    draws = iter([free[0], free[0], free[1]])
    monkeypatch.setattr("node.demo.random.randrange", lambda a, b: next(draws))
    assert [free_port(), free_port()] == free


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


def test_a_swarm_left_running_is_stopped_by_stop_all(tmp_path: Path) -> None:
    # what the tests' teardown (tests/conftest.py) calls after every test: a test that
    # failed while its swarm started had left six nodes training through the rest of a run
    swarm = LocalSwarm(tmp_path, {"swarm.num_block_stages": "1"})
    swarm.start_node(0)
    assert swarm in LocalSwarm.running
    ((name, proc, _),) = swarm.procs
    assert proc.poll() is None
    assert LocalSwarm.stop_all() == [name]
    assert proc.poll() is not None and swarm not in LocalSwarm.running
    assert LocalSwarm.stop_all() == []
