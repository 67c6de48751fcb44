"""The swarm's page (``GET /``) in a real browser: headless Chromium loads the head's page of
a live swarm, and the test reads what a person would see from the rendered DOM (the stages
with their ready replicas, one the head's hops leave out marked so, a loss curve that
falls), and keeps a screenshot (printed path; ``docs/page.png`` is one such screenshot)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from node.client import fetch_status
from node.demo import LocalSwarm, wait_ready
from node.display import format_status
from tests.helpers import FAST_SWARM, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def chromium(*args: str) -> str:
    """Run headless Chromium with ``args``; its stdout. It waits up to 5 s of page time for
    the page's script (which fetches ``/status``) before dumping or shooting."""
    assert CHROMIUM is not None
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu"]
    cmd += ["--virtual-time-budget=5000", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=True)
    return done.stdout


def stages(block_stages: int) -> dict[str, str]:
    return {"swarm.num_block_stages": str(block_stages), "balance.benchmark_s": "0"}


def start_pipeline(s: LocalSwarm, block_stages: int) -> str:
    """A head and one replica of each of ``block_stages`` block stages, all ready; the
    head's address."""
    head = s.start_node(0)
    wait_ready(head, 90, s)
    for stage in range(1, block_stages + 1):
        wait_ready(s.start_node(stage), 90, s)
    return head


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)")
def test_the_heads_page_shows_the_stages_and_a_falling_loss(tmp_path: Path) -> None:
    """Stage 1 has a second replica, 16x slower, which the head's hops leave out
    (``train.route_cutoff=2``): the page marks it so."""
    s = LocalSwarm(tmp_path, {**FAST_SWARM, **stages(2), "train.route_cutoff": "2"})
    try:
        head = start_pipeline(s, 2)
        slow = s.start_node(1, extra=["--set", "train.slowdown=16"])
        wait_ready(slow, 90, s)

        def learning() -> bool:
            history = fetch_status(head)["loss_history"]
            return len(history) >= 6 and history[-1][1] < history[0][1] - 0.3

        wait_for(learning, 180, "the loss to fall")
        dom = chromium("--dump-dom", f"http://{head}/")
        assert 'data-loaded="1"' in dom, dom[-2000:]
        dom = dom.split("<script>")[0]  # what is drawn, not the script that draws it
        columns = [  # (stage, heading, what the column shows)
            (part[0], part.split("<h2>")[1].split("</h2>")[0], part)
            for part in dom.split('<div class="stage" data-stage="')[1:]
        ]
        assert [c[0] for c in columns] == ["0", "1", "2"], dom[-3000:]
        assert columns[0][1] == "head (stage 0)" and "(this node)" in columns[0][2]
        assert all("ready" in c[2] for c in columns)
        marked = "left out of hops: far slower"

        def slow_marked() -> bool:  # the mark lapses while the head rechecks it (each 30 s)
            page = chromium("--dump-dom", f"http://{head}/").split("<script>")[0]
            column = page.split('data-stage="1"')[1].split('data-stage="2"')[0]
            replicas = column.split('<div class="replica">')[1:]
            mine = [f"{slow}<br>" in r for r in replicas]  # its address, a direct one's line
            assert len(replicas) == 2 and sum(mine) == 1, column
            assert all(marked not in r for r, m in zip(replicas, mine, strict=True) if not m)
            return any(marked in r for r, m in zip(replicas, mine, strict=True) if m)

        wait_for(slow_marked, 90, "the page to mark the slowed replica left out")
        first, last = re.search(r'data-first="([\d.]+)" data-last="([\d.]+)"', dom).groups()  # type: ignore[union-attr]
        assert float(last) < float(first) - 0.3
        assert 'id="loss-path"' in dom and "tokens/s" in dom
        assert "swarm_key" not in dom and "X-Murmur-Auth" not in dom  # nothing secret
        shot = tmp_path / "page.png"
        chromium("--window-size=1000,800", f"--screenshot={shot}", f"http://{head}/")
        assert shot.stat().st_size > 10_000
        print(f"screenshot of the page: {shot}")
    finally:
        s.stop(grace_s=5)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)")
def test_a_stage_the_heads_table_does_not_hold_is_shown_from_its_summary(tmp_path: Path) -> None:
    # four stages: the head's neighbourhood is stages 3, 0 and 1; stage 2 it knows only by
    # the summaries its neighbours relay, and the page and `node status` say so
    s = LocalSwarm(tmp_path, {**FAST_SWARM, **stages(3)})
    try:
        head = start_pipeline(s, 3)
        wait_for(lambda: fetch_status(head)["step"] >= 2, 120, "training through stage 2")
        st = fetch_status(head)
        assert sorted(st["peers"]) == ["0", "1", "3"]  # the records it holds
        far = st["stages"]["2"]
        assert not far["held"] and (far["replicas"], far["ready"]) == (1, 1), far
        assert "stage 2: 1 replica(s), 1 ready" in format_status(st)
        dom = chromium("--dump-dom", f"http://{head}/").split("<script>")[0]
        columns = {part[0]: part for part in dom.split('<div class="stage" data-stage="')[1:]}
        assert sorted(columns) == ["0", "1", "2", "3"], dom[-3000:]
        assert "a peer's summary" in columns["2"] and "1 replica(s), 1 ready" in columns["2"]
        assert "a peer's summary" not in columns["1"]
        assert list(columns) == ["0", "1", "2", "3"]  # in stage order
    finally:
        s.stop(grace_s=5)
