"""Plans across GPU types (issue 31): a pipeline whose stages run on different types, or
data-parallel replicas on different types, the work split by each type's speed within its memory.

As Metis (Um et al., ATC'24) and FlashFlex do, a split follows each type's achievable
throughput (its dense peak at its achievable fraction, ``speed``: the split that makes the
slowest stage or replica least slow, ``balanced``) under the memory limits: where that split
does not fit, each stage takes at most the layers that fit its type (``layer_cap``); when the
caps hold fewer than the model's layers, the plan does not fit. Only what the engine trains is
searched (``tests/stack/test_mixed.py``; the simulator may ask for every plan the memory model covers):
stages across types (any dp, each replica's stages alike) with an uneven layer split, or replicas
across types (pp 1) with an uneven micro-batch split; tp 1, ZeRO 0, no recomputation or full
recomputation.

The search is bounded: two types at a time; data parallelism over the global batch's divisors;
every free GPU of the faster type, and 1, 2, 4, ... up to every free GPU of the slower (a slow
type's GPUs may cost more in bubbles and transfers than they add); the faster type first along the pipeline
(its stage holds the embedding); micro-batches of 1, 2, 4 or 8, without recomputation or with
full recomputation. Each candidate costs one MARP
estimate and one step-time prediction (``step_time.predict_mixed_step``)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import NamedTuple

from frenzy_prefect.allocator.plans import gpu_kinds
from frenzy_prefect.allocator.space import MAX_PLANS, divisors
from frenzy_prefect.allocator.step_time import flops_per_token, peak_flops, predict_mixed_step
from frenzy_prefect.errors import FrenzyError, NoFeasiblePlan
from frenzy_prefect.memory.analytic import on_device, plan_search
from frenzy_prefect.spec.cluster import ClusterSpec
from frenzy_prefect.spec.gpu import GpuType, MemoryMargin
from frenzy_prefect.spec.layout import check_engine_plan
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import ParallelPlan, even_layers
from frenzy_prefect.spec.workload import Workload

# A plan across types is worth choosing only when no single type's GPUs hold the job, or when it is
# predicted at least this much faster than the best single-type plan: its cross-type transfers
# are the step-time model's least certain part, and a mixed job ties two pools' GPUs together.
MIXED_GAIN = 1.1
MICRO_BATCHES = (1, 2, 4, 8)
RECOMPUTES = ("none", "full")


class MixedCandidate(NamedTuple):
    plan: ParallelPlan
    step_s: float
    peaks: tuple[int, ...]  # each stage's (stage types) or replica's (replica types) predicted bytes on its type


def worth_mixing(mixed_s: float, single_s: float | None) -> bool:
    """Whether a mixed plan of step ``mixed_s`` beats the best fitting single-type plan's
    ``single_s`` (None: none fits) by MIXED_GAIN."""
    return single_s is None or single_s >= MIXED_GAIN * mixed_s


def speed(gpu: GpuType, precision: str) -> float:
    """A type's achievable throughput, FLOP/s."""
    return peak_flops(gpu, precision) * gpu.achievable_fraction


def fastest_possible_s(model: ModelSpec, work: Workload, gpus: list[tuple[GpuType, int]]) -> float:
    """A step time no plan across ``gpus`` (each type with its count) beats: the step's compute
    without recomputation spread over every GPU at its type's achievable throughput, with no
    bubble, transfer or idle worker (a worker's time is its work over its speed, and the step
    waits for the slowest)."""
    flops = work.global_batch * work.seq_len * flops_per_token(model, work.seq_len)
    return flops / sum(speed(gpu, work.precision) * n for gpu, n in gpus)


def balanced(total: int, speeds: list[float], caps: list[int] | None = None) -> tuple[int, ...]:
    """``total`` whole units (layers, micro-batches) dealt to workers of ``speeds``, at least one
    each and at most ``caps`` (if given), so that the slowest worker's time (units / speed) is
    least: the least time t at which the workers could do ``total`` (each max(1, floor(t x
    speed)) up to its cap), found by bisection, then any units beyond ``total`` taken back from
    the workers that would finish last."""
    bounds = caps or [total] * len(speeds)
    if total < len(speeds) or sum(bounds) < total:
        raise FrenzyError(f"{total} units cannot give each of {len(speeds)} parts one, within at most {'/'.join(map(str, bounds))}")

    def counts(t: float) -> list[int]:
        return [min(cap, max(1, math.floor(t * s))) for s, cap in zip(speeds, bounds, strict=True)]

    low, high = 0.0, total / min(speeds)  # at ``high`` each could do them all alone: the caps bind
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (low, middle) if sum(counts(middle)) >= total else (middle, high)
    dealt = counts(high)
    for _ in range(sum(dealt) - total):
        last = max((i for i in range(len(speeds)) if dealt[i] > 1), key=lambda i: dealt[i] / speeds[i])
        dealt[last] -= 1
    return tuple(dealt)


