"""LAN discovery over zeroconf (mDNS / DNS-SD), and the choice of which peer address to dial.

Owns: announcing this node as a ``_murmuration._tcp`` service, browsing for the other nodes of
the same swarm (same swarm name AND model fingerprint), resolving what they announce into
:class:`Sighting` objects, and the pure address-selection rules below.
Does not own: membership or expiry (a sighting is a hint, the peer table decides; removed
services are not reported), dialing, the bootstrap protocol, or configuration.

The multi-interface rule. A node may sit behind several interfaces (LAN, VPN, a Docker
bridge), and an address that one host can reach may mean nothing, or something else, to
another. So every node announces *all* its IPv4 addresses (:func:`announce_addresses`) and the
receiver picks (:func:`pick_address`): a candidate on one of the receiver's own subnets wins,
the most specific prefix first; then the first other routable candidate; then one equal to one
of the receiver's own addresses (that is "me": two hosts with the same Docker bridge address,
or a peer on this very host); then the first candidate (loopback, link-local). No rule is right everywhere,
which is why the daemon also records the address a peer really connects from and prefers it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ifaddr
from zeroconf import InterfaceChoice, IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

log = logging.getLogger(__name__)

SERVICE_TYPE = "_murmuration._tcp.local."
PROTO_VERSION = "1"  # TXT "proto": peers announcing another version are ignored
RESOLVE_TIMEOUT_S = 3.0  # one resolution (SRV, TXT, A) of a service we saw
REGISTER_TIMEOUT_S = 10.0  # probing and registering; zeroconf needs about 1 s
STOP_STEP_TIMEOUT_S = 3.0  # each shutdown step (browser, goodbye, close), so stop() never hangs
_MAX_LABEL_BYTES = 63
_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


@dataclass(frozen=True)
class Sighting:
    """One peer of our swarm seen on the LAN."""

    peer_id: str
    swarm: str
    fingerprint: str
    addresses: tuple[str, ...]
    """Every IPv4 address the peer announced, in its order."""
    port: int

    def best_address(self) -> str:
        """``host:port`` for the candidate :func:`pick_address` chooses from here."""
        return f"{pick_address(self.addresses)}:{self.port}"


def local_ipv4_networks() -> list[ipaddress.IPv4Interface]:
    """Every IPv4 address of this host with its prefix, loopback included (ifaddr order)."""
    return [
        ipaddress.IPv4Interface(f"{ip.ip}/{ip.network_prefix}")
        for adapter in ifaddr.get_adapters()
        for ip in adapter.ips
        if ip.is_IPv4
    ]


def _parse_ipv4(text: str) -> ipaddress.IPv4Address | None:
    try:
        return ipaddress.IPv4Address(text)
    except ValueError:
        return None  # a host name or IPv6: never on our subnets, still a usable fallback


def pick_address(
    candidates: Sequence[str], local: Sequence[ipaddress.IPv4Interface] | None = None
) -> str:
    """Choose the candidate address to dial (the rule is in the module docstring).

    ``local`` defaults to :func:`local_ipv4_networks`. Ties go to the earlier candidate.
    Raises ValueError when there are no candidates.
    """
    if not candidates:
        raise ValueError("pick_address needs at least one candidate address")
    nets = local_ipv4_networks() if local is None else list(local)
    own = {net.ip for net in nets}

    def rank(index: int) -> tuple[int, int, int]:  # (tier, prefix length, earlier first)
        addr = _parse_ipv4(candidates[index])
        if addr is None:
            return (3, 0, -index)
        if addr.is_loopback:  # the peer's loopback, never ours, even though it is in our 127/8
            return (0, 0, -index)
        if addr in own:  # "that is me": the same Docker/VPN address on both hosts
            return (0 if addr.is_link_local else 2, 0, -index)
        prefix = max((net.network.prefixlen for net in nets if addr in net.network), default=-1)
        if prefix >= 0:
            return (4 if addr.is_link_local else 5, prefix, -index)
        return (0 if addr.is_link_local else 3, 0, -index)

    return candidates[max(range(len(candidates)), key=rank)]


def outbound_address(target_host: str, target_port: int = 9) -> str:
    """The local address the kernel would use to reach the target; no packet is sent.

    Blocks on DNS when ``target_host`` is a name (run it in an executor from the event loop).
    Raises OSError when there is no route.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((target_host, target_port))  # UDP connect only picks a route and source
        return str(sock.getsockname()[0])


def announce_addresses(listen_host: str) -> list[str]:
    """What a node listening on ``listen_host`` should announce to others.

    A specific address is announced alone; for a wildcard (``0.0.0.0``, ``""``) every
    non-loopback IPv4 address of this host, or ``["127.0.0.1"]`` if it has none.
    """
    if listen_host not in _WILDCARD_HOSTS:
        return [listen_host]
    found = [str(net.ip) for net in local_ipv4_networks() if not net.ip.is_loopback]
    return list(dict.fromkeys(found)) or ["127.0.0.1"]


def instance_label(peer_id: str) -> str:
    """A DNS label (letters, digits, '-'; at most 63 bytes) naming the peer's service and host."""
    if not peer_id:
        raise ValueError("peer_id must not be empty")
    return re.sub(r"[^A-Za-z0-9-]", "-", f"murmur-{peer_id}")[:_MAX_LABEL_BYTES]


