"""Real hosts on one machine: Linux network namespaces on a shared bridge, as a pytest fixture.

Owns: creating N "hosts" (a namespace each, with ``eth0`` on a private bridge, loopback up and a
224.0.0.0/4 route so multicast such as mDNS works), hosts behind a home router (``add_natted``:
a router namespace on the bridge that masquerades a private network, no port forwarding,
replies let back in by connection tracking), running processes inside them, partitions
(``cut``/``heal`` detach and reattach a host's veth; ``split``/``rejoin`` move a group of hosts
to a second bridge and back), and ALWAYS tearing all of it down: the processes started inside,
the namespaces, the bridges and the iptables rules. Names carry a random
suffix so parallel runs never collide. The recipe is ``shared/tools/netns-lab.sh``.
Does not own: what runs on the hosts, or latency (this kernel has no netem; ``cap_uplink``
caps a host's rate with tc tbf).

Not a test module. Use it from a test file or ``tests/conftest.py``::

    from tests.netns import netns_lab  # noqa: F401  (the fixture; it skips without root/netns)

    def test_x(netns_lab):
        lab = netns_lab(3)
        proc = lab.hosts[0].popen([sys.executable, "-c", "..."], stdout=subprocess.PIPE)
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

_CMD_TIMEOUT_S = 10.0
_TERM_GRACE_S = 3.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=check
    )


@functools.cache
def netns_available() -> tuple[bool, str]:
    """Whether namespaces on a bridge can be made here, and if not, why (a skip reason)."""
    if os.geteuid() != 0:
        return False, f"network namespaces need root (euid is {os.geteuid()})"
    if shutil.which("ip") is None:
        return False, "no `ip` binary (install iproute2)"
    probe = f"mmprobe{secrets.token_hex(3)}"
    try:
        for args, undo in (
            (("netns", "add", probe), ("netns", "del", probe)),
            (("link", "add", probe, "type", "bridge"), ("link", "del", probe)),
        ):
            done = _ip(*args, check=False)
            if done.returncode != 0:
                return False, f"`ip {' '.join(args)}` failed: {done.stderr.strip()}"
            _ip(*undo, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"`ip` does not work here: {exc}"
    return True, ""


def token_bucket(dev: str, rate_mbit: float, burst: str, queue_ms: int) -> list[str]:
    """The ``tc`` command that caps what ``dev`` sends at ``rate_mbit``, a bucket of
    ``burst`` and a queue of ``queue_ms`` (``tbf``: real packets queue and wait)."""
    cmd = ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit"]
    return cmd + ["burst", burst, "latency", f"{queue_ms}ms"]


@dataclass
class Host:
    """One namespace: ``name`` is the namespace, ``address`` its IPv4 address on ``eth0``."""

    name: str
    address: str
    veth: str  # the bridge-side end, in the root namespace
    _lab: Lab = field(repr=False)

    def popen(self, args: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``args`` inside this host; the lab kills it (and its group) at teardown."""
        kw.setdefault("start_new_session", True)
        proc: subprocess.Popen[Any] = subprocess.Popen(
            ["ip", "netns", "exec", self.name, *args], **kw
        )
        self._lab.procs.append(proc)
        return proc

    def run(self, args: Sequence[str], timeout: float = _CMD_TIMEOUT_S) -> str:
        """Run a short command inside this host to completion; its stdout (raises on failure)."""
        done = subprocess.run(
            ["ip", "netns", "exec", self.name, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        )
        return done.stdout

    def cap_uplink(self, rate_mbit: float) -> None:
        """Cap what this host sends at ``rate_mbit`` (a token bucket on its ``eth0``: real
        packets queue, as on a thin uplink)."""
        self.run(token_bucket("eth0", rate_mbit, "64kb", 200))


@dataclass
class Lab:
    """N hosts on one bridge, subnet ``10.A.B.0/24``, host i (0-based) at ``10.A.B.(i+1)``."""

    prefix: str
    bridge: str
    net: str = ""
    """The bridge's subnet, ``10.A.B``: host i at ``.(i+1)``, routers at ``.(200+k)``."""
    hosts: list[Host] = field(default_factory=list)
    natted: list[Host] = field(default_factory=list)
    """Private hosts, each behind its own router (``add_natted``)."""
    routers: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)
    iptables_rules: list[list[str]] = field(default_factory=list)
    split_bridge: str | None = None  # made by split(): the second side of a partition
    neigh_limits: dict[str, str] = field(default_factory=dict)
    """The kernel's ARP table limits before ``create`` raised them (restored by ``close``)."""
    closed: bool = False

    @classmethod
    def create(cls, n: int) -> Lab:
        """Make the bridge and ``n`` hosts; on any failure, remove what was made and raise."""
        if not 1 <= n <= 250:
            raise ValueError(f"a lab has 1..250 hosts, not {n}")
        prefix = f"mm{secrets.token_hex(3)}"  # 8 chars: "v" + prefix + index <= 15
        net = f"10.{20 + secrets.randbelow(200)}.{secrets.randbelow(256)}"
        lab = cls(prefix=prefix, bridge=f"{prefix}br", net=net)
        try:
            lab._room_for_neighbours(n)
            _ip("link", "add", lab.bridge, "type", "bridge", "mcast_snooping", "0")
            _ip("link", "set", lab.bridge, "up")
            lab._allow_forwarding(lab.bridge)
            for i in range(n):
                lab._add_host(i, f"{net}.{i + 1}")
        except BaseException:
            lab.close()
            raise
        return lab

    def _room_for_neighbours(self, n: int) -> None:
        """Raise the kernel's ARP table limits for ``n`` hosts that all talk to each other.
        The limits are global, not per namespace, and the default hard limit (1024 entries)
        overflows at about 32 hosts: the kernel then drops new neighbours ("neighbor table
        overflow") and hosts stop reaching each other at random."""
        need = 2 * n * n + 1024
        for level, share in (("gc_thresh1", 4), ("gc_thresh2", 2), ("gc_thresh3", 1)):
            path = Path(f"/proc/sys/net/ipv4/neigh/default/{level}")
            try:
                old = path.read_text().strip()
                if int(old) < need // share:
                    path.write_text(str(need // share))
                    self.neigh_limits[level] = old
            except (OSError, ValueError):
                return  # not ours to change: small labs still fit

    def _allow_forwarding(self, bridge: str) -> None:
        # Bridged frames traverse iptables FORWARD when br_netfilter is loaded, and Docker sets
        # that chain's policy to DROP: accept our own bridge explicitly.
        if shutil.which("iptables") is None:
            return
        rule = ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]
        done = subprocess.run(
            ["iptables", "-I", *rule], capture_output=True, timeout=_CMD_TIMEOUT_S, check=False
        )
        if done.returncode == 0:
            self.iptables_rules.append(rule)

    def _add_host(self, i: int, address: str) -> None:
        ns, veth = f"{self.prefix}{i + 1}", f"v{self.prefix}{i + 1}"
        _ip("netns", "add", ns)
        self.hosts.append(Host(name=ns, address=address, veth=veth, _lab=self))  # close() sees it
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", "eth0")  # multicast (mDNS) out eth0

    def add_natted(self) -> Host:
        """A host behind its own home router: the router is a namespace on the bridge (at
        ``10.A.B.(200+k)``) that masquerades the private network ``192.168.k.0/24`` behind it,
        forwards nothing inwards and lets replies back by connection tracking. The host (at
        ``192.168.k.2``, default route via the router) dials out to anyone; nobody dials in.
        Returns the private host."""
        k = len(self.routers) + 1
        router, private = f"{self.prefix}r{k}", f"{self.prefix}p{k}"
        wan = f"v{self.prefix}r{k}"
        lan_net = f"192.168.{k}"
        _ip("netns", "add", router)
        self.routers.append(router)  # close() removes it whatever happens next
        _ip("link", "add", wan, "type", "veth", "peer", "name", "wan", "netns", router)
        _ip("link", "set", wan, "master", self.bridge)
        _ip("link", "set", wan, "up")
        _ip("-n", router, "addr", "add", f"{self.net}.{200 + k}/24", "dev", "wan")
        _ip("-n", router, "link", "set", "wan", "up")
        _ip("-n", router, "link", "set", "lo", "up")
        _ip("netns", "add", private)
        host = Host(name=private, address=f"{lan_net}.2", veth="", _lab=self)
        self.natted.append(host)
        _ip(
            "-n",
            router,
            "link",
            "add",
            "lan",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            private,
        )
        _ip("-n", router, "addr", "add", f"{lan_net}.1/24", "dev", "lan")
        _ip("-n", router, "link", "set", "lan", "up")
        _ip("-n", private, "addr", "add", f"{lan_net}.2/24", "dev", "eth0")
        _ip("-n", private, "link", "set", "eth0", "up")
        _ip("-n", private, "link", "set", "lo", "up")
        _ip("-n", private, "route", "add", "default", "via", f"{lan_net}.1")
        inside = ["ip", "netns", "exec", router]
        for cmd in (
            ["sysctl", "-qw", "net.ipv4.ip_forward=1"],
            [
                "iptables",
                "-t",
                "nat",
                "-A",
                "POSTROUTING",
                "-s",
                f"{lan_net}.0/24",
                "-o",
                "wan",
                "-j",
                "MASQUERADE",
            ],
            ["iptables", "-P", "FORWARD", "DROP"],
            ["iptables", "-A", "FORWARD", "-i", "lan", "-o", "wan", "-j", "ACCEPT"],
            [
                "iptables",
                "-A",
                "FORWARD",
                "-i",
                "wan",
                "-o",
                "lan",
                "-m",
                "conntrack",
                "--ctstate",
                "ESTABLISHED,RELATED",
                "-j",
                "ACCEPT",
            ],
        ):
            subprocess.run([*inside, *cmd], check=True, capture_output=True, timeout=_CMD_TIMEOUT_S)
        return host

    def cap_router_uplink(
        self, router: str, rate_mbit: float, queue_ms: int, burst: str = "10kb"
    ) -> None:
        """Cap what ``router`` (``add_natted``'s) sends out on its WAN side at ``rate_mbit``,
        with a queue of ``queue_ms``: a home router's thin uplink and deep queue. The queue
        is the router's, as at home (on the sender's own interface TCP Small Queues would
        keep it short). ``burst`` is the bucket's size, which also bounds the packets it
        splits: larger, the sender's 64 kB offload packets would pass whole, 52 ms each at
        10 Mbit/s, as no real uplink sends them."""
        subprocess.run(
            ["ip", "netns", "exec", router, *token_bucket("wan", rate_mbit, burst, queue_ms)],
            check=True,
            capture_output=True,
            timeout=_CMD_TIMEOUT_S,
        )

    def reach_from_root(self) -> None:
        """Give the root namespace an address on the bridge (``10.A.B.254``), so that this
        process reaches the hosts directly (polling their ``/status``, say)."""
        _ip("addr", "add", f"{self.net}.254/24", "dev", self.bridge)

    def cut(self, i: int) -> None:
        """Partition host ``i`` (0-based): detach its veth from the bridge."""
        _ip("link", "set", self.hosts[i].veth, "nomaster")

    def heal(self, i: int) -> None:
        """Reattach host ``i`` (0-based) to the bridge."""
        _ip("link", "set", self.hosts[i].veth, "master", self.bridge)

    def split(self, group: Sequence[int]) -> None:
        """Partition the lab in two: the hosts in ``group`` (0-based) move to a second bridge,
        so they still reach each other but no longer the rest. ``rejoin`` heals it."""
        if self.split_bridge is None:
            self.split_bridge = f"{self.prefix}b2"
            _ip("link", "add", self.split_bridge, "type", "bridge", "mcast_snooping", "0")
            _ip("link", "set", self.split_bridge, "up")
            self._allow_forwarding(self.split_bridge)
        for i in group:
            _ip("link", "set", self.hosts[i].veth, "master", self.split_bridge)

    def rejoin(self) -> None:
        """Heal a ``split``: every host back on the one bridge."""
        for host in self.hosts:
            _ip("link", "set", host.veth, "master", self.bridge)

    def close(self) -> None:
        """Kill everything started inside, then remove namespaces, rule and bridge. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for proc in self.procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + _TERM_GRACE_S
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            _signal_group(proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=_TERM_GRACE_S)
        for host in self.hosts:
            _kill_namespace_pids(host.name)  # anything else still living in the namespace
            _ip("netns", "del", host.name, check=False)
            _ip("link", "del", host.veth, check=False)  # normally gone with the namespace
        for name in [h.name for h in self.natted] + self.routers:
            _kill_namespace_pids(name)
            _ip("netns", "del", name, check=False)  # the router's veths go with it
        for rule in self.iptables_rules:
            subprocess.run(
                ["iptables", "-D", *rule],
                capture_output=True,
                timeout=_CMD_TIMEOUT_S,
                check=False,
            )
        if self.split_bridge is not None:
            _ip("link", "del", self.split_bridge, check=False)
        _ip("link", "del", self.bridge, check=False)
        for level, old in self.neigh_limits.items():
            with contextlib.suppress(OSError):
                Path(f"/proc/sys/net/ipv4/neigh/default/{level}").write_text(old)

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _signal_group(proc: subprocess.Popen[Any], sig: signal.Signals) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)  # popen() starts a new session: pgid == pid
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


def _kill_namespace_pids(ns: str) -> None:
    listed = _ip("netns", "pids", ns, check=False)
    for word in listed.stdout.split():
        with contextlib.suppress(ValueError, ProcessLookupError):
            os.kill(int(word), signal.SIGKILL)
    for _ in range(50):  # a killed process leaves the namespace once it is reaped
        if not _ip("netns", "pids", ns, check=False).stdout.strip():
            return
        time.sleep(0.05)


@pytest.fixture
def netns_lab() -> Iterator[Callable[[int], Lab]]:
    """Factory ``make(n) -> Lab``; every lab it made is closed after the test, pass or fail.

    Skips the test, with the reason, where namespaces cannot be made.
    """
    ok, reason = netns_available()
    if not ok:
        pytest.skip(reason)
    labs: list[Lab] = []

    def make(n: int) -> Lab:
        lab = Lab.create(n)
        labs.append(lab)
        return lab

    try:
        yield make
    finally:
        for lab in reversed(labs):
            lab.close()
