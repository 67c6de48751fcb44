"""Benchmarks: each compares things side by side in one run and writes JSON and a PNG to
``bench/results/`` (``bench/README.md``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def save(
    result: dict[str, Any],
    out: Path,
    name: str,
    plot: Callable[[dict[str, Any], Path], None] | None,
) -> None:
    """Write ``result`` to ``out/name.json`` and, with ``plot``, its figure to ``out/name.png``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    if plot is not None:
        plot(result, out / f"{name}.png")