class ZeroconfDiscovery:
    """Announce this node and report same-swarm peers seen on the LAN.

    ``on_sighting`` is called on the event loop for every added or updated peer service
    (repeats are normal; the peer table deduplicates). Lifecycle: ``start()`` once, then
    ``stop()`` any number of times.
    """

    def __init__(
        self,
        *,
        swarm: str,
        fingerprint: str,
        peer_id: str,
        port: int,
        addresses: Sequence[str] | None = None,
        interfaces: Sequence[str] | None = None,
        on_sighting: Callable[[Sighting], None],
    ) -> None:
        self._swarm, self._fingerprint = swarm, fingerprint
        self._peer_id, self._port = peer_id, port
        self._txt = dict(swarm=swarm, fingerprint=fingerprint, peer_id=peer_id, proto=PROTO_VERSION)
        self._addresses = None if addresses is None else list(addresses)
        self._interfaces = None if interfaces is None else list(interfaces)
        self._on_sighting = on_sighting
        self._label = instance_label(peer_id)
        self._aiozc: AsyncZeroconf | None = None
        self._info: AsyncServiceInfo | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._announcing: asyncio.Future[Any] | None = None  # set once registered
        self._resolving: dict[str, asyncio.Task[None]] = {}
        self._stopped = False

    @property
    def service_name(self) -> str:
        """Our registered instance name (zeroconf may have appended a suffix on conflict)."""
        if self._info is not None:
            return self._info.name
        return f"{self._label}.{SERVICE_TYPE}"

    async def start(self) -> None:
        """Register our service (probing for name conflicts) and start browsing."""
        if self._aiozc is not None or self._stopped:
            raise RuntimeError("ZeroconfDiscovery.start() may be called only once")
        choice: InterfaceChoice | list[str | int] = (
            InterfaceChoice.All if self._interfaces is None else list(self._interfaces)
        )
        self._aiozc = AsyncZeroconf(interfaces=choice, ip_version=IPVersion.V4Only)
        addresses = self._addresses or announce_addresses("0.0.0.0")
        self._info = AsyncServiceInfo(
            SERVICE_TYPE,
            self.service_name,
            port=self._port,
            properties=self._txt,
            server=f"{self._label}.local.",
            parsed_addresses=addresses,
        )
        try:
            announced = await asyncio.wait_for(
                self._aiozc.async_register_service(self._info, allow_name_change=True),
                REGISTER_TIMEOUT_S,
            )
            self._announcing = asyncio.ensure_future(announced)
            self._browser = AsyncServiceBrowser(
                self._aiozc.zeroconf, SERVICE_TYPE, handlers=[self._on_state_change]
            )
        except BaseException:
            await self.stop()
            raise
        log.info("discovery: announcing %s at %s:%d", self.service_name, addresses, self._port)

    async def stop(self) -> None:
        """Send goodbyes and close; idempotent, and every step is bounded by a timeout."""
        if self._stopped:
            return
        self._stopped = True
        aiozc, self._aiozc = self._aiozc, None
        if aiozc is None:
            return
        tasks: list[asyncio.Future[Any]] = [*self._resolving.values()]
        if self._announcing is not None:
            tasks.append(self._announcing)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._resolving.clear()
        if self._browser is not None:
            await self._bounded("cancel browser", self._browser.async_cancel())
        if self._announcing is not None and self._info is not None:
            await self._bounded("goodbye", self._unregister(aiozc, self._info))
        await self._bounded("close", aiozc.async_close())

    @staticmethod
    async def _unregister(aiozc: AsyncZeroconf, info: AsyncServiceInfo) -> None:
        sent = await aiozc.async_unregister_service(info)
        await sent  # the goodbye packets (TTL 0) go out over about half a second

    @staticmethod
    async def _bounded(step: str, aw: Awaitable[object]) -> None:
        try:
            await asyncio.wait_for(aw, STOP_STEP_TIMEOUT_S)
        except TimeoutError:
            log.warning("discovery: %s timed out after %.1f s", step, STOP_STEP_TIMEOUT_S)
        except Exception:
            log.warning("discovery: %s failed", step, exc_info=True)

    def _on_state_change(
        self,
        zeroconf: Zeroconf,
        service_type: str,
        name: str,
        state_change: ServiceStateChange,
    ) -> None:
        """Browser callback (on the event loop); resolution happens in a task we own."""
        if self._stopped or state_change is ServiceStateChange.Removed:
            return
        if name.lower() == self.service_name.lower() or name in self._resolving:
            return
        task = asyncio.get_running_loop().create_task(self._resolve(zeroconf, name))
        self._resolving[name] = task
        task.add_done_callback(lambda _: self._resolving.pop(name, None))

    async def _resolve(self, zeroconf: Zeroconf, name: str) -> None:
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        try:
            found = await asyncio.wait_for(
                info.async_request(zeroconf, RESOLVE_TIMEOUT_S * 1000), RESOLVE_TIMEOUT_S + 1.0
            )
        except TimeoutError:
            found = False
        if not found:
            log.debug("discovery: could not resolve %s in %.1f s", name, RESOLVE_TIMEOUT_S)
            return
        sighting = self._sighting_from(info)
        if sighting is None:
            return
        try:
            self._on_sighting(sighting)
        except Exception:
            log.exception("discovery: on_sighting failed for %s", sighting.peer_id)

    def _sighting_from(self, info: AsyncServiceInfo) -> Sighting | None:
        props = info.decoded_properties
        theirs = (props.get("swarm"), props.get("fingerprint"), props.get("proto"))
        if theirs != (self._swarm, self._fingerprint, PROTO_VERSION):
            log.debug("discovery: ignoring %s (swarm, fingerprint, proto = %r)", info.name, theirs)
            return None
        peer_id = props.get("peer_id")
        addresses = tuple(info.parsed_addresses(IPVersion.V4Only))
        if not peer_id or peer_id == self._peer_id or not addresses or not info.port:
            log.debug("discovery: ignoring %s (ours, or no peer_id, IPv4 or port)", info.name)
            return None
        return Sighting(peer_id, self._swarm, self._fingerprint, addresses, info.port)
