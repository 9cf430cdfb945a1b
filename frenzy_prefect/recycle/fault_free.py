"""The fault-free baseline: the 1F1B iteration time of given costs, and the costs whose fault-free
iteration lasts a measured step.

Above both ``costs`` (what an action costs) and ``timeline`` (when actions run under those costs):
inverting a step time needs the timeline, and the timeline needs the costs, so the inversion
lives here rather than on ``StageCosts``.
"""

from __future__ import annotations

from functools import lru_cache

from frenzy_prefect.allocator.step_time import ring_all_reduce_factor
from frenzy_prefect.pipeline.builder import one_f_one_b
from frenzy_prefect.pipeline.costs import ZERO_BUBBLE_SPLIT, StageCosts
from frenzy_prefect.pipeline.timeline import iteration_s
from frenzy_prefect.pipeline.workers import check_shape
from frenzy_prefect.recycle.failures import RecycleInputError


@lru_cache(maxsize=64)
def fault_free_iteration_s(costs: StageCosts, dp: int, pp: int, microbatches: int) -> float:
    """The iteration time of the fault-free 1F1B schedule (the baseline of relative throughput);
    every plan of a cache shares it, so it is computed once per costs and shape."""
    return iteration_s(one_f_one_b(dp, pp, microbatches), costs)


def costs_from_fault_free_step(
    step_s: float,
    dp: int,
    pp: int,
    microbatches: int,
    *,
    split: tuple[float, float, float] = ZERO_BUBBLE_SPLIT,
    p2p_per_forward: float = 0.05,
    allreduce_fraction: float = 0.05,
    optimizer_fraction: float = 0.01,
) -> StageCosts:
    """Per-action costs whose fault-free 1F1B iteration (``fault_free_iteration_s``) lasts exactly
    ``step_s``. Assumptions: balanced stages; F : B : W = ``split``; a p2p send takes
    ``p2p_per_forward`` of a forward; the all-reduce over all dp peers and the optimizer step take
    ``allreduce_fraction`` and ``optimizer_fraction`` of the step (no all-reduce when dp = 1).
    Every compute and p2p cost scales with one unit, and the makespan is that unit times the
    makespan at unit cost plus the all-reduce and optimizer, so solving for the unit is exact."""
    check_shape(dp, pp, microbatches)
    if not step_s > 0:
        raise RecycleInputError(f"step_s must be positive, got {step_s!r}")
    if min(split) <= 0:
        raise RecycleInputError(f"split (F, B, W) must be positive ratios, got {split}")
    if allreduce_fraction < 0 or optimizer_fraction < 0 or allreduce_fraction + optimizer_fraction >= 1:
        raise RecycleInputError(
            f"allreduce_fraction ({allreduce_fraction}) and optimizer_fraction ({optimizer_fraction}) must be >= 0 and sum below 1"
        )
    f, b, w = split
    allreduce = allreduce_fraction * step_s if dp > 1 else 0.0
    optimizer = optimizer_fraction * step_s
    unit = StageCosts.uniform(pp, f, b, w, p2p=p2p_per_forward * f)
    scale = (step_s - allreduce - optimizer) / fault_free_iteration_s(unit, dp, pp, microbatches)
    transfer = allreduce / ring_all_reduce_factor(dp) if dp > 1 else 0.0
    return StageCosts.uniform(
        pp, f * scale, b * scale, w * scale, p2p=p2p_per_forward * f * scale, gradient_transfer=transfer, optimizer=optimizer
    )
