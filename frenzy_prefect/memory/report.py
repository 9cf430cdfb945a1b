"""The per-rank memory report `frenzy estimate` and `frenzy measure` print (one schema: docs/architecture.md, Contracts):
the peak over ranks, then every rank with its pipeline stage and breakdown by category.

Ranks that hold the same bytes are one ``Ranks`` group (an estimate: one per pipeline stage), so
that nothing loops over the ranks of a plan but the JSON, which lists each rank (the contract).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from frenzy_prefect.memory.frameworks import FsdpOptions, MegatronOptions, estimate
from frenzy_prefect.spec.cluster import GpuType
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import MemoryBreakdown, ParallelPlan
from frenzy_prefect.spec.workload import Workload


class Ranks(NamedTuple):
    """Consecutive ranks ``first``..``last`` of one pipeline stage, each holding ``breakdown``."""

    first: int
    last: int
    stage: int
    breakdown: MemoryBreakdown

    @property
    def count(self) -> int:
        return self.last - self.first + 1


def group_ranks(plan: ParallelPlan, per_rank: Iterable[tuple[int, MemoryBreakdown]]) -> list[Ranks]:
    """Each rank's breakdown (in rank order), consecutive ranks of a stage that hold the same bytes grouped."""
    groups: list[Ranks] = []
    for rank, breakdown in per_rank:
        stage = plan.coordinates(rank)[0]
        last = groups[-1] if groups else None
        if last is not None and last.last == rank - 1 and last.stage == stage and last.breakdown == breakdown:
            groups[-1] = last._replace(last=rank)
        else:
            groups.append(Ranks(rank, rank, stage, breakdown))
    return groups


def memory_json(plan: ParallelPlan, groups: list[Ranks], reserved: dict[int, int] | None = None) -> dict[str, Any]:
    """The estimate/measure schema: the peak over ranks, then every rank (with its stage) and its
    breakdown; where known (``reserved``: rank -> bytes), what the caching allocator reserves."""
    ranks = []
    for g in groups:
        peak, breakdown = g.breakdown.total, g.breakdown.model_dump()
        ranks += [{"rank": rank, "stage": g.stage, "peak_bytes": peak, "breakdown": breakdown} for rank in range(g.first, g.last + 1)]
    out = {"peak_bytes": max(g.breakdown.total for g in groups), "per_rank": ranks, "plan": plan.model_dump()}
    if reserved:
        for rank in ranks:
            rank["reserved_bytes"] = reserved.get(rank["rank"])
        out["reserved_bytes"] = max(reserved.values())
    return out


def figure(gpu: GpuType | None) -> str:
    """What the bytes count: the tensors alone, or with the GPU's runtime overhead added."""
    return f"tensors + GPU overhead ({gpu.name})" if gpu is not None else "tensors"


def memory_report(
    spec: ModelSpec,
    plan: ParallelPlan,
    work: Workload,
    groups: list[Ranks],
    *,
    framework: str = "frenzy",
    gpu: GpuType | None = None,
    measured: bool = False,
    reserved: dict[int, int] | None = None,
) -> dict[str, Any]:
    """`memory_json` plus the model it describes (name, parameter count, sequence length), the
    framework whose execution it describes, the attention, and what the figure counts."""
    return memory_json(plan, groups, reserved) | {
        "model": spec.name,
        "parameters": spec.parameters,
        "seq_len": work.seq_len,
        "framework": framework,
        "attention": work.attention,
        "includes_gpu_overhead": gpu is not None and not measured,
        "figure": "tensors (measured)" if measured else figure(gpu),
    }


def estimated_ranks(
    spec: ModelSpec,
    plan: ParallelPlan,
    work: Workload,
    gpu: GpuType | None,
    *,
    framework: str = "frenzy",
    options: MegatronOptions | FsdpOptions | None = None,
) -> list[Ranks]:
    """The predicted breakdown under ``framework`` of the ranks of each pipeline stage (with
    ``gpu``'s overhead when given, tensors only otherwise): every rank of a stage holds the same."""
    result = estimate(framework, spec, plan, work, gpu=gpu, options=options)
    per_stage = plan.dp * plan.tp  # ranks are numbered stage-major (ParallelPlan.coordinates)
    return [Ranks(s * per_stage, (s + 1) * per_stage - 1, s, b) for s, b in enumerate(result.per_stage)]
