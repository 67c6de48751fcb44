"""Benchmarks: each compares things side by side in one run and writes JSON and a PNG to
``bench/results/`` (``bench/README.md``)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def add_set_arg(p: argparse.ArgumentParser, help: str, dest: str = "set") -> None:
    """``--set SECTION.FIELD=VALUE`` (repeatable): a setting ``node join --set`` takes, given
    to every node of the benchmark (``node.config.parse_sets`` reads the list)."""
    p.add_argument(
        "--set", action="append", default=[], dest=dest, metavar="SECTION.FIELD=VALUE", help=help
    )


def add_output_args(p: argparse.ArgumentParser, stem: str) -> None:
    """Where a benchmark writes: ``--out`` (a folder), ``--name`` (the files' stem) and
    ``--no-plot`` (JSON only)."""
    p.add_argument("--out", type=Path, default=RESULTS, help="folder (default bench/results)")
    p.add_argument("--name", default="", help=f"results file stem (default {stem})")
    p.add_argument("--no-plot", action="store_true", help="write the JSON only")


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
