"""What a job can run as on one GPU type: MARP's fitting plans reduced to their frontier (for
each GPU count, the fastest plan; then only counts that are faster than every smaller one),
and the plan a memory-unaware user would run. Cached: a trace has a handful of job shapes.

A plan fits as HAS decides it (allocator/plans.py): its estimated peak plus the cluster's
memory margin within the GPU. After a job ran out of memory its estimates are scaled up by
what the failure proved (``underestimate``: the truth exceeded the GPU where the estimate was
below it by that factor), so the plan that failed, and any as tight, no longer fit."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from frenzy_prefect.allocator.mixed import fastest_possible_s, mixed_candidates, worker_peaks
from frenzy_prefect.allocator.space import plan_space
from frenzy_prefect.allocator.step_time import predict_mixed_step, predict_step
from frenzy_prefect.memory.analytic import peak_bytes, plan_search
from frenzy_prefect.profiling.model import PRESETS
from frenzy_prefect.scheduling.jobs import PRECISION, SEQ_LEN
from frenzy_prefect.spec.gpu import GpuType, MemoryMargin
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.workload import Workload


@dataclass(frozen=True, slots=True)
class Option:
    gpu_type: str
    plan: ParallelPlan
    peak_bytes: int
    step_s: float  # all GPUs in one node
    spread_step_s: float  # the placement spans nodes
    gpus: int  # plan.gpus, read in every decision

    def step_time(self, nodes: int) -> float:
        return self.step_s if nodes == 1 else self.spread_step_s

    @property
    def by_type(self) -> tuple[tuple[str, int], ...]:
        """GPUs of each type (as ``MixedOption.by_type``)."""
        return ((self.gpu_type, self.gpus),)


def _workload(global_batch: int) -> Workload:
    """A trace job's step: its global batch of SEQ_LEN-token sequences, in PRECISION, with AdamW."""
    return Workload(global_batch=global_batch, seq_len=SEQ_LEN, precision=PRECISION)


@cache
def option(model: str, global_batch: int, gpu: GpuType, plan: ParallelPlan, network_gbps: float) -> Option:
    """``plan`` on ``gpu`` with its predicted peak and step times (in one node; across nodes)."""
    spec = PRESETS[model]
    work = _workload(global_batch)
    peak = peak_bytes(spec, plan, work, gpu=gpu)
    inside = predict_step(spec, plan, work, gpu=gpu).seconds
    across = inside if plan.gpus == 1 else predict_step(spec, plan, work, gpu=gpu, network_gbps=network_gbps).seconds
    return Option(gpu_type=gpu.name, plan=plan, peak_bytes=peak, step_s=inside, spread_step_s=across, gpus=plan.gpus)


@cache
def frontier(
    model: str,
    global_batch: int,
    gpu: GpuType,
    max_gpus: int,
    node_gpus: int,
    network_gbps: float,
    margin_bytes: int = 0,
    underestimate: float = 1.0,
) -> tuple[Option, ...]:
    """The fitting plans on ``gpu`` worth running, by GPU count ascending, each strictly faster
    than every smaller one (step time as placed: one node if the plan fits in one). A plan fits
    when its estimated peak x ``underestimate`` + ``margin_bytes`` is within the GPU."""
    spec = PRESETS[model]
    work = _workload(global_batch)
    best: dict[int, tuple[float, ParallelPlan]] = {}
    memory = plan_search(spec, work, gpu)
    for plan in plan_space(spec, global_batch, max_gpus, node_gpus):
        peak = memory.peak_bytes(plan)
        if peak * underestimate + margin_bytes > gpu.memory_bytes:
            continue
        network = None if plan.gpus <= node_gpus else network_gbps
        t = predict_step(spec, plan, work, gpu=gpu, network_gbps=network).seconds
        if plan.gpus not in best or t < best[plan.gpus][0]:
            best[plan.gpus] = (t, plan)
    out: list[Option] = []
    last = math.inf
    for gpus in sorted(best):
        t, plan = best[gpus]
        if t < last:
            out.append(option(model, global_batch, gpu, plan, network_gbps))
            last = t
    return tuple(out)


