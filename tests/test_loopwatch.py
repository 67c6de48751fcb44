"""The loop watch names the code that held the event loop up, and counts the hold-up."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import pytest

from node.loopwatch import LoopWatch


def a_handler_that_blocks(seconds: float) -> None:
    time.sleep(seconds)  # what a handler must never do on the loop


def test_a_held_up_loop_is_reported_with_where_it_was_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counters: Counter[str] = Counter()
    watch = LoopWatch(counters, warn_s=0.2)

    async def main() -> None:
        task = asyncio.create_task(watch.run())
        await asyncio.sleep(0.3)  # short awaits are not hold-ups
        assert counters["loop_stalls"] == 0
        a_handler_that_blocks(0.6)
        await asyncio.sleep(0.2)  # the loop runs again: the hold-up is counted
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.WARNING, logger="node.loopwatch"):
        asyncio.run(main())
    assert counters["loop_stalls"] == 1
    assert 0.3 <= watch.status()["longest_s"] <= 0.7
    where = [r.getMessage() for r in caplog.records if "has not run" in r.getMessage()]
    assert len(where) == 1, where  # once per hold-up, from the watch thread
    assert "a_handler_that_blocks" in where[0] and "time.sleep(seconds)" in where[0]
    assert any("held up for 0." in r.getMessage() for r in caplog.records)
