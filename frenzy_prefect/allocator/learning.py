"""What a cluster's finished runs teach the next plan (memory/run_records.py): on a GPU type with
enough runs measured, the memory terms around the tensors fitted from what the GPUs held (as
``frenzy calibrate`` fits them) and the achievable fraction of peak fitted from the measured step
times (``fit_achievable_fraction``). Fewer runs than ``MINIMUM_RUNS`` teach nothing: the
documented assumptions stand.
"""

from __future__ import annotations

from typing import NamedTuple

from frenzy_prefect.allocator.step_time import fit_achievable_fraction, predict_step
from frenzy_prefect.memory.calibration import Calibration, GpuConstants, assumed_constants, fit
from frenzy_prefect.memory.run_records import CalibrationStore, RunRecord
from frenzy_prefect.spec.gpu import GpuType

MINIMUM_RUNS = 3  # a fit of two terms needs more points than terms


class Learned(NamedTuple):
    gpu: GpuType  # with the fitted achievable fraction, where there was evidence
    constants: GpuConstants | None  # the fitted memory terms, where there was evidence
    memory_runs: int
    step_runs: int
    last: RunRecord | None

    @property
    def calibration(self) -> Calibration | None:
        return None if self.constants is None else Calibration(gpus={self.gpu.name: self.constants})

    def summary(self) -> str:
        """What the memory-estimates artifact says about the type's calibration."""
        if self.constants is None and self.step_runs < MINIMUM_RUNS:
            return f"documented assumptions for {self.gpu.name} ({self.memory_runs} measured runs; {MINIMUM_RUNS} are needed)"
        parts = []
        if self.constants is not None:
            parts.append(f"memory calibrated from {self.memory_runs} runs on {self.gpu.name}")
        if self.step_runs >= MINIMUM_RUNS:
            parts.append(f"step time from {self.step_runs} runs (achievable fraction {self.gpu.achievable_fraction:.3f})")
        return "; ".join(parts)


def learn(store: CalibrationStore, gpu: GpuType) -> Learned:
    """What ``store``'s runs on ``gpu``'s type teach: each run's worst rank against MARP's tensors for it."""
    records = store.on(gpu.name)
    # A run of more than one GPU held NCCL's buffers too, which single-GPU runs (and the fit's
    # overhead) do not: its assumed term is taken off first (the estimator adds it back for such plans).
    nccl = assumed_constants(gpu).nccl_bytes or 0
    worst = [(max(r.ranks, key=_device), r.plan.gpus) for r in records]
    memory = [(rank.predicted_tensors_bytes, _device(rank) - (nccl if gpus > 1 else 0)) for rank, gpus in worst if _device(rank)]
    constants = None
    if len(memory) >= MINIMUM_RUNS:
        tensors, device = (list(column) for column in zip(*memory, strict=True))
        constants = fit(tensors, device, note=f"learned from {len(memory)} runs in the calibration store of {store.cluster}")
    timed = [(predict_step(r.model, r.plan, r.work, gpu=gpu), r.measured_step_s) for r in records if r.measured_step_s]
    learned_gpu = gpu
    if len(timed) >= MINIMUM_RUNS:
        learned_gpu = gpu.model_copy(update={"achievable_fraction": fit_achievable_fraction(timed)})
    return Learned(learned_gpu, constants, len(memory), len(timed), records[-1] if records else None)


def _device(rank) -> int:
    return rank.device_bytes or 0