@dataclass(frozen=True, slots=True)
class MixedOption:
    """A plan across GPU types (``plan.stage_types`` or ``replica_types``) with each stage's or
    replica's estimated peak on its type and the predicted step (always across nodes)."""

    plan: ParallelPlan
    peaks: tuple[int, ...]
    step_s: float
    gpus: int
    by_type: tuple[tuple[str, int], ...]  # GPUs of each type

    @classmethod
    def of(cls, plan: ParallelPlan, peaks: tuple[int, ...], step_s: float) -> MixedOption:
        return cls(plan, peaks, step_s, plan.gpus, tuple(plan.gpus_by_type().items()))

    @property
    def gpu_type(self) -> str:
        return "+".join(t for t, _ in self.by_type)

    def fits(self, gpu: dict[str, GpuType], margin: MemoryMargin, underestimate: float) -> bool:
        """Whether every stage or replica fits its type with its estimate x ``underestimate`` plus the margin."""
        return all(
            p * underestimate + margin.bytes_for(gpu[t].memory_bytes) <= gpu[t].memory_bytes
            for p, t in zip(self.peaks, self.plan.worker_types, strict=True)
        )


def fastest_across_s(model: str, global_batch: int, free: tuple[tuple[GpuType, int], ...]) -> float:
    """A step time no plan across the ``free`` GPUs beats (``allocator.mixed.fastest_possible_s``)."""
    return fastest_possible_s(PRESETS[model], _workload(global_batch), list(free))


@cache
def mixed_options(
    model: str, global_batch: int, free: tuple[tuple[GpuType, int], ...], margin: MemoryMargin, network_gbps: float
) -> tuple[MixedOption, ...]:
    """``allocator.mixed``'s plans across two of the ``free`` types (each with its free GPUs),
    fastest first, over every plan the memory model covers (as ``frontier``)."""
    named = {g.name: (g, n) for g, n in free}
    found = mixed_candidates(PRESETS[model], _workload(global_batch), named, margin, network_gbps, engine_only=False)
    return tuple(MixedOption.of(c.plan, c.peaks, c.step_s) for c in found)


@cache
def mixed_option(model: str, global_batch: int, plan: ParallelPlan, gpus: tuple[GpuType, ...], network_gbps: float) -> MixedOption:
    """``plan`` across the types it names (among ``gpus``) with its estimated peaks and step time."""
    spec, work, named = PRESETS[model], _workload(global_batch), {g.name: g for g in gpus}
    step = predict_mixed_step(spec, plan, work, gpus=named, network_gbps=network_gbps).seconds
    return MixedOption.of(plan, worker_peaks(spec, plan, work, named), step)


@cache
def naive_plans(global_batch: int, requested_gpus: int, largest_pool: int) -> tuple[ParallelPlan, ...]:
    """What a user without a memory model runs, attempt after attempt: plain data parallelism
    on the requested GPUs (at most the largest pool; as many as divide the batch), one
    micro-batch per step; after each out-of-memory failure twice the GPUs while the pool and
    the batch allow, then half the micro-batch (accumulating), then full recomputation."""
    limit = min(largest_pool, global_batch)
    dp = max(d for d in range(1, min(requested_gpus, limit) + 1) if global_batch % d == 0)
    micro_batch, recompute = global_batch // dp, "none"
    ladder = [ParallelPlan(dp=dp, micro_batch=micro_batch)]
    while True:
        if dp * 2 <= limit and global_batch % (dp * 2) == 0:
            dp *= 2
            micro_batch = global_batch // dp
        elif micro_batch > 1:
            micro_batch //= 2
        elif recompute == "none":
            recompute = "full"
        else:
            return tuple(ladder)
        ladder.append(ParallelPlan(dp=dp, micro_batch=micro_batch, recompute=recompute))
