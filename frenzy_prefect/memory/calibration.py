"""Per-GPU-type memory constants the analytic model cannot derive: what the CUDA context,
library workspaces and the caching allocator add on top of the tensors (``overhead_bytes``),
and how much the allocator's block rounding and fragmentation inflate the tensors
(``fragmentation``). Fitted from measured runs (``fit``) and kept in a JSON file the
estimator loads: the packaged ``calibration.json``, or the file named by FRENZY_CALIBRATION.
On CPU (no GPU type) both are neutral: MemTracker counts tensor storage exactly.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.spec.gpu import GpuType

PACKAGED = Path(__file__).with_name("calibration.json")
ENV = "FRENZY_CALIBRATION"


class GpuConstants(BaseModel):
    model_config = ConfigDict(frozen=True)

    overhead_bytes: NonNegativeInt = 0
    fragmentation: float = Field(default=1.0, ge=1.0)
    source: Literal["assumed", "fitted"] = "assumed"
    note: str = ""


NEUTRAL = GpuConstants(note="tensor storage only (CPU, MemTracker)")


class Calibration(BaseModel):
    model_config = ConfigDict(frozen=True)

    gpus: dict[str, GpuConstants] = Field(default_factory=dict)

    def for_gpu(self, gpu: GpuType | None) -> GpuConstants:
        """The constants of ``gpu``: fitted or assumed ones for its type, else the type's declared
        runtime overhead (an assumption), and neutral ones without a GPU."""
        if gpu is None:
            return NEUTRAL
        return self.gpus.get(gpu.name) or GpuConstants(overhead_bytes=gpu.runtime_overhead_bytes, note="catalog assumption")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        try:
            return cls.model_validate_json(Path(path).read_text())
        except OSError as exc:
            raise FrenzyError(f"cannot read calibration file {path}: {exc.strerror}") from None
        except ValueError as exc:
            raise FrenzyError(f"calibration file {path} is not valid: {exc}") from None


@lru_cache(maxsize=1)
def default_calibration() -> Calibration:
    return Calibration.load(os.environ.get(ENV) or PACKAGED)


def fit(predicted_tensors: list[int], measured: list[int], note: str = "") -> GpuConstants:
    """Least squares of measured = fragmentation * predicted + overhead over runs of one GPU
    type (``predicted_tensors``: the neutral estimate's peak). With one run, the factor stays 1."""
    if len(predicted_tensors) != len(measured) or not measured:
        raise FrenzyError("fit needs one prediction per measured run, and at least one run")
    n = len(measured)
    mx, my = sum(predicted_tensors) / n, sum(measured) / n
    var = sum((x - mx) ** 2 for x in predicted_tensors)
    factor = 1.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(predicted_tensors, measured, strict=True)) / var
    factor = max(factor, 1.0)  # fragmentation only inflates
    overhead = max(0, round(my - factor * mx))
    return GpuConstants(overhead_bytes=overhead, fragmentation=factor, source="fitted", note=note)


def save(calibration: Calibration, path: str | Path) -> None:
    """Write ``calibration`` whole (one write of a complete file)."""
    Path(path).write_text(calibration.model_dump_json(indent=2) + "\n")
