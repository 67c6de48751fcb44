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

    def __init__(self, address: str, status: int, message: str) -> None:
        super().__init__(f"{address} refused the request ({status}): {message}")
        self.status = status


def post_to_node(
    address: str,
    path: str,
    auth: SwarmAuth | None = None,
    timeout_s: float = 120.0,
    query: dict[str, str] | None = None,
) -> dict[str, Any]:
    """POST an empty body to one of a node's operator endpoints (``/eval``, ``/profile``)
    and return its JSON answer; a keyed swarm's node wants ``auth``'s proof over the body.
    Raises NodeRefused with the node's own error, ValueError when it cannot be reached."""
    headers: dict[str, str] = {}
    if auth is not None:
        sent = auth.sign_request(address, "POST", path, frame_digest([]), time.time())
        headers[AUTH_HEADER] = sent.header
    url = f"http://{address}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    req = urllib.request.Request(url, method="POST", data=b"", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            answer: dict[str, Any] = json.loads(resp.read())
            return answer
    except urllib.error.HTTPError as e:
        try:
            message = str(json.loads(e.read())["error"])
        except (ValueError, KeyError, TypeError):
            message = str(e.reason)
        raise NodeRefused(address, e.code, message) from None
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
