"""Per-GPU-type memory a GPU holds around the tensors, which the analytic model cannot derive:

- ``cuda_context_bytes``: the CUDA context and the kernels loaded into it (torch's, cuBLAS's,
  NCCL's, the attention kernels'), outside torch's caching allocator;
- ``nccl_bytes``: NCCL's communication buffers (per channel and peer connection, per
  communicator), outside the caching allocator;
- ``workspace_bytes``: cuBLAS/cuBLASLt workspaces, one per handle and stream;
- ``fragmentation``: how much the caching allocator's block splitting and rounding inflate the
  tensors (reserved over the tensors at the peak); None (the assumed entries): the allocator's
  own rules replayed over the engine's step, by recomputation mode (``RESERVED_OVER_TENSORS``),
  the same on every CUDA GPU.

``overhead_bytes`` is the sum of the three byte counts; the estimator adds it (NCCL's only for a
plan of more than one GPU: one GPU opens no communicator) and ``(fragmentation - 1) * tensors``
to the tensors. Each value has its source text (a URL, or
"assumed: <why>"). The packaged ``calibration.json`` holds documented assumptions for every
catalog type (docs/memory.md, "The GPU around the tensors"); ``fit`` replaces them with values fitted
from measured runs on the type (``frenzy calibrate``), kept in the file named by
FRENZY_CALIBRATION or the packaged one. On CPU (no GPU type) everything is neutral: MemTracker
counts tensor storage exactly.

Files written before the split hold one ``overhead_bytes`` per type; they still load (it
becomes the context term, standing for all three).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, computed_field, model_validator

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.spec.gpu import GpuType
from frenzy_prefect.units import GIB, MIB

# What PyTorch's caching allocator reserves over the peak of live tensors, the largest found for
# each recomputation mode when the engine's step is traced and replayed through its rules
# (frenzy_prefect/caching_allocator.py) on eight
# configurations (benchmarks/reserved_replay.py, results/reserved_replay.json: x1.02-1.08 without
# recomputation, x1.05 selective, x1.15 and x1.20 full; on an H200 the replay was within 0.32% of
# max_memory_reserved on four of them). Full recomputation fragments most: each block is rebuilt
# inside the backward, its activations allocated into blocks the previous step's pattern left.
# The planner's figure for any plan; `frenzy estimate --reserved` replays the plan itself.
RESERVED_OVER_TENSORS = {"none": 1.09, "selective": 1.09, "full": 1.20}

PACKAGED = Path(__file__).with_name("calibration.json")
ENV = "FRENZY_CALIBRATION"
COMPONENTS = ("cuda_context_bytes", "nccl_bytes", "workspace_bytes")


class GpuConstants(BaseModel):
    model_config = ConfigDict(frozen=True)

    cuda_context_bytes: NonNegativeInt = 0
    nccl_bytes: NonNegativeInt | None = Field(
        default=0, description="None: not measured (single-GPU calibration opens no communicator), the assumed value applies."
    )
    workspace_bytes: NonNegativeInt = 0
    fragmentation: float | None = Field(
        default=1.0, ge=1.0, description="None: the caching allocator's replayed figure for the plan's recomputation."
    )
    source: Literal["assumed", "fitted"] = "assumed"
    sources: dict[str, str] = Field(
        default_factory=dict, description="Per term (cuda_context, nccl, workspace, fragmentation): a URL or 'assumed: <why>'."
    )
    note: str = ""

    @model_validator(mode="before")
    @classmethod
    def _lumped_overhead(cls, data: Any) -> Any:
        """An older file's (or caller's) single ``overhead_bytes``: the context term standing for
        all three; beside the terms (as this class writes it) it must be their sum."""
        if not isinstance(data, dict) or "overhead_bytes" not in data:
            return data
        data = dict(data)
        overhead = data.pop("overhead_bytes")
        if not any(k in data for k in COMPONENTS):
            sources = {"cuda_context": "overhead_bytes: context, NCCL and workspaces together", **data.get("sources", {})}
            return data | {"cuda_context_bytes": overhead, "nccl_bytes": 0, "workspace_bytes": 0, "sources": sources}
        total = sum(data.get(k) or 0 for k in COMPONENTS)
        if overhead != total:
            raise ValueError(f"overhead_bytes ({overhead}) must be the sum of {', '.join(COMPONENTS)} ({total})")
        return data

    @computed_field  # type: ignore[prop-decorator]
    @property
    def overhead_bytes(self) -> int:
        """Everything outside the tensors that does not scale with them."""
        return self.cuda_context_bytes + (self.nccl_bytes or 0) + self.workspace_bytes

    def overhead_for(self, gpus: int) -> int:
        """The overhead of a plan of ``gpus`` GPUs: NCCL's buffers only where a communicator exists."""
        return self.overhead_bytes - ((self.nccl_bytes or 0) if gpus == 1 else 0)

    def with_assumed(self, assumed: GpuConstants) -> GpuConstants:
        """These constants, with ``assumed``'s NCCL term where they did not measure one."""
        if self.nccl_bytes is not None:
            return self
        sources = self.sources | {"nccl": assumed.sources.get("nccl", "assumed")}
        return self.model_copy(update={"nccl_bytes": assumed.nccl_bytes or 0, "sources": sources})


