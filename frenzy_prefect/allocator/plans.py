"""MARP's resource plans: every (GPU type, parallel plan) the engine can run, with predicted
memory and step time, in priority order."""

from __future__ import annotations

from frenzy_prefect.allocator.pins import unmet_pin
from frenzy_prefect.allocator.space import MAX_PLANS, Shape, divisors, shapes
from frenzy_prefect.allocator.step_time import predict_step
from frenzy_prefect.errors import FrenzyError, NoFeasiblePlan
from frenzy_prefect.memory.analytic import estimate, recycle_estimate
from frenzy_prefect.memory.calibration import Calibration
from frenzy_prefect.spec.cluster import ClusterSpec
from frenzy_prefect.spec.gpu import GpuType
from frenzy_prefect.spec.layout import check_engine_plan, check_resilience
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import MemoryEstimate, ParallelPlan, PlanCandidate
from frenzy_prefect.spec.request import PlanPin, TrainingRequest


def gpu_kinds(cluster: ClusterSpec) -> dict[str, tuple[GpuType, int, int]]:
    """Per GPU type: the type (with the smallest memory any of its nodes declares), the total
    GPU count, and the largest node's GPU count."""
    kinds: dict[str, tuple[GpuType, int, int]] = {}
    for node in cluster.nodes:
        gpu = cluster.gpu_of(node)
        if node.gpu_type in kinds:
            known, total, largest = kinds[node.gpu_type]
            gpu = gpu if gpu.memory_bytes < known.memory_bytes else known
            kinds[node.gpu_type] = (gpu, total + node.gpu_count, max(largest, node.gpu_count))
        else:
            kinds[node.gpu_type] = (gpu, node.gpu_count, node.gpu_count)
    return kinds


def searched_shapes(model: ModelSpec, request: TrainingRequest, max_gpus: int, node_gpus: int) -> list[Shape]:
    """The plan space on one GPU type (``space.shapes``) less the plans the training engine does
    not run with the request's precision and resilience, and those its pin excludes."""
    pin = request.plan or PlanPin()
    out = []
    for shape in shapes(model, request.global_batch, max_gpus, node_gpus):
        if any(want is not None and want != got for want, got in ((pin.dp, shape.dp), (pin.tp, shape.tp), (pin.pp, shape.pp))):
            continue
        zeros = tuple(z for z in shape.zeros if pin.zero in (None, z) and _runs(model, shape, z, request))
        micro_batches = tuple(m for m in shape.micro_batches if pin.micro_batch in (None, m))
        recomputes = tuple(r for r in shape.recomputes if pin.recompute in (None, r))
        if zeros and micro_batches and recomputes:
            out.append(shape._replace(micro_batches=micro_batches, zeros=zeros, recomputes=recomputes))
    return out


def _runs(model: ModelSpec, shape: Shape, zero: int, request: TrainingRequest) -> bool:
    """Whether the engine runs (dp, tp, pp, zero) with the request (the micro-batch and recomputation do not matter)."""
    plan = ParallelPlan.model_construct(dp=shape.dp, tp=shape.tp, pp=shape.pp, micro_batch=1, zero=zero, recompute="none")
    try:
        check_engine_plan(model, plan, request.precision, request.master_weights)
        check_resilience(plan, request.resilience, request.master_weights)
    except FrenzyError:
        return False
    return True


def candidate_plans(
    model: ModelSpec, request: TrainingRequest, cluster: ClusterSpec, calibration: Calibration | None = None
) -> list[PlanCandidate]:
    """All candidates, fitting ones (predicted peak plus the cluster's memory margin within the
    GPU) first, each group by predicted step time (the job's steps
    are fixed, so this is its predicted completion time), then fewer GPUs (GPU-seconds), fewer
    accumulation steps, no recomputation. The plans: every plan the memory model covers
    (``space.plan_space``) that the training engine runs with the request's precision, counted
    first: a search larger than MAX_PLANS is refused, naming its size. ``calibration``: the GPU
    terms to estimate with (default: the loaded calibration file's; allocator/learning.py's
    ``applied`` gives what a cluster's runs taught)."""
    check_objective(request, cluster)
    kinds = usable_kinds(request, cluster)
    searched = {name: searched_shapes(model, request, total, largest) for name, (_, total, largest) in kinds.items()}
    _check_search_size(request, cluster, sum(s.size for found in searched.values() for s in found))
    work = request.workload
    out: list[PlanCandidate] = []
    for name, (gpu, _, largest) in kinds.items():
        margin = cluster.memory_margin.bytes_for(gpu.memory_bytes)
        for plan in (plan for shape in searched[name] for plan in shape.plans()):
            network = None if plan.gpus <= largest else cluster.network_gbps
            step_s = predict_step(model, plan, work, gpu=gpu, network_gbps=network).seconds
            out.append(
                PlanCandidate(
                    gpu_type=name,
                    plan=plan,
                    memory=_memory(model, plan, request, gpu, calibration),
                    gpu_memory_bytes=gpu.memory_bytes,
                    margin_bytes=margin,
                    **_time_and_cost(step_s, plan, name, request, cluster),
                )
            )
    if not out:
        raise NoFeasiblePlan(_nothing_runs(model, request, cluster, kinds))
    out = _within_deadline(out, request, cluster)
    out.sort(
        key=lambda c: (
            not c.fits,
            c.cost if request.objective == "cost" else 0.0,
            c.step_time_s,
            c.plan.gpus,
            c.plan.accumulation(request.global_batch),
            c.plan.recompute != "none",
        )
    )
    return out


