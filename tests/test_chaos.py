"""Chaos with real processes: SIGKILL a random block node every few seconds, restart it.

Eight ``node join`` processes on loopback (two head nodes, three block stages of two
replicas) train while a seeded killer SIGKILLs a random block node every 4-6 s and starts
it again at once with the same port and state directory. The swarm must never stall for
long, every microbatch a head issued must be accounted for, a restarted node must come
back as the same peer, and no process that was not killed may die.

Only a node whose stage has another replica that is alive and ready is ever a victim, so no
stage is ever empty: this test is about losing work in flight, not about rebuilding a lost
stage (``test_recovery_processes`` does that).
"""

from __future__ import annotations

import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from node.client import fetch_status
from node.demo import LocalSwarm, free_port, wait_ready
from node.identity import IDENTITY_FILE
from swarm.peers import Neighbourhood
from tests.helpers import FAST_SWARM, accounted, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

SETTINGS = {
    **FAST_SWARM,
    "train.max_in_flight": "4",
    "data.batch_size": "8",
    "data.seq_len": "64",
    "sync.method": "none",
    "balance.benchmark_s": "0",
}
MAX_IN_FLIGHT = int(SETTINGS["train.max_in_flight"])
HEADS = 2
BLOCK_PLAN = [1, 1, 2, 2, 3, 3]
CHAOS_S = 75.0
KILL_EVERY_S = (4.0, 6.0)
SEED = 7
# The longest a head may go without an optimizer step. A kill costs a head at most the
# microbatches it has in flight through the victim: each waits out its deadline
# (train.microbatch_deadline_s = 8 s) and is re-issued on a fresh route, while the others go
# on through the live replicas (a SIGKILLed port refuses at once, so a hop retries another
# replica without waiting out train.hop_timeout_s = 3 s, and the victim's stale record goes
# after membership.ttl_s = 4 s). Kills 4-6 s apart can hit a re-issued microbatch again, so a
# step (four microbatches) may wait for two deadlines back to back plus a hop timeout and a
# ttl: 8 + 8 + 3 + 4 = 23 s. 30 s leaves room for a machine shared with other work; a swarm
# that has really stalled (a wedged queue, lost accounting, a refused identity) stays
# stalled far longer. Measured here: 3-8 s.
MAX_STALL_S = 30.0


@dataclass
class Block:
    """One block node the killer may kill: where it listens and what it keeps on disk."""

    stage: int
    port: int
    state_dir: Path
    peer_id: str = ""
    kills: int = 0
    up_since: float | None = None  # when it was last seen ready (None: restarting)
    restarts_s: list[float] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def start_block(s: LocalSwarm, b: Block) -> None:
    s.start_node(b.stage, b.port, ["--state-dir", str(b.state_dir)])


def kill_block(s: LocalSwarm, b: Block) -> None:
    """SIGKILL ``b``'s process and forget it; keep its log under another name."""
    name = f"stage{b.stage}-{b.port}"
    entry = next(e for e in s.procs if e[0] == name)
    _, proc, log = entry
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    log.close()
    s.procs.remove(entry)
    b.kills += 1
    (s.log_dir / f"{name}.log").rename(s.log_dir / f"{name}.kill{b.kills}.log")


def try_status(address: str) -> dict[str, Any] | None:
    try:
        return fetch_status(address, timeout_s=3.0)
    except ValueError:
        return None


def longest_stall(samples: list[tuple[float, int]]) -> float:
    """Longest time between two increases of the sampled value (or the end of sampling)."""
    worst, since, last = 0.0, samples[0][0], samples[0][1]
    for t, value in samples[1:]:
        if value > last:
            worst, since, last = max(worst, t - since), t, value
    return max(worst, samples[-1][0] - since)


