"""A hop that goes nowhere is told to the head that issued it, between real processes.

A head, a replica of block stage 1 and one of stage 2 that refuses every forward
(``net.max_queued_bytes`` of one byte: ``overloaded``). Stage 1's outputs find no replica
to take them, so it sends the head a ``Dropped`` notice for each, and the head re-issues
the microbatch at once. The microbatch deadline is ten minutes, so every re-issue the test
sees came from a notice.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from node.client import fetch_status
from node.demo import LocalSwarm, wait_ready
from tests.helpers import FAST_SWARM, wait_for

pytestmark = pytest.mark.timeout(240)


def test_a_microbatch_no_replica_takes_is_re_issued_at_once(tmp_path: Path) -> None:
    settings = {
        **FAST_SWARM,
        "swarm.num_block_stages": "2",
        "train.hop_timeout_s": "2",
        "train.microbatch_deadline_s": "600",
    }
    s = LocalSwarm(tmp_path, settings)
    try:
        head = s.start_node(0)
        first = s.start_node(1)
        full = s.start_node(2, extra=["--set", "net.max_queued_bytes=1"])
        for address in (head, first, full):
            wait_ready(address, 90, s)

        def notices() -> dict[str, int] | None:
            counters: dict[str, int] = fetch_status(head)["counters"]
            return counters if counters.get("drop_notices", 0) >= 3 else None

        counters = wait_for(
            notices, 90, "three drop notices at the head", describe=lambda: fetch_status(head)
        )
        assert counters.get("microbatches_retried", 0) >= 3, counters
        assert counters.get("microbatches_completed", 0) == 0, counters
        sent = fetch_status(first)["counters"]
        assert sent.get("drop_notices_sent", 0) >= 3, sent
        assert sent.get("send_failed_overloaded", 0) >= 3, sent
        assert fetch_status(full)["counters"].get("rejected_overloaded", 0) >= 3
        head_log = "".join(p.read_text() for p in s.log_dir.glob("stage0-*.log"))
        assert "went no further than stage 1" in head_log
        assert "was dropped on its way; re-issuing" in head_log
        assert "missed its deadline" not in head_log
    finally:
        s.stop(grace_s=5)
