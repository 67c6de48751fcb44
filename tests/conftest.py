"""Shared fixtures: network-namespace hosts, reaping of node subprocesses, IEEE floats."""

from collections.abc import Iterator

import hypothesis  # noqa: F401  (imported here, before any test runs: see below)
import pytest
import torch

from node.demo import LocalSwarm
from tests.netns import netns_lab  # noqa: F401  (fixture: factory make(n) -> Lab; skips without netns)

# Why hypothesis is imported above: run as ``pytest tests/test_wirecodec.py
# tests/test_liveness.py`` (that order; all 14 tests pass), the session used to end in an
# INTERNALERROR. Hypothesis's plugin imports the package lazily in its end-of-session
# summary, pytest's assertion rewriter parses it there, and CPython 3.11.7's ``ast.parse``
# raised ``SystemError: AST constructor recursion depth mismatch (before=141,
# after=191)``: the check reported in python/cpython#106905 (whether its fix covers this
# case is not checked here). The same parse inside a test passes. Imported before any test
# runs, the package is never parsed at the end.


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
