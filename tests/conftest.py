"""Shared fixtures: network-namespace hosts and reaping of node subprocesses."""

from tests.netns import netns_lab  # noqa: F401  (fixture: factory make(n) -> Lab; skips without netns)
