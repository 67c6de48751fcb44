"""What membership costs as the swarm grows: the real membership code on the simulated
network (``swarm.simnet``), in virtual time, at several swarm sizes.

Per size ``n`` (8 stages, nodes spread evenly, 20 ms one way between any two):

- **steady**: a swarm that has joined (every table full, as after the join), each node's
  figures changing every second (its step), so it republishes them every ``refresh_s``.
  After a warm-up, the bytes each node sends and receives per second (frames as the
  project's codec encodes them, plus ``HTTP_OVERHEAD_BYTES`` per exchange), mean and the
  busiest node.
- **churn**: 1 % of the nodes replaced per minute (a random node vanishes without a word; a
  new one joins through a random member; at least 5 times, over ``--churn-s`` or longer at
  small sizes, where 1 % a minute is one node a minute or less): the same bytes, and per
  event the seconds until
  a join is in every table of its neighbour stages (its own, the two next to it, and the
  head stage 0) and until a death has left every table.

Two kinds of table (``--tables``): ``swarm``, every node holding every other (8 stages),
and ``neighbourhood``, every node holding only its own stage and the two next to it, with
summaries of the rest (``swarm.peers.Neighbourhood``; ``--stage-size`` replicas per stage,
so the stages grow in number with the swarm, at least 8). With neighbourhoods, "every table"
above means every table that holds the peer, and the rows also give how old each node's
summaries of the stages it does not hold are, and whether they count the stage's replicas
right.

Writes ``bench/results/membership.json`` (rows under ``simulated``, each with its
``tables``; a run replaces the rows of its own sizes and kind and keeps the others; ``real``
stays a list for measurements from real processes) and ``membership.png``.

Usage: ``python -m bench.membership [--sizes 100,1000,3000] [--tables swarm|neighbourhood]
[--stage-size 125] [--steady-s 30] [--churn-s 60]``; ``--quick`` for the test's small
version.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from protocol.messages import PeerRecord
from swarm.membership import MembershipConfig, MembershipService
from swarm.peers import Neighbourhood, PeerTable
from swarm.simnet import HTTP_OVERHEAD_BYTES, SimClock, SimNet

RESULTS = Path(__file__).parent / "results"
STAGES = 8
TARGET_BITS_PER_S = 50_000
JOIN_TARGET_S = 5.0
DEATH_MARGIN_S = 5.0


def say(text: str) -> None:
    print(f"[membership {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


class SimSwarm:
    def __init__(
        self,
        config: MembershipConfig,
        seed: int,
        latency_s: float,
        idle: bool = False,
        stages: int = STAGES,
        scope: Neighbourhood | None = None,
        first_stage: int = 0,
    ) -> None:
        self.config = config
        self.stages = stages
        self.first_stage = first_stage
        """Nodes take stages ``first_stage..stages-1`` in turn (1: no head, as the real run)."""
        self.scope = scope
        """Tables hold these neighbourhoods (None: the whole swarm)."""
        self.idle = idle
        """Figures that never change (as an idle daemon's): nothing to republish."""
        self.clock = SimClock()
        self.net = SimNet(self.clock, latency_s)
        self.rng = random.Random(seed)
        self.nodes: dict[str, MembershipService] = {}  # address -> service
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.next_id = 0

    def new(self) -> MembershipService:
        i = self.next_id
        self.next_id += 1
        address = f"10.{i // 65536}.{i // 256 % 256}.{i % 256}:7070"
        stage = self.first_stage + i % (self.stages - self.first_stage)
        base = PeerRecord(peer_id=f"{i:016x}", address=address, stage=stage, ready=True)
        clock = self.clock
        table = PeerTable(base.peer_id, self.config.ttl_s, self.config.max_peers, scope=self.scope)
        svc = MembershipService(
            self.config,
            swarm="bench",
            fingerprint="f",
            table=table,
            transport=self.net.transport(address),
            clock=clock,
            self_record=(lambda: base)
            if self.idle
            else lambda: replace(base, step=int(clock.now())),
            rng=random.Random(self.rng.random()),
        )
        self.net.nodes[address] = svc
        self.nodes[address] = svc
        return svc

    def start(self, svc: MembershipService) -> None:
        self.tasks[svc.self_record().address] = asyncio.ensure_future(svc.run())

    def kill(self, svc: MembershipService) -> None:
        address = svc.self_record().address
        self.tasks.pop(address).cancel()
        del self.net.nodes[address], self.nodes[address]

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    def by_id(self, peer_id: str) -> MembershipService:
        return next(s for s in self.nodes.values() if s.table.self_id == peer_id)

    def bytes_now(self) -> dict[str, tuple[int, int]]:
        """Per live node: bytes in and out, and of them what HTTP adds."""
        net = self.net
        return {a: (net.sent[a] + net.received[a], net.overhead[a]) for a in self.nodes}


def formed(sw: SimSwarm, n: int) -> SimSwarm:
    """``sw`` with ``n`` nodes whose tables already hold everyone they hold (what joining
    ends in)."""
    nodes = [sw.new() for _ in range(n)]
    by_stage: dict[int, list[PeerRecord]] = {}
    for node in nodes:
        record = node.own()
        by_stage.setdefault(record.stage, []).append(record)
    for node in nodes:
        for stage, records in by_stage.items():
            if node.table.covers(stage):
                for record in records:
                    node.table.observe(record, sw.clock.now())
    for node in nodes:  # a swarm that has run a while: refreshes out of step
        node.out_of_step(sw.rng.random())
    return sw


def rate(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], seconds: float
) -> dict[str, float]:
    """Bytes per node per second between two counts, over the nodes live at both."""
    both = [a for a in after if a in before]
    total = [(after[a][0] - before[a][0]) / seconds for a in both]
    frames = [(after[a][0] - after[a][1] - before[a][0] + before[a][1]) / seconds for a in both]
    return {
        "bytes_per_node_per_s": round(statistics.fmean(total), 1),
        "bytes_per_node_per_s_max": round(max(total), 1),
        "kbit_per_node_per_s": round(statistics.fmean(total) * 8 / 1000, 2),
        "frame_bytes_per_node_per_s": round(statistics.fmean(frames), 1),
    }


