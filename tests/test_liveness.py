"""A hop that times out does not make a live peer look dead to recovery.

A real node of stage 1 (the lower id of stage 1's two replicas, so the one that would refill
an empty stage 2) sends real hops to stage 2's only replica, whose address takes the
connection and never answers: every hop times out, as a hop does that waits in the
sender's own thin uplink. While that replica keeps sending the node requests of its own,
stage 2 is not empty and nobody moves; once it has been silent for two heartbeats, the next
failed hop counts it out at once and the node refills stage 2 after
``recovery.refill_wait_s``, as before.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from dataclasses import replace

import pytest

from protocol.messages import PeerRecord, Ping
from tests.test_hostile import forward, post, start_node

pytestmark = pytest.mark.timeout(60)

SILENT = "00000000000000cc"
"""Stage 2's only replica."""


@pytest.fixture
def mute_address() -> Iterator[str]:
    """An address whose socket takes connections (the kernel's backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"127.0.0.1:{s.getsockname()[1]}"


async def test_a_peer_whose_hops_time_out_but_who_speaks_to_us_is_not_counted_dead(
    mute_address: str,
) -> None:
    refill_s = 0.5
    node = await start_node(
        "0000000000000011",
        **{
            "recovery.refill_wait_s": refill_s,
            "train.hop_timeout_s": 0.3,
            "train.hop_retries": 0,
        },
    )
    try:
        replica = PeerRecord(peer_id=SILENT, address=mute_address, stage=2, ready=True)
        node.table.observe(replica, node.clock.now())
        heartbeat = Ping(SILENT, [replica], [])
        # Its hops time out, but it keeps speaking: stage 2 is never empty, nobody moves.
        for _ in range(4):
            assert await node.hops.send_to_stage(2, forward(stage=2)) == "timeout"
            assert (await post(node, heartbeat))[0] == 200
            await node.recovery.check()
            await asyncio.sleep(refill_s / 2)
            await node.recovery.check()
        assert node.counters["send_failed_timeout"] == 4
        assert node.counters["stages_seen_empty"] == 0 and node.state.stage == 1
        assert SILENT in {r.peer_id for r in node.recovery.live()[2]}

        # Silent, and a hop fails: counted out once it has been silent for two heartbeats
        # (membership.heartbeat_s = 1), then refilled after the wait.
        silent_s = node.router.silent_s
        assert silent_s == 2.0
        await asyncio.sleep(silent_s)
        assert await node.hops.send_to_stage(2, forward(stage=2)) == "timeout"
        await node.recovery.check()
        assert node.counters["stages_seen_empty"] == 1 and 2 in node.recovery.empty_since
        await asyncio.sleep(refill_s + 0.1)
        await node.recovery.check()
        assert node.state.stage == 2 and node.state.serving
    finally:
        await node.close()


async def test_only_a_stage_seen_live_is_counted_as_lost() -> None:
    """A swarm starting: a replica of stage 2 is known but not serving yet. The stage is
    empty (a refill may follow, as before), but it lost nothing: it is not counted, and the
    log says so at info level. Once served and then unresponsive, it is counted."""
    node = await start_node("0000000000000011")
    try:
        replica = PeerRecord(peer_id=SILENT, address="127.0.0.1:9", stage=2, ready=False)
        node.table.observe(replica, node.clock.now())
        await node.recovery.check()
        assert 2 in node.recovery.empty_since and 2 not in node.recovery.seen_live
        assert node.counters["stages_seen_empty"] == 0
        node.table.observe(replace(replica, ready=True, version=1), node.clock.now())
        await node.recovery.check()
        assert 2 not in node.recovery.empty_since and 2 in node.recovery.seen_live
        node.router.started(SILENT)  # a hop to it fails, and it has not spoken to us
        node.router.finished(SILENT, False, node.clock.now())
        await node.recovery.check()
        assert 2 in node.recovery.empty_since
        assert node.counters["stages_seen_empty"] == 1
    finally:
        await node.close()