def _memory(
    model: ModelSpec, plan: ParallelPlan, request: TrainingRequest, gpu: GpuType, calibration: Calibration | None
) -> MemoryEstimate:
    """MARP's estimate of ``plan``; under ReCycle, over its schedules with the request's failures re-routed."""
    if request.resilience == "recycle":
        return recycle_estimate(model, plan, request.workload, failures=request.recycle_failures, gpu=gpu, calibration=calibration)
    return estimate(model, plan, request.workload, gpu=gpu, calibration=calibration)


def usable_kinds(request: TrainingRequest, cluster: ClusterSpec) -> dict[str, tuple[GpuType, int, int]]:
    """The cluster's GPU types that run the request's precision (``gpu_kinds``)."""
    kinds = gpu_kinds(cluster)
    if request.precision != "bf16":
        return kinds
    usable = {name: kind for name, kind in kinds.items() if kind[0].supports_bf16}
    if not usable:
        raise NoFeasiblePlan(
            f"precision bf16 needs GPUs with bf16 support, and cluster {cluster.name!r} has none ({', '.join(kinds)}); request fp16 or fp32"
        )
    return usable


def _check_search_size(request: TrainingRequest, cluster: ClusterSpec, plans: int) -> None:
    if plans > MAX_PLANS:
        n = request.global_batch
        raise NoFeasiblePlan(
            f"the plan search for global_batch {n:,} on cluster {cluster.name!r} spans {plans:,} plans, more than the "
            f"{MAX_PLANS:,} it covers (about a second); pin part of the plan (frenzy plan --tp/--pp, a request's 'plan') "
            f"or use a global batch with fewer divisors ({n:,} has {len(divisors(n))})"
        )


def _nothing_runs(model: ModelSpec, request: TrainingRequest, cluster: ClusterSpec, kinds: dict) -> str:
    """Why the search found no plan at all: the pinned value that fails, else what resilience
    'recycle' or the pin needs of the cluster."""
    if request.plan and (reason := unmet_pin(model, request, cluster, kinds)):
        return f"no plan with {request.plan.label()} runs on cluster {cluster.name!r}: {reason}"
    if request.resilience == "recycle":
        return (
            f"resilience 'recycle' needs a pipeline plan with dp >= 2, pp >= 2, tp = 1 and zero 0, without master_weights"
            f"{' and ' + request.plan.label() if request.plan else ''}, and none fits cluster {cluster.name!r}: "
            "it needs at least 4 GPUs of one type"
        )
    pinned = request.plan.label() if request.plan else "nothing pinned"
    return (
        f"no plan with {pinned} runs on cluster {cluster.name!r}: tp must split the heads evenly and stay within one node, "
        "pp at most the layers and a power of two, dp x tp x pp within one GPU type's count, "
        f"dp x micro_batch dividing global_batch ({request.global_batch}), zero 2 without pp, zero 3 without tp or pp"
    )


def _time_and_cost(step_s: float, plan: ParallelPlan, gpu_type: str, request: TrainingRequest, cluster: ClusterSpec) -> dict:
    """A plan's predicted step time, time for all the request's steps, and their cost at the
    cluster's price of its GPU type (None without one)."""
    total_s = step_s * request.steps
    price = cluster.prices.get(gpu_type)
    return {"step_time_s": step_s, "total_time_s": total_s, "cost": None if price is None else total_s / 3600 * plan.gpus * price}


def check_objective(request: TrainingRequest, cluster: ClusterSpec) -> None:
    """Objective 'cost' needs a price for every GPU type of the cluster."""
    missing = sorted({n.gpu_type for n in cluster.nodes} - cluster.prices.keys())
    if request.objective == "cost" and missing:
        raise NoFeasiblePlan(
            f"objective 'cost' needs the price of a GPU-hour of every type in cluster {cluster.name!r}; "
            f"add prices for {', '.join(missing)} (e.g. 'prices: {{{missing[0]}: 1.2}}' in the cluster file) or use objective 'time'"
        )


def _within_deadline(candidates: list[PlanCandidate], request: TrainingRequest, cluster: ClusterSpec) -> list[PlanCandidate]:
    """The candidates predicted to finish within the request's deadline (all without one); none
    among those that fit: NoFeasiblePlan naming the fastest fitting plan's time."""
    if request.deadline_hours is None:
        return candidates
    fitting = [c for c in candidates if c.fits]
    kept = [c for c in candidates if c.total_time_s <= request.deadline_hours * 3600]
    if fitting and not any(c.fits for c in kept):
        fastest = min(fitting, key=lambda c: c.total_time_s)
        raise NoFeasiblePlan(
            f"no plan on cluster {cluster.name!r} is predicted to finish {request.steps} steps within {request.deadline_hours:g} h: "
            f"the fastest, {fastest.plan.label()} on {fastest.plan.gpus} x {fastest.gpu_type}, takes {fastest.total_time_s / 3600:.2f} h"
        )
    return kept