NEUTRAL = GpuConstants(note="tensor storage only (CPU, MemTracker)")

# A type neither the packaged file nor its declaration describes: the largest assumed terms of
# the packaged file (an NVLink Hopper part), so that an unknown part is not planned too tightly.
UNKNOWN = GpuConstants(
    cuda_context_bytes=512 * MIB,
    nccl_bytes=1 * GIB,
    workspace_bytes=64 * MIB,
    fragmentation=None,
    sources={"all": "assumed: an undeclared type gets the packaged file's largest assumed terms (H100)"},
    note="unknown type",
)


class Calibration(BaseModel):
    model_config = ConfigDict(frozen=True)

    gpus: dict[str, GpuConstants] = Field(default_factory=dict)

    def for_gpu(self, gpu: GpuType | None) -> GpuConstants:
        """The constants of ``gpu``: this calibration's entry for its type (an NCCL term it did
        not measure taken from the assumed one), else the packaged assumed entry, else the
        type's declared ``runtime_overhead_bytes``, else ``UNKNOWN``; neutral without a GPU."""
        if gpu is None:
            return NEUTRAL
        assumed = assumed_constants(gpu)
        entry = self.gpus.get(gpu.name)
        return assumed if entry is None else entry.with_assumed(assumed)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        try:
            return cls.model_validate_json(Path(path).read_text())
        except OSError as exc:
            raise FrenzyError(f"cannot read calibration file {path}: {exc.strerror}") from None
        except ValueError as exc:
            raise FrenzyError(f"calibration file {path} is not valid: {exc}") from None


@lru_cache(maxsize=1)
def packaged_calibration() -> Calibration:
    """The documented assumptions (and any fitted entries) shipped with the package."""
    return Calibration.load(PACKAGED)


@lru_cache(maxsize=256)  # asked for every plan the allocator estimates on the type
def assumed_constants(gpu: GpuType) -> GpuConstants:
    """What is assumed for ``gpu`` before anything is measured on it: the packaged entry of
    its type, else its declared ``runtime_overhead_bytes`` (all three terms in one), else
    ``UNKNOWN``."""
    packaged = packaged_calibration().gpus.get(gpu.name)
    if packaged is not None:
        return packaged.with_assumed(UNKNOWN)
    if gpu.runtime_overhead_bytes is not None:
        return GpuConstants(
            cuda_context_bytes=gpu.runtime_overhead_bytes,
            nccl_bytes=0,
            sources={"cuda_context": "the type's declared runtime_overhead_bytes: context, NCCL and workspaces together"},
            note="declared by the cluster",
        )
    return UNKNOWN


@lru_cache(maxsize=1)
def default_calibration() -> Calibration:
    return Calibration.load(os.environ.get(ENV) or PACKAGED)


def fit(predicted_tensors: list[int], measured: list[int], note: str = "") -> GpuConstants:
    """Least squares of measured = fragmentation * predicted + overhead over runs of one GPU
    type (``predicted_tensors``: the neutral estimate's peak). With one run, the factor stays 1.
    The runs are single-GPU: the fitted overhead is the context and workspaces together, and the
    NCCL term stays the assumed one (``GpuConstants.with_assumed``)."""
    if len(predicted_tensors) != len(measured) or not measured:
        raise FrenzyError("fit needs one prediction per measured run, and at least one run")
    n = len(measured)
    mx, my = sum(predicted_tensors) / n, sum(measured) / n
    var = sum((x - mx) ** 2 for x in predicted_tensors)
    factor = 1.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(predicted_tensors, measured, strict=True)) / var
    factor = max(factor, 1.0)  # fragmentation only inflates
    overhead = max(0, round(my - factor * mx))
    how = f"fitted over {n} measured runs"
    return GpuConstants(
        cuda_context_bytes=overhead,
        nccl_bytes=None,
        fragmentation=factor,
        source="fitted",
        sources={"cuda_context": f"{how}: context and library workspaces together", "fragmentation": how},
        note=note,
    )


def save(calibration: Calibration, path: str | Path) -> None:
    """Write ``calibration`` whole (one write of a complete file)."""
    Path(path).write_text(calibration.model_dump_json(indent=2) + "\n")
