"""Shared fixtures: network-namespace hosts and reaping of node subprocesses."""

from collections.abc import Iterator

import pytest

from node.demo import LocalSwarm
from tests.netns import netns_lab  # noqa: F401  (fixture: factory make(n) -> Lab; skips without netns)


@pytest.fixture(autouse=True)
def reap_local_swarms() -> Iterator[None]:
    """After each test, stop the node processes of any ``LocalSwarm`` it left running."""
    yield
    left = LocalSwarm.stop_all()
    if left:
        print(f"reaped node processes a test left running: {left}")