def test_random_sigkills_and_restarts_never_stall_or_lose_microbatches(tmp_path: Path) -> None:
    s = LocalSwarm(tmp_path, SETTINGS)
    rng = random.Random(SEED)
    try:
        heads = [s.start_node(0) for _ in range(HEADS)]
        blocks = [
            Block(stage, free_port(), tmp_path / f"state-{i}") for i, stage in enumerate(BLOCK_PLAN)
        ]
        for b in blocks:
            start_block(s, b)
        for address in [*heads, *(b.address for b in blocks)]:
            wait_ready(address, 150, s)
        for b in blocks:
            b.peer_id = fetch_status(b.address)["peer_id"]
            b.up_since = time.monotonic()
            assert (b.state_dir / IDENTITY_FILE).is_file()
        for h in heads:
            wait_for(lambda h=h: fetch_status(h)["step"] >= 2, 120, f"head {h} training")

        samples: dict[str, list[tuple[float, int]]] = {h: [] for h in heads}
        restarted_at: dict[int, float] = {}
        num_kills = 0
        t0 = time.monotonic()
        next_kill = t0 + rng.uniform(*KILL_EVERY_S)
        while time.monotonic() - t0 < CHAOS_S:
            now = time.monotonic()
            assert not s.dead(), f"process(es) died: {s.dead()}"
            for h in heads:
                st = try_status(h)
                if st is not None:
                    samples[h].append((now, st["step"]))
            for i, b in enumerate(blocks):  # restarted nodes: back, and the same peer?
                if b.up_since is None and (st := try_status(b.address)) and st["ready"]:
                    assert st["peer_id"] == b.peer_id, (b, st["peer_id"])
                    b.up_since = now
                    b.restarts_s.append(now - restarted_at[i])
            if now >= next_kill:
                # never the last ready replica: its sibling must have been up for a heartbeat
                eligible = [
                    b
                    for b in blocks
                    if b.up_since is not None
                    and all(
                        o.up_since is not None and now - o.up_since > 1.5
                        for o in blocks
                        if o.stage == b.stage and o is not b
                    )
                ]
                if eligible:
                    victim = rng.choice(eligible)
                    kill_block(s, victim)
                    num_kills += 1
                    victim.up_since = None
                    start_block(s, victim)
                    restarted_at[blocks.index(victim)] = time.monotonic()
                next_kill = now + rng.uniform(*KILL_EVERY_S)
            time.sleep(max(0.0, 1.0 - (time.monotonic() - now)))

        # The killer stops; every victim comes back as itself and work in flight drains.
        for i, b in enumerate(blocks):
            st = wait_ready(b.address, 120, s)
            assert st["peer_id"] == b.peer_id
            if b.up_since is None:
                b.restarts_s.append(time.monotonic() - restarted_at[i])
        stage_of = {b.peer_id: b.stage for b in blocks} | {
            fetch_status(h)["peer_id"]: 0 for h in heads
        }
        ring = Neighbourhood(len(set(BLOCK_PLAN)) + 1)  # tables hold a stage and its neighbours

        def one_swarm_again() -> bool:  # every table lists the peers it holds, no ghosts
            for address in [*heads, *(b.address for b in blocks)]:
                st = fetch_status(address)
                listed = {p["peer_id"] for ps in st["peers"].values() for p in ps}
                due = {p for p, s in stage_of.items() if ring.covers(st["stage"], s)}
                if listed != due - {st["peer_id"]}:
                    return False
            return True

        wait_for(one_swarm_again, 60, "every node to list exactly the peers of its neighbourhood")
        done_before = {h: fetch_status(h)["counters"]["microbatches_completed"] for h in heads}
        for h in heads:
            wait_for(
                lambda h=h: (
                    fetch_status(h)["counters"]["microbatches_completed"] >= done_before[h] + 8
                ),
                60,
                f"head {h} training after the chaos",
            )
        assert not s.dead(), f"process(es) died: {s.dead()}"

        report = []
        for h in heads:
            st = fetch_status(h)
            c = st["counters"]
            issued, ended = accounted(c, st["pending"])
            stall = longest_stall(samples[h])
            lost = c.get("microbatches_retried", 0) + c.get("microbatches_dropped", 0)
            report.append(
                f"head {h}: longest stall {stall:.1f}s, issued {issued} = completed "
                f"{c.get('microbatches_completed', 0)} + retried {c.get('microbatches_retried', 0)}"
                f" + dropped {c.get('microbatches_dropped', 0)} + pending {st['pending']}"
            )
            # issued == completed + retried + dropped + pending holds in every status snapshot
            assert issued == ended, report[-1]
            assert stall < MAX_STALL_S, report[-1]
            # a kill loses at most what was in flight through the victim (<= max_in_flight)
            assert lost <= num_kills * MAX_IN_FLIGHT, (report[-1], num_kills)
        restarts = [round(t, 1) for b in blocks for t in b.restarts_s]
        print(
            f"\n{num_kills} kills in {CHAOS_S:.0f}s; restart-to-ready times {restarts}s\n"
            + "\n".join(report)
        )
        assert num_kills >= CHAOS_S / (2 * KILL_EVERY_S[1]), num_kills
    finally:
        codes = s.stop(grace_s=15)
    assert all(code == 0 for code in codes.values()), codes
