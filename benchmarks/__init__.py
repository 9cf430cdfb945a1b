"""Benchmarks: run by hand (python -m benchmarks.NAME), each printing a table and writing JSON."""

from __future__ import annotations

import json
from pathlib import Path


def p99(values: list[float]) -> float:
    """The 99th percentile of sorted ``values`` (nearest rank, at least the second largest of 100)."""
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def write_result(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"JSON: {path}")
