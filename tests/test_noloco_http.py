"""A NoLoCo round between two real nodes over HTTP ends where the published rule says.

The replica that answers a gossip request applies its own outer step while its reply may
still be on the wire (a large reply is written from the tensors' own memory after the
handler returned). Here the answering node's reply is held back until its outer step is
done, as a slow link would, so an offer that shares memory with the live slow weights shows
every time: the asker would receive the answerer's already-updated weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from aiohttp import web

from node.config import resolve_config
from node.daemon import Node
from tests.helpers import IN_PROCESS_REPLICA, outer_round
from tests.test_runner import noloco_by_the_rule

pytestmark = pytest.mark.timeout(60)

SETTINGS = {
    **IN_PROCESS_REPLICA,
    "sync.round_deadline_s": 10,
    "sync.request_timeout_s": 8,
    "sync.hold_s": 5,
}


async def replica(listen_s: float) -> Node:
    node = Node(resolve_config(overrides={**SETTINGS, "sync.listen_s": listen_s}))

    async def hold_reply_until_stepped(request: web.Request, response: web.StreamResponse) -> None:
        # the answerer's reply leaves only once its own outer step is done
        sync = node.sync
        if request.path == "/rpc" and sync is not None and sync.running:
            for _ in range(500):
                if sum(sync.rounds.values()):
                    return
                await asyncio.sleep(0.01)

    node.server.app.on_response_prepare.append(hold_reply_until_stepped)
    await node.start_server()
    await node.take_stage(1)
    return node


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Node, Node]]:
    asker, answerer = await replica(listen_s=0.0), await replica(listen_s=3.0)
    try:
        for me, other in ((asker, answerer), (answerer, asker)):
            me.table.observe(other.record(), me.clock.now())
        yield asker, answerer
    finally:
        await asker.close()
        await answerer.close()


async def state_of(node: Node) -> dict[str, torch.Tensor]:
    runner = node.runner
    assert runner is not None

    def read() -> dict[str, torch.Tensor]:
        theta = torch.cat([p.detach().flatten() for p in runner.module.parameters()])
        return {"theta": theta.double(), "phi": runner.phi.double(), "m": runner.outer.m.double()}

    return await runner.compute(read)


async def drift(node: Node, seed: int) -> None:
    """Inner steps, as far as the outer step cares: the fast weights move."""
    runner = node.runner
    assert runner is not None

    def move() -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in runner.module.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=gen))

    await runner.compute(move)


async def test_a_paired_round_over_http_follows_the_rule_on_both_sides(pair: Any) -> None:
    asker, answerer = pair
    await drift(asker, 1)
    await drift(answerer, 2)
    before = {n: await state_of(n) for n in (asker, answerer)}
    first = asyncio.create_task(outer_round(asker))
    await asyncio.sleep(0.3)  # the asker's request waits, held, until the answerer seeks
    await asyncio.gather(first, outer_round(answerer))
    for node in (asker, answerer):
        assert node.sync.rounds == {"paired": 1}, node.sync.rounds
    for me, other in ((asker, answerer), (answerer, asker)):
        want = noloco_by_the_rule(before[me], before[other], 0.5, 0.7, 0.7)
        got = await state_of(me)
        for key in ("theta", "phi", "m"):
            err = float((got[key] - want[key]).abs().max())
            assert err < 1e-6, (
                f"{key} of the {'asker' if me is asker else 'answerer'} is {err:.2e} off"
            )


async def test_each_side_of_a_pair_hears_the_upload_time_the_other_announced(pair: Any) -> None:
    """The asker's uploads get 1 MB/s, the answerer's 2 MB/s: each announces its
    contribution's time at its rate, and each records the other's (the asker's from its
    proposal, the answerer's from its promise), which its next judgement of an exchange's
    length reads: its own upload, then the partner's, never longer than its own."""
    asker, answerer = pair
    asker.sync.uplink_bytes_s = lambda: 1e6
    answerer.sync.uplink_bytes_s = lambda: 2e6
    first = asyncio.create_task(outer_round(asker))
    await asyncio.sleep(0.3)
    await asyncio.gather(first, outer_round(answerer))
    for me, other in ((asker, answerer), (answerer, asker)):
        assert me.sync.rounds == {"paired": 1}, me.sync.rounds
        assert list(me.sync.partner_uploads) == [pytest.approx(other.sync.contribution_send_s)]
    mine, theirs = asker.sync.contribution_send_s, answerer.sync.contribution_send_s
    assert mine == pytest.approx(2 * theirs) and mine > 1.0  # the same bytes, half the rate
    assert asker.sync.contribution_exchange_s == pytest.approx(mine + theirs)
    assert answerer.sync.contribution_exchange_s == pytest.approx(2 * theirs)  # the slower: its own