def worker_peaks(model: ModelSpec, plan: ParallelPlan, work: Workload, gpus: dict[str, GpuType]) -> tuple[int, ...]:
    """MARP's peak of each stage (``stage_types``) or replica (``replica_types``) on its own type:
    its tensors with its own layers and micro-batches in flight, and its type's runtime around them."""
    tensors = [sum(stage) for stage in plan_search(model, work).stage_peaks(plan)]  # (tuples: this runs per move of fit_layers)
    if plan.stage_types:
        return tuple(on_device(s, plan, gpus[t]) for s, t in zip(tensors, plan.stage_types, strict=True))
    return tuple(on_device(max(tensors), plan, gpus[t]) for t in plan.replica_types)


def _room(plan: ParallelPlan, peaks: tuple[int, ...], gpus: dict[str, GpuType], margin: MemoryMargin) -> tuple[int, ...]:
    """What each stage or replica (``peaks``: theirs) leaves of its type's memory less margin
    (negative: its shortfall)."""
    return tuple(gpus[t].memory_bytes - margin.bytes_for(gpus[t].memory_bytes) - p for t, p in zip(plan.worker_types, peaks, strict=True))


def fit_layers(
    model: ModelSpec, plan: ParallelPlan, work: Workload, gpus: dict[str, GpuType], margin: MemoryMargin
) -> tuple[ParallelPlan, tuple[int, ...]] | None:
    """``plan`` (with ``stage_types``) with its layers split by its stages' speeds, and its
    stages' peaks; where that split does not fit, split again with each stage at most the layers
    that fit its type (``layer_cap``); None when the caps hold fewer than the model's layers."""
    speeds = [speed(gpus[t], work.precision) for t in plan.stage_types]

    def fitted(split: tuple[int, ...]) -> tuple[ParallelPlan, tuple[int, ...]] | None:
        candidate = plan.model_copy(update={"stage_layers": split})
        peaks = worker_peaks(model, candidate, work, gpus)
        return (candidate, peaks) if min(_room(candidate, peaks, gpus, margin)) >= 0 else None

    if found := fitted(balanced(model.layers, speeds)):
        return found
    caps = [layer_cap(model, plan, work, gpus[t], margin, stage) for stage, t in enumerate(plan.stage_types)]
    if min(caps) == 0 or sum(caps) < model.layers:
        return None
    return fitted(balanced(model.layers, speeds, caps))  # (a stage's peak grows with its own layers alone: checked all the same)


def layer_cap(model: ModelSpec, plan: ParallelPlan, work: Workload, gpu: GpuType, margin: MemoryMargin, stage: int) -> int:
    """The most layers ``stage`` of ``plan`` fits on ``gpu`` less ``margin`` (0: not one), each
    other stage keeping at least one; by bisection, as its peak grows with its layers and does not
    depend on the other stages' (they are spread evenly meanwhile)."""
    search, room = plan_search(model, work), gpu.memory_bytes - margin.bytes_for(gpu.memory_bytes)

    def fits(layers: int) -> bool:
        rest = even_layers(model.layers - layers, plan.pp - 1) if plan.pp > 1 else ()
        split = (*rest[:stage], layers, *rest[stage:])
        trial = plan.model_copy(update={"stage_layers": split})
        return on_device(sum(search.stage_peaks(trial, [stage])[0]), trial, gpu) <= room

    low, high = 0, model.layers - plan.pp + 1  # low fits (0 trivially); find the most that does
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def mixed_candidates(
    model: ModelSpec,
    work: Workload,
    free: dict[str, tuple[GpuType, int]],
    margin: MemoryMargin,
    network_gbps: float,
    engine_only: bool = True,
) -> list[MixedCandidate]:
    """Every fitting plan of the bounded search over two of ``free``'s types (name -> (type, free
    GPUs)), fastest first. ``engine_only``: only plans the training engine runs with the
    workload's precision (the scheduling simulator plans, as its single-type frontier does,
    over every plan the memory model covers)."""
    out: list[MixedCandidate] = []
    gpus = {name: gpu for name, (gpu, _) in free.items()}
    by_speed = sorted(free, key=lambda n: -speed(free[n][0], work.precision))
    pairs = [{name: free[name] for name in (fast, slow)} for i, fast in enumerate(by_speed) for slow in by_speed[i + 1 :]]
    shapes = [fields for pair in pairs for fields in _shapes(model, work, pair)]
    if len(shapes) > MAX_PLANS:
        raise NoFeasiblePlan(
            f"the search across GPU types for global_batch {work.global_batch:,} spans {len(shapes):,} plans, more than the "
            f"{MAX_PLANS:,} it covers; use a global batch with fewer divisors, or fewer GPU types"
        )
    for fields in shapes:
        if "replica_types" in fields:  # micro-batches dealt by speed
            samples = work.global_batch // fields["micro_batch"]
            fields["replica_micro_batches"] = balanced(samples, [speed(gpus[t], work.precision) for t in fields["replica_types"]])
        plan = ParallelPlan(**fields)
        if engine_only and not _engine_runs(model, plan, work):
            continue
        if plan.stage_types:
            if (fitted := fit_layers(model, plan, work, gpus, margin)) is None:
                continue
            plan, peaks = fitted
        elif min(_room(plan, peaks := worker_peaks(model, plan, work, gpus), gpus, margin)) < 0:
            continue
        step = predict_mixed_step(model, plan, work, gpus=gpus, network_gbps=network_gbps).seconds
        out.append(MixedCandidate(plan, step, peaks))
    return sorted(out, key=lambda c: (c.step_s, c.plan.gpus))


