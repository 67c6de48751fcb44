"""The "before" of ``bench/membership.py``: what whole-table membership cost per node.

Until commit 512875b every heartbeat a node sent its whole peer table to ``fanout`` peers and
got theirs back. This script measures that code: it must run inside a checkout of the
revision before (``git worktree add /tmp/before 4b01895``), with that checkout first on the
path, since it uses that revision's API::

    cd /tmp/before && PYTHONPATH=/tmp/before python /path/to/bench/membership_tables.py 25,50,100,200

Per size: ``n`` nodes whose tables hold everyone (as after joining) run 3 rounds to settle,
then 5 rounds, each node one round per simulated second; every hello and its welcome is
encoded with that revision's codec and counted at both ends, plus the same
``HTTP_OVERHEAD_BYTES`` (300) per exchange as ``swarm.simnet``. Prints JSON: size -> bytes
per node per second (in and out). The figures are in ``results/membership.json`` under
``before``.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from collections import Counter
from typing import Any

from protocol.frames import frame_nbytes
from protocol.messages import Message, PeerRecord, encode_message
from swarm.membership import MembershipConfig, MembershipService
from swarm.peers import PeerTable

HTTP_OVERHEAD_BYTES = 300


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t

    def wall(self) -> float:
        return 1_800_000_000.0 + self.t

    async def sleep(self, seconds: float) -> None:
        self.t += seconds


class Net:
    def __init__(self) -> None:
        self.nodes: dict[str, MembershipService] = {}
        self.bytes: Counter[str] = Counter()


class Transport:
    def __init__(self, net: Net, source: str) -> None:
        self.net, self.source = net, source

    async def request(
        self, address: str, msg: Message, timeout_s: float, peer_id: str = ""
    ) -> Message:
        reply: Any = self.net.nodes[address].handle_hello(msg, "10.0.0.1")  # type: ignore[arg-type]
        for m in (msg, reply):
            size = frame_nbytes(encode_message(m)) + HTTP_OVERHEAD_BYTES // 2
            self.net.bytes[self.source] += size
            self.net.bytes[address] += size
        return reply  # type: ignore[no-any-return]


async def measure(n: int, rounds: int = 5) -> float:
    net, clock = Net(), Clock()
    nodes = []
    for i in range(n):
        address = f"10.0.{i // 256}.{i % 256}:7070"
        record = PeerRecord(peer_id=f"{i:032x}", address=address, stage=i % 8, ready=True)
        svc = MembershipService(
            MembershipConfig(),
            swarm="s",
            fingerprint="f",
            table=PeerTable(record.peer_id, 8.0, 16384),
            transport=Transport(net, address),
            clock=clock,
            self_record=lambda r=record: r,  # type: ignore[misc]
            rng=random.Random(i),
        )
        net.nodes[address] = svc
        nodes.append(svc)
    records = [s.self_record() for s in nodes]
    for svc in nodes:
        for record in records:
            # that revision's observe(record, now, rtt); today's has no third positional
            svc.table.observe(record, clock.now(), 0.0)  # type: ignore[call-arg, arg-type]
    for _ in range(3):
        for svc in nodes:
            await svc.round()
        clock.t += 1.0
    net.bytes.clear()
    for _ in range(rounds):
        for svc in nodes:
            await svc.round()
        clock.t += 1.0
    return sum(net.bytes.values()) / n / rounds


if __name__ == "__main__":
    sizes = [int(s) for s in sys.argv[1].split(",")]
    print(json.dumps({n: round(asyncio.run(measure(n)), 1) for n in sizes}))
