"""Why a pinned part of a plan (``TrainingRequest.plan``: a user's tp, pp, ...) leaves the search
no plan: the first constraint the pinned values break, with what the cluster would accept, rather
than a list of every constraint."""

from __future__ import annotations

from frenzy_prefect.allocator.space import divisors, pp_depths, tp_degrees
from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.spec.cluster import ClusterSpec
from frenzy_prefect.spec.gpu import GpuType
from frenzy_prefect.spec.layout import check_engine_plan, check_plan, check_resilience, tp_splits
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.request import TrainingRequest

Kinds = dict[str, tuple[GpuType, int, int]]  # per GPU type: the type, its GPU count, its largest node's


def unmet_pin(model: ModelSpec, request: TrainingRequest, cluster: ClusterSpec, kinds: Kinds) -> str | None:
    """The constraint the request's pin breaks on ``cluster`` (None: each pinned value is
    possible alone, and only their combination is not)."""
    return _unmet_shape(model, request, cluster, kinds) or _unmet_run(model, request)


def _unmet_shape(model: ModelSpec, request: TrainingRequest, cluster: ClusterSpec, kinds: Kinds) -> str | None:
    """A pinned degree outside the search: tp, pp, a dp or micro-batch that does not divide the batch, too many GPUs."""
    pin, n = request.plan, request.global_batch
    dp, tp, pp, mb = pin.dp or 1, pin.tp or 1, pin.pp or 1, pin.micro_batch or 1
    largest = max(node for _, _, node in kinds.values())
    most = max(total for _, total, _ in kinds.values())
    tps = sorted({t for _, _, node in kinds.values() for t in tp_degrees(model, node)})
    if tp not in tps:
        why = f"does not split {model.name}'s heads ({model.heads}), kv_heads, hidden and ffn evenly"
        if tp_splits(model, tp):
            why = f"does not fit in one node (the largest has {largest} GPUs)"
        return f"tp={tp} {why}; accepted on this cluster: {tps}"
    if pp not in pp_depths(model):
        why = f"exceeds {model.name}'s {model.layers} layers" if pp > model.layers else "is not a power of two"
        return f"pp={pp} {why}; accepted: {pp_depths(model)}"
    if n % dp:
        return f"dp={dp} does not divide global_batch ({n})"
    if (n // dp) % mb:
        return f"dp x micro_batch = {dp} x {mb} does not divide global_batch ({n}); micro-batches that do: {divisors(n // dp)[:12]}"
    if dp * tp * pp > most:
        gpus = f"{dp} x {tp} x {pp} = {dp * tp * pp}"
        return f"dp x tp x pp is at least {gpus} GPUs, and cluster {cluster.name!r} has at most {most} of one type"
    return None


def _unmet_run(model: ModelSpec, request: TrainingRequest) -> str | None:
    """A pinned ZeRO stage, precision or resilience the engine does not run with the other pinned
    values; those not pinned take the values most likely to run (dp and pp 2 under 'recycle')."""
    pin = request.plan
    recycle = request.resilience == "recycle"
    zero = pin.zero or 0
    plan = ParallelPlan(
        dp=pin.dp or (2 if recycle or zero else 1),
        tp=pin.tp or 1,
        pp=pin.pp or (2 if recycle else 1),
        micro_batch=pin.micro_batch or 1,
        zero=zero,
    )
    if zero and plan.dp < 2:
        return f"zero={zero} shards over data-parallel replicas: it needs dp >= 2"
    try:
        check_plan(model, plan)
        check_engine_plan(model, plan, request.precision, request.master_weights)
        check_resilience(plan, request.resilience, request.master_weights)
    except FrenzyError as exc:
        return str(exc)
    return None
