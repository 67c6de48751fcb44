"""A hop that goes nowhere is told to the head that issued it, between real processes.

A head and one replica of each of two block stages, one node of the three refusing every
forward (``net.max_queued_bytes`` of one byte: ``overloaded``): stage 2, so stage 1's
outputs find no replica to take them; or the head, so stage 2's outputs cannot go home
(as when a thin uplink has no time left for them, which the head never hears of). The
replica sends the head a ``Dropped`` notice for each, and the head re-issues the
microbatch at once. The microbatch deadline is ten minutes, so every re-issue the test
sees came from a notice.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from node.client import fetch_status
from node.demo import LocalSwarm, wait_ready
from tests.helpers import FAST_SWARM, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.mark.parametrize(("full", "sender"), [(2, 1), (0, 2)], ids=["next-stage", "home"])
def test_a_microbatch_that_goes_nowhere_is_re_issued_at_once(
    tmp_path: Path, full: int, sender: int
) -> None:
    settings = {
        **FAST_SWARM,
        "swarm.num_block_stages": "2",
        "train.hop_timeout_s": "2",
        "train.microbatch_deadline_s": "600",
    }
    s = LocalSwarm(tmp_path, settings)
    try:
        refuse = ["--set", "net.max_queued_bytes=1"]
        head, first, last = (s.start_node(k, extra=refuse if k == full else None) for k in range(3))
        for address in (head, first, last):
            wait_ready(address, 90, s)

        def notices() -> dict[str, int] | None:
            counters: dict[str, int] = fetch_status(head)["counters"]
            return counters if counters.get("drop_notices", 0) >= 3 else None

        counters = wait_for(
            notices, 90, "three drop notices at the head", describe=lambda: fetch_status(head)
        )
        assert counters.get("microbatches_retried", 0) >= 3, counters
        assert counters.get("microbatches_completed", 0) == 0, counters
        sent = fetch_status((first, last)[sender - 1])["counters"]
        assert sent.get("drop_notices_sent", 0) >= 3, sent
        assert sent.get("send_failed_overloaded", 0) >= 3, sent
        refused = fetch_status((head, first, last)[full])["counters"]
        assert refused.get("rejected_overloaded", 0) >= 3, refused
        head_log = "".join(p.read_text() for p in s.log_dir.glob("stage0-*.log"))
        assert f"went no further than stage {sender}" in head_log
        assert "was dropped on its way; re-issuing" in head_log
        assert "missed its deadline" not in head_log
    finally:
        s.stop(grace_s=5)
