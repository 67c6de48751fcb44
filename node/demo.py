"""``node demo``: a real local swarm on loopback, trained for a fixed budget.

Starts real ``node join`` processes (by default one head stage and three block stages),
each on its own port of 127.0.0.1 with the first node as bootstrap (zeroconf off, so the
demo never touches the LAN), prints live progress from the head node's status, asks it for
a final evaluation when the budget is spent, stops every process it started (SIGTERM, then
SIGKILL after a grace period), and prints a summary. ``--json`` puts the summary on the last
line as one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, ClassVar, Protocol

from node.client import fetch_status, operator_auth, request_eval
from node.config import parse_sets
from protocol.auth import SwarmAuth

DEMO_SETTINGS = {
    "node.join_wait_s": "1.0",
    "train.eval_interval_s": "30",
}


def _ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections (32768 if unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_handed_out: set[int] = set()
"""Ports ``free_port`` gave this process: none is given twice (see there)."""


def free_port() -> int:
    """A port of 127.0.0.1 that nothing holds now, for a node to listen on in a moment.

    Drawn below the kernel's ephemeral range: a port from ``bind(0)`` is an ephemeral one,
    and in the moment before the node binds it another process's outgoing connection can be
    given the same port (a busy swarm on loopback opens many), so the node would exit with
    "address in use". Falls back to ``bind(0)`` where that range starts too low. Never the
    same port twice in one process: a swarm draws all its ports before its nodes bind them,
    and two draws of one port (about 1 in 1,100 for seven nodes) left one node unable to
    start."""
    low = _ephemeral_low()
    drawn = (random.randrange(10000, low) for _ in range(64 if low > 12000 else 0))
    for want in itertools.chain(drawn, [0] * 64):  # 0: the kernel's choice, the fallback
        if want in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", want))
            except OSError:
                continue
            port: int = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise OSError("no free port of 127.0.0.1 found in 128 tries")


class Host(Protocol):
    """Somewhere else to run a node: an address of its own and a way to start a process
    there (``tests.netns.Host``, a network namespace)."""

    name: str
    address: str

    def popen(self, args: Sequence[str], **kw: Any) -> subprocess.Popen[Any]: ...


class LocalSwarm:
    """Real ``node join`` processes on loopback (or on given hosts), reaped on exit."""

    running: ClassVar[set[LocalSwarm]] = set()
    """Swarms of this process with nodes started and not stopped yet (``stop_all``)."""

    def __init__(self, log_dir: Path, settings: dict[str, str], config: str | None = None) -> None:
        self.log_dir = log_dir
        self.settings = settings
        self.config = config
        self.swarm = f"demo-{secrets.token_hex(3)}"
        self.procs: list[tuple[str, subprocess.Popen[bytes], IO[bytes]]] = []
        self.addresses: list[str] = []

    def start_node(
        self,
        stage: int | str,
        port: int = 0,
        extra: list[str] | None = None,
        host: Host | None = None,
        env: dict[str, str] | None = None,
    ) -> str:
        """Start a node of ``stage`` listening on ``port`` (a free one if 0) of 127.0.0.1, or
        of ``host`` when given; every node after the first bootstraps from the first.
        ``env``: variables added to its environment (libfaketime's, for a wrong clock)."""
        port = port or free_port()
        address = f"{host.address if host else '127.0.0.1'}:{port}"
        cmd = [sys.executable, "-m", "node", "join", "--stage", str(stage)]
        cmd += ["--listen", address, "--swarm", self.swarm, "--no-zeroconf"]
        if self.addresses:
            cmd += ["--bootstrap", self.addresses[0]]
        if self.config:
            cmd += ["--config", self.config]
        for key, value in self.settings.items():
            cmd += ["--set", f"{key}={value}"]
        cmd += extra or []
        name = f"stage{stage}-{host.name if host else port}"
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        launch = host.popen if host else subprocess.Popen
        proc = launch(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **env} if env else None,
        )
        self.procs.append((name, proc, log))
        self.addresses.append(address)
        LocalSwarm.running.add(self)
        return address

    def dead(self) -> list[str]:
        return [name for name, proc, _ in self.procs if proc.poll() is not None]

    def log_path(self, address: str) -> Path:
        """The log file of the node started to listen on ``address``."""
        name = self.procs[self.addresses.index(address)][0]
        return self.log_dir / f"{name}.log"

    def log_tail(self, name: str, lines: int = 15) -> str:
        text = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def dead_report(self, what: str) -> str:
        """``what`` with the names of the exited nodes and the end of each one's log."""
        dead = self.dead()
        tails = "".join(f"\n--- {name} log ---\n{self.log_tail(name)}" for name in dead)
        return f"{what}: {dead}{tails}"

    def stop(self, grace_s: float = 10.0) -> dict[str, int | None]:
        """SIGTERM everyone, wait, SIGKILL stragglers; returns each exit code."""
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        codes: dict[str, int | None] = {}
        for name, proc, log in self.procs:
            try:
                codes[name] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                codes[name] = None
            log.close()
        LocalSwarm.running.discard(self)
        return codes

    @classmethod
    def stop_all(cls, grace_s: float = 2.0) -> list[str]:
        """Stop every swarm still running; returns the names of their nodes. For
        the tests' teardown: a test that fails while its swarm starts (before its ``try``)
        would otherwise leave the nodes training, and slow every later test (one such leak
        made a full run of the suite take 60 minutes instead of 43)."""
        names = [name for swarm in cls.running for name, proc, _ in swarm.procs]
        for swarm in list(cls.running):
            swarm.stop(grace_s)
        return names


