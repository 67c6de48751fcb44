"""Helpers shared by the tests that drive real processes or real HTTP servers."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from node.config import resolve_config
from node.daemon import Node
from node.demo import LocalSwarm
from node.net.transport import RPC_PATH

FAST_SWARM = {
    "node.join_wait_s": "1.0",
    "train.eval_interval_s": "0",
    "train.hop_timeout_s": "3",
    "train.microbatch_deadline_s": "8",
    "membership.ttl_s": "4",
}
"""What the process tests' swarms share: a node joins after 1 s of listening, no periodic
evaluation, short hop and microbatch deadlines, and a silent peer expires after 4 s. Each
test file adds or overrides what its scenario needs: ``{**FAST_SWARM, ...}``."""

IN_PROCESS_REPLICA = {
    "net.listen": "127.0.0.1:0",
    "net.zeroconf": False,
    "node.stage": "1",
    "swarm.num_block_stages": 2,
    "balance.benchmark_s": 0,
}
"""A ``node.daemon.Node`` run inside a test's event loop as a replica of block stage 1 (of
2), on a free loopback port, without zeroconf or a speed benchmark; peers are introduced
by the test (``table.observe``)."""


async def known_replicas(
    settings: list[dict[str, Any]], stages: list[int] | None = None
) -> list[Node]:
    """Started ``node.daemon.Node``s, one per entry of ``settings`` (each added to
    ``IN_PROCESS_REPLICA``), serving block stage 1 or the stage ``stages`` gives, each in
    the others' tables. The caller closes them."""
    nodes = [Node(resolve_config(overrides={**IN_PROCESS_REPLICA, **extra})) for extra in settings]
    for node, stage in zip(nodes, stages or [1] * len(nodes), strict=True):
        await node.start_server()
        await node.take_stage(stage)
    for me in nodes:
        for other in nodes:
            if other is not me:
                me.table.observe(other.record(), me.clock.now())
    return nodes


async def outer_round(node: Any) -> None:
    """One outer round of ``node`` (a ``Node``), as its sync service starts one when the
    runner says it is due."""
    assert node.sync is not None
    node.sync.running = True
    await node.sync._round("outer", 1)


def wait_for(
    pred: Callable[[], Any],
    timeout_s: float,
    what: str,
    interval_s: float = 0.5,
    describe: Callable[[], Any] | None = None,
) -> Any:
    """Poll ``pred`` until it returns something truthy (returned). A node that is still
    starting may make ``pred`` raise OSError, ValueError, KeyError or, when it is reached
    through ``ip netns exec``, a SubprocessError meanwhile. AssertionError on timeout, with
    what ``describe`` returns then (the state a reader needs to tell why)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = pred()
            if last:
                return last
        except (OSError, ValueError, KeyError, subprocess.SubprocessError) as e:
            last = e
        time.sleep(interval_s)
    detail = ""
    if describe is not None:
        try:
            detail = f"; state: {describe()!r}"
        except Exception as e:  # the description must not hide the timeout
            detail = f"; state unavailable: {e!r}"
    raise AssertionError(
        f"timed out after {timeout_s:.0f}s waiting for {what} (last: {last!r}){detail}"
    )


def accounted(c: dict[str, int], pending: int) -> tuple[int, int]:
    """A head's microbatches: (issued, completed + retried + dropped + still pending); the two
    are equal in every status snapshot when none is lost."""
    ended = (
        c.get("microbatches_completed", 0)
        + c.get("microbatches_retried", 0)
        + c.get("microbatches_dropped", 0)
    )
    return c.get("microbatches_issued", 0), ended + pending


def kill_nodes(s: LocalSwarm, addresses: list[str]) -> None:
    """SIGKILL the nodes at these addresses and forget them (an intended death, not a
    failure that ``LocalSwarm.dead`` should report)."""
    ports = {a.rsplit(":", 1)[1] for a in addresses}
    for entry in list(s.procs):
        name, proc, log = entry
        if name.rsplit("-", 1)[1] in ports:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            log.close()
            s.procs.remove(entry)


@contextlib.asynccontextmanager
async def rpc_app(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[tuple[web.Application, str]]:
    """An aiohttp app serving ``handler`` at ``POST /rpc`` on loopback: ``(app, address)``."""
    app = web.Application()
    app.router.add_post(RPC_PATH, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield app, f"127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1")
"""Debian's ``faketime`` package (``.ci/setup-extras.sh`` installs it): preloaded, it shifts
every clock a process reads."""


def faketime_env(**settings: str) -> dict[str, str]:
    """The environment that preloads libfaketime with ``settings`` (``FAKETIME`` or
    ``FAKETIME_TIMESTAMP_FILE``...): the wall clock is shifted, the monotonic clock is left
    as it is (its origin means nothing, and a machine whose clock is set keeps it), and
    libfaketime's "monotonic fix" is off. That fix, on by default with this glibc, bends the
    timed waits on a condition with a monotonic clock, among them CPython's wait for the
    GIL: a thread that asks for the GIL got it after up to 280 ms instead of 5 ms (a busy
    thread beside a loop of 1 ms waits: 12 ms at most without libfaketime or with the fix
    off, 250 to 280 ms with it on; faking the monotonic clock too hung the loop). That is
    the likely cause of what the clock set-back test saw of its libfaketime node: missed
    membership pings (buried as dead, "false alarm"), 46 s to join once (the test then
    failed), and about 4 s without answering after its clock was set back. Even so ``time.sleep`` fails under
    libfaketime (EINVAL from ``clock_nanosleep``): a node run with it must not use
    ``train.compute_delay_s`` or ``train.slowdown``, which sleep."""
    return {
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "FAKETIME_FORCE_MONOTONIC_FIX": "0",
        **settings,
    }


def wrong_clock(ahead_s: int) -> tuple[list[str], dict[str, str]]:
    """Settings and environment for a node whose clock is ``ahead_s`` seconds ahead: the
    machine's own clock as the process reads it (libfaketime) where installed, else
    ``node.debug_clock_skew_s`` (the wall clock the schedule reads; signatures keep the
    true time)."""
    if LIBFAKETIME.exists():
        return [], faketime_env(FAKETIME=f"+{ahead_s}s")
    return ["--set", f"node.debug_clock_skew_s={ahead_s}"], {}
