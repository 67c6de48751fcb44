"""A watch on the node's event loop: says when something held it up, for how long and where.

A held-up loop answers nothing: heartbeats, hops, gossip and ``/status`` all wait, and a
peer or an operator sees a node that does not answer. Every handler is meant to hand heavy
work to the compute thread or a worker thread; this says which one did not, or that the
whole process got no CPU (then the loop thread's stack shows it idle, waiting for events).

Owns: a stamp the loop renews every ``beat_s`` (``run``, a task on the loop) and a daemon
thread that reads it. When the stamp is ``warn_s`` old the thread logs a WARNING with the
loop thread's stack at that moment (once per hold-up); when the loop runs again it counts
the hold-up (``counters["loop_stalls"]``, exported as ``murmur_loop_stalls_total``) and
keeps the longest (``status``). Does not own: what held the loop up, or any timing of the node.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from collections import Counter
from typing import Any

log = logging.getLogger(__name__)

WARN_S = 2.0
"""A loop held up this long is reported: far above any handler's share of a turn, and
below every timeout a peer or an operator's ``node status`` (5 s) gives the node."""

STACK_FRAMES = 12
"""Innermost frames of the loop thread's stack logged with a hold-up."""


class LoopWatch:
    """The event loop's heartbeat, and a thread that reports where it stopped."""

    def __init__(self, counters: Counter[str], warn_s: float = WARN_S) -> None:
        self.counters = counters
        self.warn_s = warn_s
        self.beat_s = warn_s / 8
        self.longest_s = 0.0
        self._stamp = time.monotonic()
        self._loop_thread = 0
        self._done = threading.Event()

    async def run(self) -> None:
        """Renew the stamp every ``beat_s`` until cancelled; count each hold-up."""
        self._loop_thread = threading.get_ident()
        self._stamp = time.monotonic()
        watcher = threading.Thread(target=self._watch, name="loop-watch", daemon=True)
        watcher.start()
        try:
            while True:
                before = time.monotonic()
                await asyncio.sleep(self.beat_s)
                self._stamp = time.monotonic()
                held_s = self._stamp - before - self.beat_s
                if held_s >= self.warn_s:
                    self.counters["loop_stalls"] += 1
                    self.longest_s = max(self.longest_s, held_s)
                    log.warning("the event loop was held up for %.1f s", held_s)
        finally:
            self._done.set()

    def _watch(self) -> None:
        reported = 0.0
        while not self._done.wait(self.beat_s):
            stamp = self._stamp
            held_s = time.monotonic() - stamp
            if held_s < self.warn_s or stamp == reported:
                continue
            reported = stamp
            frame = sys._current_frames().get(self._loop_thread)
            where = "".join(traceback.format_stack(frame)[-STACK_FRAMES:]) if frame else "?\n"
            log.warning(
                "the event loop has not run for %.1f s; its thread is at (innermost last):\n%s",
                held_s,
                where.rstrip("\n"),
            )

    def status(self) -> dict[str, Any]:
        return {"stalls": self.counters["loop_stalls"], "longest_s": round(self.longest_s, 2)}
