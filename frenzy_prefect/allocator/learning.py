"""What a cluster's finished runs teach the next plan (memory/run_records.py): on a GPU type with
enough runs measured, the memory terms around the tensors fitted from what the GPUs held (as
``frenzy calibrate`` fits them) and the achievable fraction of peak fitted from the measured step
times (``fit_achievable_fraction``). Fewer runs than ``MINIMUM_RUNS`` teach nothing: the
documented assumptions stand.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple

from frenzy_prefect.allocator.step_time import fit_achievable_fraction, predict_step
from frenzy_prefect.memory import estimate
from frenzy_prefect.memory.calibration import Calibration, GpuConstants, assumed_constants, default_calibration, fit
from frenzy_prefect.memory.run_records import CalibrationStore, RankRecord, RunRecord
from frenzy_prefect.spec.cluster import ClusterSpec
from frenzy_prefect.spec.gpu import GpuType
from frenzy_prefect.spec.plan import TrainingJob
from frenzy_prefect.spec.result import TrainingResult

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
    worst = [(r.worst_rank, r.plan.gpus) for r in records]
    memory = [(k.predicted_tensors_bytes, k.device_bytes - (nccl if gpus > 1 else 0)) for k, gpus in worst if k.device_bytes]
    constants = None
    if len(memory) >= MINIMUM_RUNS:
        tensors, device = (list(column) for column in zip(*memory, strict=True))
        constants = fit(tensors, device, note=f"learned from {len(memory)} runs in the calibration store of {store.cluster}")
    timed = [(predict_step(r.model, r.plan, r.work, gpu=gpu), r.measured_step_s) for r in records if r.measured_step_s]
    learned_gpu = gpu
    if len(timed) >= MINIMUM_RUNS:
        learned_gpu = gpu.model_copy(update={"achievable_fraction": fit_achievable_fraction(timed)})
    return Learned(learned_gpu, constants, len(memory), len(timed), records[-1] if records else None)


def applied(store: CalibrationStore, cluster: ClusterSpec) -> tuple[ClusterSpec, Calibration, list[Learned]]:
    """``cluster`` with each of its GPU types as its runs taught (the achievable fraction, as a
    type override), the calibration with the memory terms they taught, and what each type learned."""
    known = cluster.known_gpu_types()
    learned = [learn(store, known[name]) for name in sorted({n.gpu_type for n in cluster.nodes})]
    types = {r.gpu.name: r.gpu for r in learned if r.step_runs >= MINIMUM_RUNS}
    base = default_calibration()
    terms = {r.gpu.name: r.constants for r in learned if r.constants is not None}
    taught = cluster.model_copy(update={"gpu_types": cluster.gpu_types | types}) if types else cluster
    return taught, base.model_copy(update={"gpus": base.gpus | terms}) if terms else base, learned


def record_of(job: TrainingJob, result: TrainingResult, source: str) -> RunRecord:
    """What ``job``'s run measured, for its cluster's calibration store: per pipeline stage its
    most loaded rank (on GPUs; on CPU the stage's first rank, with no memory measured) against
    MARP's tensors for the stage, and the median step after the first against the prediction."""
    allocation, work = job.allocation, job.request.workload
    plan, gpu = allocation.plan, job.cluster.known_gpu_types()[allocation.gpu_type]
    tensors = estimate(job.model, plan, work, gpu=gpu, calibration=Calibration(gpus={gpu.name: GpuConstants()})).per_stage
    peaks = {p.rank: p for p in result.rank_peaks}
    per_stage = plan.dp * plan.tp  # ranks are numbered stage-major (ParallelPlan.coordinates)
    ranks = []
    for stage, predicted in enumerate(tensors):
        members = range(stage * per_stage, (stage + 1) * per_stage)
        rank = max(members, key=lambda r: peaks[r].reserved_bytes) if peaks else members[0]
        peak = peaks.get(rank)
        held = {} if peak is None else {k: getattr(peak, k) for k in ("allocated_bytes", "reserved_bytes", "outside_allocator_bytes")}
        ranks.append(RankRecord(rank=rank, stage=stage, predicted_tensors_bytes=predicted.total, **held))
    steps = result.step_s[1:] or result.step_s
    return RunRecord(
        source=source,
        gpu_type=gpu.name,
        model=job.model,
        plan=plan,
        work=work,
        ranks=ranks,
        predicted_step_s=allocation.step_time_s,
        measured_step_s=statistics.median(steps) if steps else None,
        tokens_per_s=result.tokens_per_s,
    )
