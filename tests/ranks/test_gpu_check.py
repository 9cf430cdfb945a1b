"""scripts/gpu-check, run here as CI runs it: on a machine without a GPU it says so, measures its
CPU part and writes a calibration store (memory/run_records.py) that validates."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from frenzy_prefect.memory.run_records import CalibrationStore
from tests.support.stack import ROOT


def test_gpu_check_without_a_gpu_runs_its_cpu_part_and_writes_a_calibration_store(tmp_path):
    out = tmp_path / "check.json"
    done = subprocess.run(
        [ROOT / "scripts" / "gpu-check", "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ | {"PYTHON": sys.executable},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no CUDA GPU here: running the CPU part" in done.stdout
    result = json.loads(out.read_text())
    store = CalibrationStore.model_validate(result["store"])
    assert len(store.records) == 2 and all(r.gpu_type is None for r in store.records)
    for record in store.records:
        (rank,) = record.ranks
        assert rank.measured_tensors_bytes == pytest.approx(rank.predicted_tensors_bytes, rel=0.03)
        assert rank.reserved_bytes is None  # MemTracker only: no allocator on CPU
    assert result["throughput"]["engine_tokens_per_s"] > 0 and result["throughput"]["bare_tokens_per_s"] > 0
