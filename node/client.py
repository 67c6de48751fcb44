"""Talking to a running node from outside the swarm: ``node status``, ``eval``, ``profile``.

Owns the operator's HTTP client: ``GET /status`` (``fetch_status``), and the POSTs to the
endpoints that cost a node work (``/eval``, ``/profile``), signed in a keyed swarm with a
fresh identity's proof over the empty body (``post_to_node``, ``operator_auth``). Used by
the CLI, the demo, the benchmarks and the tests. A node's refusal reaches the caller as
``NodeRefused`` with the node's own message; an unreachable node as ``ValueError``.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from node.config import resolve_config
from node.identity import swarm_auth
from protocol.auth import AUTH_HEADER, Identity, SwarmAuth, frame_digest


def fetch_status(address: str, timeout_s: float = 5.0) -> dict[str, Any]:
    url = address if address.startswith("http") else f"http://{address}"
    try:
        with urllib.request.urlopen(f"{url}/status", timeout=timeout_s) as resp:
            data: dict[str, Any] = json.loads(resp.read())
            return data
    except (urllib.error.URLError, OSError) as e:
        raise ValueError(f"cannot reach a node at {address}: {e}") from None


class NodeRefused(ValueError):
    """A node answered an operator request with an error: its HTTP status and message."""

    def __init__(
        self, address: str, status: int, message: str, clock_offset_s: float | None = None
    ) -> None:
        super().__init__(f"{address} refused the request ({status}): {message}")
        self.status = status
        self.clock_offset_s = clock_offset_s
        """For a proof refused as stale: how far the node's proof clock is ahead of ours."""


def post_to_node(
    address: str,
    path: str,
    auth: SwarmAuth | None = None,
    timeout_s: float = 120.0,
    query: dict[str, str] | None = None,
) -> dict[str, Any]:
    """POST an empty body to one of a node's operator endpoints (``/eval``, ``/profile``)
    and return its JSON answer; a keyed swarm's node wants ``auth``'s proof over the body.
    A proof refused as stale (this machine's clock and the node's proofs' disagree by more
    than a minute) is stamped again once, on the time the refusal gave. Raises NodeRefused
    with the node's own error, ValueError when it cannot be reached."""
    url = f"http://{address}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    try:
        return _post_once(address, url, path, auth, timeout_s)
    except NodeRefused as e:
        if auth is None or e.clock_offset_s is None:
            raise
        auth.clock_offset_s += e.clock_offset_s
        return _post_once(address, url, path, auth, timeout_s)


def _post_once(
    address: str, url: str, path: str, auth: SwarmAuth | None, timeout_s: float
) -> dict[str, Any]:
    headers: dict[str, str] = {}
    if auth is not None:
        sent = auth.sign_request(address, "POST", path, frame_digest([]), time.time())
        headers[AUTH_HEADER] = sent.header
    req = urllib.request.Request(url, method="POST", data=b"", headers=headers)
    t0 = time.time()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            answer: dict[str, Any] = json.loads(resp.read())
            return answer
    except urllib.error.HTTPError as e:
        try:
            refusal = json.loads(e.read())
            message = str(refusal["error"])
        except (ValueError, KeyError, TypeError):
            refusal, message = {}, str(e.reason)
        proof_time = refusal.get("proof_time") if isinstance(refusal, dict) else None
        offset = None
        if isinstance(proof_time, float) and auth is not None:
            offset = proof_time - (t0 + time.time()) / 2 - auth.clock_offset_s
        raise NodeRefused(address, e.code, message, offset) from None
    except (urllib.error.URLError, OSError) as e:
        raise ValueError(f"cannot reach a node at {address}: {e}") from None


def operator_auth(
    config_path: str | None, settings: dict[str, str] | None = None
) -> SwarmAuth | None:
    """The operator's side of a keyed swarm (a fresh identity) from the config, environment
    and ``settings``, or None for an open swarm."""
    net = resolve_config(config_path, os.environ, settings or {}).net
    return swarm_auth(net, Identity.generate())


def request_eval(address: str, timeout_s: float = 120.0, auth: SwarmAuth | None = None) -> float:
    """Have a head node evaluate now (a keyed swarm's node wants a proof over the empty body)."""
    return float(post_to_node(address, "/eval", auth, timeout_s)["eval_loss"])
