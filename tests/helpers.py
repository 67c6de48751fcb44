"""Helpers shared by the tests that drive real processes."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import Any


def wait_for(pred: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.5) -> Any:
    """Poll ``pred`` until it returns something truthy (returned). A node that is still
    starting may make ``pred`` raise OSError, ValueError, KeyError or, when it is reached
    through ``ip netns exec``, a SubprocessError meanwhile. AssertionError on timeout."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = pred()
            if last:
                return last
        except (OSError, ValueError, KeyError, subprocess.SubprocessError) as e:
            last = e
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what} (last: {last!r})")
