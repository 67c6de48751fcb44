"""The seams through which swarm services reach the world: transport, clock, refusals.

Services in ``swarm/`` never open sockets or read the wall clock themselves; they receive a
``Transport`` and a ``Clock`` (``typing.Protocol``, so an in-memory fake need not inherit).
The daemon in ``node/`` supplies the real HTTP transport; tests supply fakes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from protocol.messages import Message


class Transport(Protocol):
    """Send one message to the peer at ``address`` (``host:port``) and return its reply."""

    async def request(
        self, address: str, msg: Message, timeout_s: float, peer_id: str = ""
    ) -> Message:
        """Raises ``TransportError`` when the peer cannot be reached or answers with an error.

        ``peer_id`` names the peer expected at ``address`` ("" for a first contact): in a
        keyed swarm the request is then sealed for it alone, and a reply sealed by anyone
        else fails (``identity_mismatch``), so a false address relayed for a peer cannot draw
        its work elsewhere. When it returns, ``msg`` has been sent in full: its tensors may
        be reused or changed.
        """
        ...


class Clock(Protocol):
    """Monotonic time in seconds, and sleeping on it; and the wall clock, which only says
    what time this machine believes it is (another's may differ: ``swarm.schedule``)."""

    def now(self) -> float: ...

    def wall(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    """The real clock: ``time.monotonic`` and ``asyncio.sleep``; ``time.time`` plus
    ``skew_s`` as the wall clock (a test's stand-in for a machine whose clock is wrong)."""

    def __init__(self, skew_s: float = 0.0) -> None:
        self.skew_s = skew_s

    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time() + self.skew_s

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


NO_ANSWER = ("unreachable", "timeout")
"""``TransportError`` codes of a peer that said nothing (down, or not reachable from here),
as against one that answered with a refusal."""


class TransportError(Exception):
    """A request failed: unreachable peer, timeout, or an ``Error`` reply (``code`` says which)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Refused(Exception):
    """A handler refuses a well-formed request (wrong swarm, unknown microbatch, busy...).

    The daemon turns it into an ``Error`` reply with this code and HTTP status.
    """

    def __init__(self, code: str, message: str, http_status: int = 409) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.http_status = http_status
