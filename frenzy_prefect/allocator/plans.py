"""MARP's resource plans: every (GPU type, parallel plan) the engine can run, with predicted
memory and step time, in priority order."""

from __future__ import annotations

from collections.abc import Iterator

from frenzy_prefect.allocator.step_time import predict_step
from frenzy_prefect.errors import FrenzyError, NoFeasiblePlan
from frenzy_prefect.memory.analytic import estimate
from frenzy_prefect.spec.cluster import ClusterSpec
from frenzy_prefect.spec.gpu import GpuType
from frenzy_prefect.spec.layout import check_engine_plan, check_resilience, tp_splits, zero_runs_with
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import ParallelPlan, PlanCandidate
from frenzy_prefect.spec.request import TrainingRequest


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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


def plan_space(model: ModelSpec, global_batch: int, max_gpus: int, node_gpus: int) -> Iterator[ParallelPlan]:
    """Every plan the memory model covers, within ``max_gpus``: tensor parallelism inside one
    node (splitting heads, key/value heads, hidden and ffn evenly), pipeline depths in powers of two, ZeRO-1 with any of
    them, ZeRO-2 without pipelines, ZeRO-3 over data parallelism alone, and each recomputation mode."""
    tps = [t for t in _divisors(min(node_gpus, model.heads)) if tp_splits(model, t)]
    pps = [1 << k for k in range(model.layers.bit_length()) if 1 << k <= model.layers]
    for dp in _divisors(global_batch):
        for tp in tps:
            for pp in pps:
                if dp * tp * pp > max_gpus:
                    break
                zeros = [z for z in (0, 1, 2, 3) if zero_runs_with(z, tp, pp)] if dp > 1 else [0]
                for micro_batch in _divisors(global_batch // dp):
                    for zero in zeros:
                        for recompute in ("none", "selective", "full"):
                            yield ParallelPlan.model_construct(dp=dp, tp=tp, pp=pp, micro_batch=micro_batch, zero=zero, recompute=recompute)


def candidate_plans(model: ModelSpec, request: TrainingRequest, cluster: ClusterSpec) -> list[PlanCandidate]:
    """All candidates, fitting ones (predicted peak plus the cluster's memory margin within the
    GPU) first, each group by predicted step time (the job's steps
    are fixed, so this is its predicted completion time), then fewer GPUs (GPU-seconds), fewer
    accumulation steps, no recomputation. The plans: every plan the memory model covers
    (``plan_space``) that the training engine runs with the request's precision."""
    check_objective(request, cluster)
    workload = {"global_batch": request.global_batch, "seq_len": request.seq_len, "precision": request.precision}
    kinds = gpu_kinds(cluster)
    if request.precision == "bf16":
        kinds = {name: kind for name, kind in kinds.items() if kind[0].supports_bf16}
        if not kinds:
            raise NoFeasiblePlan(
                f"precision bf16 needs GPUs with bf16 support, and cluster {cluster.name!r} has none "
                f"({', '.join(gpu_kinds(cluster))}); request fp16 or fp32"
            )

    def runs(plan: ParallelPlan) -> bool:
        try:
            check_engine_plan(model, plan, request.precision, request.master_weights)
            check_resilience(plan, request.resilience, request.master_weights)
        except FrenzyError:
            return False
        return True

    out: list[PlanCandidate] = []
    for name, (gpu, total, largest) in kinds.items():
        margin = cluster.memory_margin.bytes_for(gpu.memory_bytes)
        for plan in plan_space(model, request.global_batch, total, largest):
            if not runs(plan) or (request.plan and not request.plan.admits(plan)):
                continue
            network = None if plan.gpus <= largest else cluster.network_gbps
            out.append(
                PlanCandidate(
                    gpu_type=name,
                    plan=plan,
                    memory=estimate(
                        model,
                        plan,
                        **workload,
                        optimizer_bytes_per_param=request.optimizer.state_bytes_per_parameter,
                        gpu=gpu,
                        attention=request.attention,
                        master_weights=request.master_weights,
                    ),
                    gpu_memory_bytes=gpu.memory_bytes,
                    margin_bytes=margin,
                    **_time_and_cost(
                        predict_step(model, plan, **workload, gpu=gpu, network_gbps=network).seconds, plan, name, request, cluster
                    ),
                )
            )
    if not out and request.resilience == "recycle":
        raise NoFeasiblePlan(
            f"resilience 'recycle' needs a pipeline plan with dp >= 2, pp >= 2, tp = 1 and zero 0, without master_weights"
            f"{' and ' + request.plan.label() if request.plan else ''}, and none fits cluster {cluster.name!r}: "
            "it needs at least 4 GPUs of one type"
        )
    if not out and request.plan:
        raise NoFeasiblePlan(
            f"no plan with {request.plan.label()} runs on cluster {cluster.name!r}: tp must split the heads evenly and stay "
            "within one node, pp at most the layers and a power of two, dp x tp x pp within one GPU type's count, "
            f"dp x micro_batch dividing global_batch ({request.global_batch}), zero 2 without pp, zero 3 without tp or pp"
        )
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
