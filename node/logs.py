"""Logging set-up: every line carries the node's short id, stage and step.

The daemon registers a context callback once it knows who it is; before that the prefix
shows ``-``. Only the CLI prints to stdout; everything else logs to stderr.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable

_context: Callable[[], str] = lambda: "-"  # noqa: E731


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.node = _context()
        return True


def setup_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ContextFilter())
    handler.setFormatter(
        logging.Formatter(
            "%(asctime)s %(levelname).1s [%(node)s] %(name)s: %(message)s", "%H:%M:%S"
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    root.setLevel(numeric)
    for noisy in ("aiohttp.access", "zeroconf", "asyncio"):
        logging.getLogger(noisy).setLevel(max(numeric, logging.WARNING))


def set_context(fn: Callable[[], str]) -> None:
    """``fn()`` gives the prefix, e.g. ``a1b2c3d4 s1 step 42``."""
    global _context
    _context = fn


class RateLimitedLog:
    """Logs at most once per ``interval_s`` per key: a hostile or broken peer must not be
    able to flood the log with the same refusal."""

    def __init__(self, logger: logging.Logger, interval_s: float = 5.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last: dict[str, float] = {}

    def log(self, key: str, level: int, fmt: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -math.inf) >= self.interval_s:
            if len(self._last) >= 4096:  # keys name peers: forget them all now and then
                self._last.clear()
            self._last[key] = now
            self.logger.log(level, fmt, *args)
