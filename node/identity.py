"""This node's identity and its swarm's key: the files behind them.

Owns where the Ed25519 key pair lives (``identity.pem`` in the state directory, created on
first start, readable by its owner only), so a node restarted with the same directory is the
same peer, and reading the swarm key from ``net.swarm_key`` or ``net.swarm_key_file``.
Signing and checking are ``protocol.auth``'s; when and where to check is the daemon's.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from node.config import NetConfig
from protocol.auth import Identity, SwarmAuth

log = logging.getLogger(__name__)

IDENTITY_FILE = "identity.pem"


def load_identity(state_dir: str) -> Identity:
    """The identity kept in ``state_dir`` (created on first use); a fresh one without it."""
    if not state_dir:
        log.info("no --state-dir: this node's identity is new and lasts until it exits")
        return Identity.generate()
    path = Path(state_dir) / IDENTITY_FILE
    if path.is_file():
        try:
            return Identity.from_pem(path.read_bytes())
        except ValueError as e:
            raise ValueError(f"{path}: {e}; move it away to start as a new peer") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    identity = Identity.generate()
    tmp = path.with_name(IDENTITY_FILE + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(identity.to_pem())
    os.replace(tmp, path)  # never a half-written key under the real name
    log.info("new identity: peer %s, key pair in %s", identity.peer_id, path)
    return identity


def load_swarm_key(net: NetConfig) -> bytes | None:
    """The swarm key as bytes (surrounding whitespace dropped), or None for an open swarm."""
    swarm_key, swarm_key_file = net.swarm_key, net.swarm_key_file
    if swarm_key and swarm_key_file:
        raise ValueError("set net.swarm_key (--swarm-key) or net.swarm_key_file, not both")
    if not swarm_key_file:
        return swarm_key.strip().encode() or None
    try:
        key = Path(swarm_key_file).read_bytes().strip()
    except OSError as e:
        raise ValueError(f"cannot read the swarm key file {swarm_key_file}: {e.strerror}") from None
    if not key:
        raise ValueError(f"the swarm key file {swarm_key_file} is empty")
    return key


def swarm_auth(net: NetConfig, identity: Identity) -> SwarmAuth | None:
    """``identity``'s side of the keyed swarm, or None when the swarm is open."""
    key = load_swarm_key(net)
    return SwarmAuth(key, identity) if key is not None else None