def summaries_checked(sw: SimSwarm, sample: int = 50) -> dict[str, Any]:
    """How old ``sample`` nodes' summaries of the stages they do not hold are, and how many
    of them count the stage's live replicas wrong (a summary is as of its age: under churn
    some are out of date by a replica)."""
    truth: dict[int, int] = {}
    for svc in sw.nodes.values():
        truth[svc.table.stage] = truth.get(svc.table.stage, 0) + 1
    ages: list[float] = []
    wrong = missing = 0
    for svc in sw.rng.sample(list(sw.nodes.values()), min(sample, len(sw.nodes))):
        known = svc.summaries()
        for stage in range(sw.stages):
            if svc.table.covers(stage):
                continue
            summary = known.get(stage)
            if summary is None:
                missing += 1
                continue
            ages.append(summary.age_s)
            wrong += summary.replicas != truth.get(stage, 0)
    return {
        "summary_age_s_median": round(statistics.median(ages), 1) if ages else None,
        "summary_age_s_max": round(max(ages), 1) if ages else None,
        "summaries_missing": missing,
        "summaries_miscounted": wrong,
        "summaries_checked": len(ages),
    }


async def measure(
    n: int,
    steady_s: float,
    churn_s: float,
    seed: int,
    latency_s: float,
    idle: bool = False,
    stage_size: int = 0,
    real_stages: int = 0,
    real_tables: str = "",
) -> dict[str, Any]:
    """One size's steady and churn figures (steady only with ``churn_s`` 0); with
    ``stage_size``, tables hold neighbourhoods of stages of about that many replicas; with
    ``real_stages``, the real run's layout: that many stages, nodes on all but the head's,
    and tables of the kind ``real_tables``."""
    config = MembershipConfig(max_peers=max(16384, 2 * n))
    stages = real_stages or (max(STAGES, n // stage_size) if stage_size else STAGES)
    scoped = real_tables == "neighbourhood" if real_stages else bool(stage_size)
    scope = Neighbourhood(stages) if scoped else None
    first = 1 if real_stages else 0
    sw = formed(SimSwarm(config, seed, latency_s, idle, stages, scope, first), n)
    kind = {"tables": "neighbourhood" if scope else "whole swarm", "stages": stages}
    for svc in list(sw.nodes.values()):
        sw.start(svc)
    clock = sw.clock
    await clock.run_until(clock.t + 10.0)  # warm-up: rounds out of step, first refreshes
    before, t0 = sw.bytes_now(), clock.t
    await clock.run_until(t0 + steady_s)
    steady = rate(before, sw.bytes_now(), clock.t - t0)
    by_type = dict(sw.net.by_type)
    refresh_s = next(iter(sw.nodes.values())).refresh_s()
    table_size = statistics.fmean(len(svc.table) for svc in sw.nodes.values())
    say(
        f"n={n} ({kind['tables']}, {stages} stages): steady "
        f"{steady['kbit_per_node_per_s']:.1f} kbit/s per node, refresh_s {refresh_s:.0f}, "
        f"table {table_size:.0f}"
    )
    summaries = summaries_checked(sw) if scope else {}
    if summaries:
        say(f"n={n}: summaries {summaries}")

    if churn_s <= 0:
        await sw.close()
        return {"n": n, **kind, **steady, "refresh_s": round(refresh_s, 1), "idle": idle}

    # churn: a node vanishes and another joins every 60 / (0.01 n) seconds, 5 times at least
    every_s = 60.0 / max(1.0, 0.01 * n)
    churn_s = max(churn_s, 5 * every_s)
    joins: dict[str, tuple[float, int]] = {}  # peer id -> (joined at, stage)
    deaths: dict[str, float] = {}
    join_s: list[float] = []
    death_s: list[float] = []
    before, t0 = sw.bytes_now(), clock.t
    next_event = t0
    while clock.t < t0 + churn_s or joins or deaths:
        if clock.t >= next_event and clock.t < t0 + churn_s:
            next_event += every_s
            victim = sw.rng.choice(list(sw.nodes.values()))
            deaths[victim.table.self_id] = clock.t
            sw.kill(victim)
            newcomer = sw.new()
            newcomer.add_bootstrap([sw.rng.choice(list(sw.nodes)[:-1])])
            sw.start(newcomer)
            joins[newcomer.table.self_id] = (clock.t, newcomer.self_record().stage)
        await clock.run_until(clock.t + 0.1)
        live = list(sw.nodes.values())
        by_stage: dict[int, list[MembershipService]] = {}
        for svc in live:
            by_stage.setdefault(svc.table.stage, []).append(svc)
        for peer_id, (at, stage) in list(joins.items()):
            near = {stage, (stage - 1) % stages, (stage + 1) % stages}
            if not scope:
                near.add(0)  # and the head stage (neighbourhoods do not hold it)
            if all(
                peer_id in s.table
                for st in near
                for s in by_stage.get(st, [])
                if s.table.self_id != peer_id
            ):
                join_s.append(round(clock.t - at, 2))
                del joins[peer_id]
        for peer_id, at in list(deaths.items()):
            if not any(peer_id in s.table for s in live):
                death_s.append(round(clock.t - at, 2))
                del deaths[peer_id]
        if clock.t > t0 + churn_s + 120:
            for peer_id, at in deaths.items():
                for s in live:
                    if peer_id in s.table:
                        say(
                            f"{peer_id} dead at {at - t0:.1f} still held by {s.table.self_id} "
                            f"(age {s.table.age_s(peer_id, clock.t):.0f} s, missing since "
                            f"{s._missing.get(peer_id)}, news {peer_id in s._news})"
                        )
            for peer_id, (at, stage) in joins.items():
                unaware = [s.table.self_id for s in live if s.table.covers(stage)]
                unaware = [p for p in unaware if p != peer_id and peer_id not in sw.by_id(p).table]
                say(f"{peer_id} (stage {stage}) joined at {at - t0:.1f}, unknown to {unaware}")
            raise RuntimeError(f"n={n}: {len(joins)} joins, {len(deaths)} deaths unfinished")
    churn = rate(before, sw.bytes_now(), clock.t - t0)
    churn_by_type = {k: v - by_type.get(k, 0) for k, v in sorted(sw.net.by_type.items())}
    after_churn = summaries_checked(sw) if scope else {}
    if after_churn:
        say(f"n={n}: summaries after the churn {after_churn}")
    await sw.close()
    row = {
        "n": n,
        **kind,
        **steady,
        "refresh_s": round(refresh_s, 1),
        "table_size_mean": round(table_size, 1),
        **summaries,
        "steady_bytes_by_message": {k: v for k, v in sorted(by_type.items())},
        "churn": {
            **churn,
            "bytes_by_message": churn_by_type,
            "events": len(join_s),
            "join_visible_s_median": statistics.median(join_s) if join_s else None,
            "join_visible_s_max": max(join_s) if join_s else None,
            "death_gone_s_median": statistics.median(death_s) if death_s else None,
            "death_gone_s_max": max(death_s) if death_s else None,
            **after_churn,
        },
    }
    say(
        f"n={n}: churn {churn['kbit_per_node_per_s']:.1f} kbit/s per node, "
        f"join max {row['churn']['join_visible_s_max']} s, death max {row['churn']['death_gone_s_max']} s"
    )
    return row


MEMBERSHIP_KINDS = ("hello", "welcome", "ping", "pong", "probe", "leave")
REAL_STAGES = 7
"""The tiny model's 6 blocks, one a stage, and the head's (which the real run leaves empty)."""
NETNS_PORT, NETNS_METRICS_PORT = 7070, 9090
"""With ``--netns`` every daemon has an address of its own, so the same ports."""
REAL_BATCH = 8
"""Real daemons started at a time (each batch ready before the next)."""
REAL_SETTINGS = {
    "node.join_wait_s": "1.0",
    "swarm.num_block_stages": str(REAL_STAGES - 1),
    "train.eval_interval_s": "0",
    "balance.benchmark_s": "0",
    "balance.interval_s": "0",
}


def scrape(metrics_address: str) -> dict[str, float]:
    """Membership frame bytes (in + out) and requests sent, from a node's /metrics."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5).read()
    out = {"frame_bytes": 0.0, "requests": 0.0}
    for line in text.decode().splitlines():
        if not any(f'kind="{k}"' in line for k in MEMBERSHIP_KINDS):
            continue
        if line.startswith("murmur_wire_bytes_total{"):
            out["frame_bytes"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("murmur_requests_total{"):
            out["requests"] += float(line.rsplit(" ", 1)[1])
    return out


def measure_real(
    n: int, steady_s: float, events: int, latency_ms: float, tables: str, netns: bool = False
) -> dict[str, Any]:
    """``n`` real ``node join`` processes on loopback, or each in a network namespace of its
    own on one bridge (``netns``, ``tests/netns.py``), block stages only (no head, so no
    training), each adding ``latency_ms`` to what it sends, their tables of the kind
    ``tables``: the steady traffic from their /metrics, then ``events`` times a node killed
    (SIGKILL) and a new one started."""
    import os
    import signal
    import subprocess
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from node.client import fetch_status
    from node.demo import LocalSwarm, free_port, wait_ready

    settings = {**REAL_SETTINGS, "membership.tables": tables}
    ring = Neighbourhood(REAL_STAGES) if tables == "neighbourhood" else None

    def holds(stage: int, other: int) -> bool:
        return ring is None or ring.covers(stage, other)

    if latency_ms:
        settings["net.inject_latency_s"] = str(latency_ms / 1e3)
    log_dir = Path(tempfile.mkdtemp(prefix="murmuration-membership-"))
    swarm = LocalSwarm(log_dir, settings)
    metrics: dict[str, str] = {}  # address -> its /metrics' host:port
    stages: dict[str, int] = {}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    lab = None
    if netns:
        from tests.netns import Lab, netns_available

        ok, why = netns_available()
        if not ok:
            raise SystemExit(f"--netns needs network namespaces: {why}")
        lab = Lab.create(n + events)  # a host for each newcomer too
        lab.reach_from_root()  # to poll /status and /metrics from here
    free_hosts = iter(lab.hosts if lab else [])
    pool = ThreadPoolExecutor(16)

    def start(i: int) -> str:
        stage = 1 + i % (REAL_STAGES - 1)
        if lab is None:
            mport = free_port()  # never one handed out before
            extra = ["--set", f"net.metrics_port={mport}"]
            address = swarm.start_node(stage, port=free_port(), extra=extra)
            metrics[address] = f"127.0.0.1:{mport}"
        else:
            host = next(free_hosts)
            extra = ["--set", f"net.metrics_port={NETNS_METRICS_PORT}"]
            extra += ["--set", "net.metrics_host=0.0.0.0"]
            address = swarm.start_node(stage, port=NETNS_PORT, extra=extra, host=host)
            metrics[address] = f"{host.address}:{NETNS_METRICS_PORT}"
        procs[address] = swarm.procs[-1][1]
        stages[address] = stage
        return address

    def statuses(addresses: list[str]) -> dict[str, dict[str, Any]]:
        def one(a: str) -> dict[str, Any] | None:
            try:
                return fetch_status(a, timeout_s=5.0)
            except (OSError, ValueError):
                return None

        got = dict(zip(addresses, pool.map(one, addresses), strict=True))
        return {a: st for a, st in got.items() if st is not None}

    def knows(st: dict[str, Any], peer_id: str) -> bool:
        return any(p["peer_id"] == peer_id for ps in st["peers"].values() for p in ps)

    def quiet(addresses: list[str]) -> tuple[int, dict[str, int]]:
        """Burials so far over every node, and each node's incarnation (raised by each false
        alarm it answers; it starts from the clock, so only changes count)."""
        sts = statuses(addresses)
        buried = sum(st["membership"]["buried"] for st in sts.values())
        return buried, {a: st["membership"]["incarnation"] for a, st in sts.items()}

    try:
        # in batches, each ready before the next starts: 64 daemons importing torch at once
        # on two cores stall their event loops for seconds, and the probes that time out
        # meanwhile bury live nodes by the thousand (the same with the code before the
        # watcher); volunteers do not all start in one second
        live = []
        for first in range(0, n, REAL_BATCH):
            batch = [start(i) for i in range(first, min(n, first + REAL_BATCH))]
            for address in batch:
                wait_ready(address, 600.0, swarm)
            live += batch
        say(f"real n={n}: started, waiting for every table to hold everyone it should")
        deadline = time.monotonic() + 300
        incomplete = set(live)
        while incomplete:
            for address, st in statuses(sorted(incomplete)).items():
                due = sum(holds(stages[address], stages[a]) for a in live) - 1
                if sum(len(ps) for ps in st["peers"].values()) == due:
                    incomplete.discard(address)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{len(incomplete)} tables incomplete after 300 s; logs in {log_dir}"
                )
            time.sleep(1.0)
        # quiet: no burial or false alarm for 20 s (start-up may still cause some)
        settle_t0, last, still_since = time.monotonic(), quiet(live), time.monotonic()
        while time.monotonic() - still_since < 20.0 and time.monotonic() - settle_t0 < 300:
            time.sleep(2.0)
            now_ = quiet(live)
            if now_ != last:
                last, still_since = now_, time.monotonic()
        buried_at_start = last[0]
        say(
            f"real n={n}: {buried_at_start} burials before quiet ({time.monotonic() - settle_t0:.0f} s)"
        )
        time.sleep(10.0)  # joins spread, first refreshes
        before = dict(zip(live, pool.map(lambda a: scrape(metrics[a]), live), strict=True))
        t0 = time.monotonic()
        time.sleep(steady_s)
        after = dict(zip(live, pool.map(lambda a: scrape(metrics[a]), live), strict=True))
        elapsed = time.monotonic() - t0
        frames = [(after[a]["frame_bytes"] - before[a]["frame_bytes"]) / elapsed for a in live]
        requests = [(after[a]["requests"] - before[a]["requests"]) / elapsed for a in live]
        row: dict[str, Any] = {
            "n": n,
            "tables": "neighbourhood" if ring else "whole swarm",
            "stages": REAL_STAGES,
            "table_size_mean": round(
                statistics.fmean(
                    sum(len(ps) for ps in st["peers"].values()) for st in statuses(live).values()
                ),
                1,
            ),
            "frame_bytes_per_node_per_s": round(statistics.fmean(frames), 1),
            "frame_bytes_per_node_per_s_max": round(max(frames), 1),
            "requests_sent_per_node_per_s": round(statistics.fmean(requests), 2),
            "network": "a namespace each, one bridge" if lab else "loopback",
            "start_batch": REAL_BATCH,
            "buried_at_start": buried_at_start,
        }
        # a request and its reply, at both ends: the sim's overhead per exchange, twice
        row["bytes_per_node_per_s"] = round(
            row["frame_bytes_per_node_per_s"]
            + 2 * row["requests_sent_per_node_per_s"] * HTTP_OVERHEAD_BYTES,
            1,
        )
        say(f"real n={n}: steady {row['frame_bytes_per_node_per_s']:.0f} frame B/s per node")
        if ring is not None:  # summaries of the populated stages a node does not hold
            ages, missing = [], 0
            for address, st in statuses(live).items():
                for stage in range(1, REAL_STAGES):
                    if holds(stages[address], stage):
                        continue
                    known = st["stages"].get(str(stage))
                    if known is None:
                        missing += 1
                    else:
                        ages.append(known["age_s"])
            row["summary_age_s_median"] = round(statistics.median(ages), 1) if ages else None
            row["summary_age_s_max"] = round(max(ages), 1) if ages else None
            row["summaries_missing"], row["summaries_checked"] = missing, len(ages)
            say(f"real n={n}: far summaries {statistics.median(ages) if ages else None} s old")
        death_s, join_s = [], []
        rng = random.Random(0)
        for _ in range(events):
            victim = rng.choice(live[1:])
            victim_id = statuses([victim])[victim]["peer_id"]
            os.killpg(procs[victim].pid, signal.SIGKILL)
            killed_at = time.monotonic()
            live.remove(victim)
            while any(knows(st, victim_id) for st in statuses(live).values()):
                if time.monotonic() - killed_at > 120:
                    raise RuntimeError(f"{victim_id} still in a table after 120 s")
                time.sleep(0.25)
            death_s.append(round(time.monotonic() - killed_at, 2))
            newcomer = start(rng.randrange(n))
            while not statuses([newcomer]):
                time.sleep(0.1)
            said_at = time.monotonic()  # listening: it greets its bootstrap now
            new_id = statuses([newcomer])[newcomer]["peer_id"]
            stage = stages[newcomer]
            live.append(newcomer)
            while not all(
                knows(st, new_id)
                for a, st in statuses(live).items()
                if a != newcomer and holds(stage, stages[a])
            ):
                if time.monotonic() - said_at > 120:
                    raise RuntimeError(f"{new_id} not known to its neighbours after 120 s")
                time.sleep(0.25)
            join_s.append(round(time.monotonic() - said_at, 2))
            say(f"real n={n}: death gone in {death_s[-1]} s, join seen in {join_s[-1]} s")
        row["death_gone_s"] = death_s
        row["join_visible_s"] = join_s
        return row
    finally:
        swarm.stop()
        if lab is not None:
            lab.close()  # its processes, namespaces and bridge
        pool.shutdown()


def real_against_sim(
    n: int, steady_s: float, events: int, latency_ms: float, tables: str, netns: bool = False
) -> dict[str, Any]:
    """The real processes' figures beside the simulation's of the same idle swarm."""
    row = measure_real(n, steady_s, events, latency_ms, tables, netns)
    sim = asyncio.run(
        measure(
            n,
            steady_s,
            0.0,
            0,
            latency_ms / 1e3,
            idle=True,
            real_stages=REAL_STAGES,
            real_tables=tables,
        )
    )
    return {**row, "simulated_idle": sim}


def real_rows(earlier: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The real run's row with ``--real``, in place of an earlier one of the same size,
    tables and network (an earlier row without ``tables`` had whole ones, without
    ``network`` ran on loopback)."""
    if not args.real:
        return earlier
    row = real_against_sim(
        args.real, args.steady_s, args.events, args.latency_ms, args.tables, args.netns
    )

    def key(r: dict[str, Any]) -> tuple[int, str, str]:
        return r["n"], r.get("tables", "whole swarm"), r.get("network", "loopback")

    kept = [r for r in earlier if key(r) != key(row)]
    return [*kept, row]


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    kinds = sorted({r.get("tables", "whole swarm") for r in result["simulated"]})
    for kind in kinds:
        rows = [r for r in result["simulated"] if r.get("tables", "whole swarm") == kind]
        ns = [r["n"] for r in rows]
        ax1.plot(ns, [r["kbit_per_node_per_s"] for r in rows], "o-", label=f"{kind}: steady")
        churn = [r["churn"]["kbit_per_node_per_s"] for r in rows]
        ax1.plot(ns, churn, "s--", label=f"{kind}: 1 %/min churn")
        join = [r["churn"]["join_visible_s_max"] for r in rows]
        ax2.plot(ns, join, "o-", label=f"{kind}: join seen (max)")
        death = [r["churn"]["death_gone_s_max"] for r in rows]
        ax2.plot(ns, death, "s--", label=f"{kind}: death gone (max)")
    real = [r for r in result.get("real", []) if "bytes_per_node_per_s" in r]
    for extra, style, label in (
        (result.get("before", []), "x:", "before: whole tables"),
        (real, "D", "real processes (idle)"),
    ):
        if extra:
            kbit = [r["bytes_per_node_per_s"] * 8 / 1000 for r in extra]
            ax1.plot([r["n"] for r in extra], kbit, style, label=label)
    ax1.axhline(TARGET_BITS_PER_S / 1000, color="grey", ls="--", label="target 50 kbit/s")
    ax1.set(xscale="log", yscale="log", xlabel="nodes", ylabel="kbit/s per node (in + out)")
    ax1.set_title("membership traffic per node")
    ax1.legend()
    ttl = result["config"]["ttl_s"]
    ax2.axhline(JOIN_TARGET_S, color="C0", ls=":", label="join target")
    ax2.axhline(ttl + DEATH_MARGIN_S, color="C1", ls=":", label="death target")
    ax2.set(xscale="log", xlabel="nodes", ylabel="seconds")
    ax2.set_title("how fast news travels")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100,1000,3000")
    ap.add_argument("--tables", choices=("swarm", "neighbourhood"), default="neighbourhood")
    ap.add_argument(
        "--stage-size", type=int, default=125, help="replicas per stage (neighbourhood)"
    )
    ap.add_argument("--steady-s", type=float, default=30.0)
    ap.add_argument("--churn-s", type=float, default=60.0)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--real", type=int, default=0, help="also this many real processes")
    ap.add_argument(
        "--netns", action="store_true", help="each real process in a network namespace of its own"
    )
    ap.add_argument("--events", type=int, default=3, help="deaths and joins among them")
    ap.add_argument("--quick", action="store_true", help="sizes 20,60, a short churn")
    ap.add_argument("--out", type=Path, default=RESULTS / "membership.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.steady_s, args.churn_s = "20,60", 120.0, 30.0
    stage_size = args.stage_size if args.tables == "neighbourhood" else 0
    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        started = time.monotonic()
        rows.append(
            asyncio.run(
                measure(
                    n,
                    args.steady_s,
                    args.churn_s,
                    args.seed,
                    args.latency_ms / 1e3,
                    stage_size=stage_size,
                )
            )
        )
        rows[-1]["wall_s"] = round(time.monotonic() - started, 1)
    earlier: dict[str, Any] = {}
    if args.out.exists() and not args.quick:  # keep the other sizes' and kinds' rows
        earlier = json.loads(args.out.read_text())
        ours = {(r["n"], r["tables"]) for r in rows}
        kept = earlier.get("simulated", [])
        for row in kept:  # rows from before neighbourhoods were measured: whole tables
            row.setdefault("tables", "whole swarm")
            row.setdefault("stages", STAGES)
        rows = [r for r in kept if (r["n"], r["tables"]) not in ours] + rows
        rows.sort(key=lambda r: (r["tables"], r["n"]))
    config = MembershipConfig()
    result = {
        "config": {
            "heartbeat_s": config.heartbeat_s,
            "ttl_s": config.ttl_s,
            "fanout": config.fanout,
            "budget_bytes_per_s": config.budget_bytes_per_s,
            "stages": "8 (whole swarm); n / stage_size, at least 8 (neighbourhood)",
            "stage_size": args.stage_size,
            "latency_ms": args.latency_ms,
            "http_overhead_bytes": HTTP_OVERHEAD_BYTES,
            "steady_s": args.steady_s,
            "churn_s": args.churn_s,
        },
        "before": earlier.get("before", []),
        "notes": earlier.get("notes", {}),
        "simulated": rows,
        "real": real_rows(earlier.get("real", []), args),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    say(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
