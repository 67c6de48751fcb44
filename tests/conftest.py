"""Shared fixtures: network-namespace hosts, reaping of node subprocesses, IEEE floats."""

from collections.abc import Iterator

import pytest
import torch

from node.demo import LocalSwarm
from tests.netns import netns_lab  # noqa: F401  (fixture: factory make(n) -> Lab; skips without netns)


@pytest.fixture(autouse=True)
def reap_local_swarms() -> Iterator[None]:
    """After each test, stop the node processes of any ``LocalSwarm`` it left running."""
    yield
    left = LocalSwarm.stop_all()
    if left:
        print(f"reaped node processes a test left running: {left}")


@pytest.fixture(autouse=True)
def ieee_floats_after_each_test() -> Iterator[None]:
    """A runner built on the test's own thread (``StageRunner._build``) sets the CPU's
    flush-to-zero flag on it (``node.flush_denormal``), and every thread started later
    inherits it; put IEEE arithmetic back so a later test sees it (hypothesis refuses to
    generate floats under the flag)."""
    yield
    torch.set_flush_denormal(False)
