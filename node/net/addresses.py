"""The address a node announces: configured, the one it listens on, or a guess confirmed.

Owns the rule. ``net.announce`` wins; else a node listening on one address announces it;
else (listening on every interface) it guesses the interface the kernel would use towards a
bootstrap peer or, on a LAN, towards the mDNS group, and later takes the address peers see
it connect from (``Welcome.observed_host``) when that address is one of its own. Names the
states of its reachability. Does not
own discovery or membership (``swarm.discovery``, ``swarm.membership``).
"""

from __future__ import annotations

import logging

from node.config import NetConfig, parse_hostport
from swarm.discovery import announce_addresses, local_ipv4_networks, outbound_address

log = logging.getLogger(__name__)

ANY_HOST = ("0.0.0.0", "", "::")
"""Listen hosts that mean every interface."""

DIRECT, RELAYED, UNREACHABLE, UNKNOWN = "direct", "relayed", "unreachable", "unknown"
REACHABILITY_STATES = (DIRECT, RELAYED, UNREACHABLE, UNKNOWN)
"""Whether peers reach the announced address: dialled back by a peer, only through a relay
(``node.net.relay``), neither, or not known yet (``node.services.reachability`` decides)."""


def announce_host(net: NetConfig, listen_host: str) -> str:
    """The host part of the address this node announces at start-up."""
    if net.announce:
        return net.announce.rpartition(":")[0] if ":" in net.announce else net.announce
    if listen_host not in ANY_HOST:
        return listen_host
    # Several interfaces: take the one the kernel would use towards a bootstrap peer or,
    # on a LAN, towards the mDNS group; peers later confirm what they see (observed_address).
    target = parse_hostport(net.bootstrap[0]) if net.bootstrap else ("224.0.0.251", 5353)
    try:
        host = outbound_address(*target)
    except OSError:
        host = "127.0.0.1"
    return host if not host.startswith("127.") else announce_addresses(listen_host)[0]


def observed_address(net: NetConfig, address: str, observed: str | None) -> str | None:
    """The address to announce instead of ``address`` now that peers see this node connect
    from ``observed``, or None to keep it: only a node that guessed takes a peer's word,
    and only for an address of its own that is not loopback."""
    host, port = address.rsplit(":", 1)
    listen_host, _ = parse_hostport(net.listen)
    guessing = not net.announce and listen_host in ANY_HOST
    if not guessing or not observed or observed == host or observed.startswith("127."):
        return None
    if observed not in {str(i.ip) for i in local_ipv4_networks()}:
        return None
    log.info(
        "peers reach this node at %s, not %s: announcing %s:%s", observed, host, observed, port
    )
    return f"{observed}:{port}"
