"""Benchmarks: run by hand (python -m benchmarks.NAME), each printing a table and writing JSON."""

from __future__ import annotations

import json
from pathlib import Path


def write_result(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"JSON: {path}")