def wait_ready(address: str, timeout_s: float, swarm: LocalSwarm) -> dict[str, Any]:
    """Poll a node until it answers /status and is ready (or a process died)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if swarm.dead():
            raise RuntimeError(swarm.dead_report("node(s) exited during start-up"))
        try:
            st = fetch_status(address, timeout_s=2.0)
            if st["ready"]:
                return st
        except ValueError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"node {address} not ready after {timeout_s:.0f}s")


def run_demo(args: argparse.Namespace) -> int:
    settings = {
        **DEMO_SETTINGS,
        "swarm.num_block_stages": str(args.block_stages),
        **parse_sets(args.set),
    }
    log_dir = Path(args.logs or tempfile.mkdtemp(prefix="murmuration-demo-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    swarm = LocalSwarm(log_dir, settings, args.config)
    auth = operator_auth(args.config, settings)
    say = print if not args.json else (lambda *a, **k: print(*a, **k, file=sys.stderr))
    t_start = time.monotonic()
    port = args.port
    plan = [0] * args.heads + [
        s for s in range(1, args.block_stages + 1) for _ in range(args.replicas)
    ]
    say(
        f"starting {len(plan)} nodes ({args.heads} head, {args.block_stages} block stages x {args.replicas}); logs in {log_dir}"
    )
    summary: dict[str, Any] = {}
    try:
        for i, stage in enumerate(plan):
            swarm.start_node(stage, port + i if port else 0)
        head = swarm.addresses[0]
        for address in swarm.addresses:
            wait_ready(address, 120.0, swarm)
        say(f"all nodes ready; training. The swarm's page: http://{head}/")
        summary = train_for(head, swarm, args.budget_s, say, auth)
    except (RuntimeError, TimeoutError) as e:
        say(f"demo failed: {e}")
        swarm.stop()
        return 1
    except KeyboardInterrupt:
        say("interrupted; stopping the swarm")
        swarm.stop()
        return 130
    codes = swarm.stop()
    summary.update(
        num_nodes=len(plan),
        seconds=round(time.monotonic() - t_start, 1),
        exit_codes=codes,
        logs=str(log_dir),
    )
    say(
        f"\neval loss {summary['initial_eval_loss']:.3f} -> {summary['final_eval_loss']:.3f}  "
        f"({summary['tokens']} tokens, {summary['tokens_per_s']:.0f} tokens/s, {summary['num_nodes']} nodes, "
        f"{summary['seconds']:.0f}s wall)"
    )
    if args.json:
        print(json.dumps(summary))
    return 0


def train_for(
    head: str, swarm: LocalSwarm, budget_s: float, say: Any, auth: SwarmAuth | None = None
) -> dict[str, Any]:
    """Watch the head node until its training time reaches the budget; then evaluate."""
    last_print = 0.0
    st = fetch_status(head)
    while st.get("train_s", 0.0) < budget_s:
        if swarm.dead():
            raise RuntimeError(swarm.dead_report("node(s) died"))
        time.sleep(1.0)
        st = fetch_status(head)
        if time.monotonic() - last_print >= 5.0:
            last_print = time.monotonic()
            nodes = sum(s["replicas"] for s in st["stages"].values())  # itself included
            loss = "-" if st.get("loss_ema") is None else f"{st['loss_ema']:.3f}"
            ev = "-" if st.get("eval_loss") is None else f"{st['eval_loss']:.3f}"
            say(
                f"[{st['train_s']:6.0f}s] step {st['step']:5d}  loss {loss}  eval {ev}  "
                f"{st['tokens_per_s']:7.0f} tok/s  nodes {nodes}  "
                f"done {st['counters'].get('microbatches_completed', 0)} "
                f"retried {st['counters'].get('microbatches_retried', 0)}"
            )
    final = request_eval(head, auth=auth)
    st = fetch_status(head)
    evals = st["evals"]
    return {
        "initial_eval_loss": evals[0]["loss"],
        "final_eval_loss": final,
        "tokens": st["tokens"],
        "tokens_per_s": round(st["tokens"] / max(1e-6, st["train_s"]), 1),
        "train_s": st["train_s"],
        "steps": st["step"],
        "evals": evals,
        "counters": st["counters"],
    }
