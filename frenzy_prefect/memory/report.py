"""The per-rank memory report `frenzy estimate` and `frenzy measure` print (one schema: docs/architecture.md, Contracts):
the peak over ranks, then every rank with its pipeline stage and breakdown by category."""

from __future__ import annotations

from typing import Any

from frenzy_prefect.memory.frameworks import FsdpOptions, MegatronOptions, estimate
from frenzy_prefect.spec.cluster import GpuType
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import MemoryBreakdown, ParallelPlan
from frenzy_prefect.spec.request import TrainingRequest

PerRank = list[tuple[int, MemoryBreakdown]]


def memory_json(plan: ParallelPlan, per_rank: PerRank) -> dict[str, Any]:
    """The estimate/measure schema: the peak over ranks, then every rank (with its stage) and its breakdown."""
    ranks = [{"rank": rank, "stage": plan.coordinates(rank)[0], "peak_bytes": b.total, "breakdown": b.model_dump()} for rank, b in per_rank]
    return {"peak_bytes": max(r["peak_bytes"] for r in ranks), "per_rank": ranks, "plan": plan.model_dump()}


def figure(gpu: GpuType | None) -> str:
    """What the bytes count: the tensors alone, or with the GPU's runtime overhead added."""
    return f"tensors + GPU overhead ({gpu.name})" if gpu is not None else "tensors"


def memory_report(
    spec: ModelSpec,
    plan: ParallelPlan,
    request: TrainingRequest,
    per_rank: PerRank,
    *,
    framework: str = "frenzy",
    gpu: GpuType | None = None,
    measured: bool = False,
) -> dict[str, Any]:
    """`memory_json` plus the model it describes (name, parameter count, sequence length), the
    framework whose execution it describes, the attention, and what the figure counts."""
    return memory_json(plan, per_rank) | {
        "model": spec.name,
        "parameters": spec.parameters,
        "seq_len": request.seq_len,
        "framework": framework,
        "attention": request.attention,
        "includes_gpu_overhead": gpu is not None and not measured,
        "figure": "tensors (measured)" if measured else figure(gpu),
    }


def estimated_per_rank(
    spec: ModelSpec,
    plan: ParallelPlan,
    request: TrainingRequest,
    gpu: GpuType | None,
    *,
    framework: str = "frenzy",
    options: MegatronOptions | FsdpOptions | None = None,
) -> PerRank:
    """Every rank's predicted breakdown under ``framework``: the estimate of its pipeline stage
    (with ``gpu``'s overhead when given, tensors only otherwise)."""
    result = estimate(
        framework,
        spec,
        plan,
        global_batch=request.global_batch,
        seq_len=request.seq_len,
        precision=request.precision,
        optimizer_bytes_per_param=request.optimizer.state_bytes_per_parameter,
        attention=request.attention,
        master_weights=request.master_weights,
        gpu=gpu,
        options=options,
    )
    return [(rank, result.per_stage[plan.coordinates(rank)[0]]) for rank in range(plan.gpus)]
