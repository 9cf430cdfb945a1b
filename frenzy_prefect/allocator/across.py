"""HAS across GPU types (issue 31): a run may be allocated a plan across two of the cluster's
types (``allocator.mixed``'s bounded search over the types' free GPUs now) when no single-type
plan can start on the free GPUs (if the run would otherwise wait for GPUs, only at most
WAIT_BOUND times slower than the plan it waits for), or when one across types is predicted
MIXED_GAIN faster than the single-type plan chosen (objective 'cost': that much cheaper). A plan
across types is never chosen where a single-type plan is as good.

Only for what the engine trains across types: resilience 'restart' (ReCycle re-routes within one
type's stages), and no plan pinned (a pin names a single-type plan's degrees). The GPUs of each
type are placed by HAS stage 2, in rank order: the faster type's stages (or replicas) first."""

from __future__ import annotations

from frenzy_prefect.allocator.mixed import MIXED_GAIN, MixedCandidate, mixed_candidates
from frenzy_prefect.allocator.placement import place_by_type
from frenzy_prefect.allocator.plans import usable_kinds
from frenzy_prefect.errors import NoFeasiblePlan
from frenzy_prefect.memory.analytic import estimate, on_device
from frenzy_prefect.spec.cluster import ClusterSpec, ClusterState
from frenzy_prefect.spec.gpu import GpuType
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import Allocation, MemoryEstimate, ParallelPlan, PlanCandidate, WorkerFit
from frenzy_prefect.spec.request import TrainingRequest

# A run that would wait for its single-type plan's GPUs starts across types now only if that is at
# most this much slower a step: the bound the scheduler's frenzy policy puts on any run
# (scheduling/policies/frenzy.py, STRETCH_BOUND), as the wait is not known here.
WAIT_BOUND = 2.0


def allocate_across(
    model: ModelSpec, request: TrainingRequest, state: ClusterState, chosen: Allocation | None, waits_for: PlanCandidate | None = None
) -> Allocation | None:
    """The best plan across two types that the free GPUs of ``state`` hold now, placed, if it is
    worth more than ``chosen`` (the single-type allocation that starts now), or, where none
    starts now, at most WAIT_BOUND times slower than ``waits_for`` (the single-type plan the run
    would wait for; None: none fits at all); else None."""
    if request.plan is not None or request.resilience != "restart":
        return None
    cluster = state.cluster
    try:
        gpus = {name: gpu for name, (gpu, _, _) in usable_kinds(request, cluster).items()}
    except NoFeasiblePlan:  # no type runs the precision
        return None
    free = {name: (gpu, n) for name, gpu in gpus.items() if (n := _free_of(state, name))}
    if len(free) < 2:
        return None
    try:
        found = mixed_candidates(model, request.workload, free, cluster.memory_margin, cluster.network_gbps)
    except NoFeasiblePlan:  # a search larger than its bound: the run keeps to one type
        return None
    candidates = [_candidate(model, request, cluster, c, gpus) for c in found]
    if request.deadline_hours is not None:
        candidates = [c for c in candidates if c.total_time_s is not None and c.total_time_s <= request.deadline_hours * 3600]
    candidates.sort(key=lambda c: ((c.cost or 0.0) if request.objective == "cost" else 0.0, c.step_time_s))
    for c in candidates:
        if chosen is not None and not _worth_it(c, chosen, request):
            continue
        if chosen is None and waits_for is not None and c.step_time_s > WAIT_BOUND * waits_for.step_time_s:
            continue
        if placements := place_by_type(c.plan.gpus_by_type().items(), cluster.nodes, state.free_gpus, c.plan.tp):
            return Allocation(**dict(c), placements=placements)
    return None


def _worth_it(across: PlanCandidate, chosen: Allocation, request: TrainingRequest) -> bool:
    """Whether ``across`` beats ``chosen`` by MIXED_GAIN in the request's objective."""
    if request.objective == "cost" and across.cost is not None and chosen.cost is not None:
        return chosen.cost >= MIXED_GAIN * across.cost
    return chosen.step_time_s >= MIXED_GAIN * across.step_time_s


def _free_of(state: ClusterState, gpu_type: str) -> int:
    return sum(len(state.free_gpus.get(n.name, [])) for n in state.cluster.nodes if n.gpu_type == gpu_type)


def _candidate(
    model: ModelSpec, request: TrainingRequest, cluster: ClusterSpec, found: MixedCandidate, gpus: dict[str, GpuType]
) -> PlanCandidate:
    """``found`` as a candidate: each worker's fit on its type, the per-stage memory with each
    stage's own type's runtime, and the time and cost of all the request's steps."""
    plan = found.plan
    workers = [
        WorkerFit(
            gpu_type=t,
            peak_bytes=p,
            gpu_memory_bytes=gpus[t].memory_bytes,
            margin_bytes=cluster.memory_margin.bytes_for(gpus[t].memory_bytes),
        )
        for t, p in zip(plan.worker_types, found.peaks, strict=True)
    ]
    tightest = min(workers, key=lambda w: w.spare_bytes)
    total_s = found.step_s * request.steps
    by_type = plan.gpus_by_type()
    priced = all(t in cluster.prices for t in by_type)
    return PlanCandidate(
        gpu_type="+".join(by_type),
        plan=plan,
        memory=_memory(model, plan, request, gpus, tightest.gpu_type),
        gpu_memory_bytes=tightest.gpu_memory_bytes,
        margin_bytes=tightest.margin_bytes,
        step_time_s=found.step_s,
        total_time_s=total_s,
        cost=sum(cluster.prices[t] * n for t, n in by_type.items()) * total_s / 3600 if priced else None,
        workers=workers,
    )


def _memory(model: ModelSpec, plan: ParallelPlan, request: TrainingRequest, gpus: dict[str, GpuType], tightest: str) -> MemoryEstimate:
    """MARP's itemised estimate, each stage's runtime on its own type (replicas across types: the tightest's)."""
    tensors = estimate(model, plan, request.workload)
    types = plan.stage_types or (tightest,) * plan.pp
    return MemoryEstimate(
        per_stage=[
            stage.model_copy(update={"other": stage.other + on_device(stage.total, plan, gpus[t]) - stage.total})
            for stage, t in zip(tensors.per_stage, types, strict=True)
        ]
    )