def _engine_runs(model: ModelSpec, plan: ParallelPlan, work: Workload) -> bool:
    try:
        check_engine_plan(model, plan, work.precision, work.master_weights)
    except FrenzyError:
        return False
    return True


def _shapes(model: ModelSpec, work: Workload, pair: dict[str, tuple[GpuType, int]]) -> Iterator[dict]:
    """The searched plans over the two types of ``pair`` (faster first; name -> (type, free
    GPUs)), as ParallelPlan fields, before they are checked and fitted: stages across the types
    (each replica alike), or replicas across them."""
    (fast, (_, fast_free)), (slow, (_, slow_free)) = pair.items()
    for recompute, micro_batch in itertools.product(RECOMPUTES, (m for m in MICRO_BATCHES if work.global_batch % m == 0)):
        samples = work.global_batch // micro_batch  # micro-batches per step, over every replica
        common = {"micro_batch": micro_batch, "recompute": recompute}
        for dp in (d for d in divisors(samples) if d <= min(fast_free, slow_free)):
            fast_stages = min(fast_free // dp, model.layers - 1)  # every fast GPU: the slow ones are what may not pay
            for slow_stages in _counts(min(slow_free // dp, model.layers - fast_stages)):
                types = (fast,) * fast_stages + (slow,) * slow_stages
                yield {"dp": dp, "pp": len(types), "stage_types": types, **common}
        fast_replicas = min(fast_free, samples - 1)
        for slow_replicas in _counts(min(slow_free, samples - fast_replicas)):
            yield {"dp": fast_replicas + slow_replicas, "replica_types": (fast,) * fast_replicas + (slow,) * slow_replicas, **common}


def _counts(most: int) -> list[int]:
    """How many of the slower type's GPUs are tried: the powers of two below ``most``, and ``most``
    (the step-time gain of one more slow GPU shrinks as they are added; 1..most made the search quadratic)."""
    return [*(2**k for k in range(most.bit_length()) if 2**k < most), most] if most > 0 else []


def cluster_candidates(model: ModelSpec, work: Workload, cluster: ClusterSpec) -> list[MixedCandidate]:
    """``mixed_candidates`` over ``cluster``'s types, every GPU free."""
    free = {name: (gpu, total) for name, (gpu, total, _) in gpu_kinds(cluster).items()}
    return mixed_candidates(model, work, free, cluster.memory_margin, cluster.network_gbps)


def across_types_hint(model: ModelSpec, work: Workload, cluster: ClusterSpec) -> str | None:
    """Where no plan on one of ``cluster``'s types fits: the fastest plan across two of its types
    that would (every GPU free), in a sentence for the error, or None."""
    try:
        found = cluster_candidates(model, work, cluster)  # (no pairs, no plans: one type)
    except NoFeasiblePlan:  # a search too large to hint from
        return None
    if not found:
        return None
    return (
        f"across GPU types a plan would fit: {found[0].plan.label()}, predicted {found[0].step_s:.3g} s a step "
        "(`frenzy plan --mixed` shows them; HAS allocates one where the free GPUs hold it, for a run with no plan pinned and "
        "resilience 'restart')"
    )
