"""The costs whose fault-free iteration lasts a measured step: the step a user measures with every
worker alive is ReCycle's own schedule without failures (what the runtime runs then, the
heuristic planner's), so the costs are inverted from that schedule, and every plan is measured
against the same planner's plan without failures (``planners.base.against_fault_free``).
"""

from __future__ import annotations

from frenzy_prefect.allocator.step_time import ring_all_reduce_factor
from frenzy_prefect.pipeline.costs import ZERO_BUBBLE_SPLIT, StageCosts
from frenzy_prefect.pipeline.in_flight import MemoryBound
from frenzy_prefect.pipeline.workers import check_shape
from frenzy_prefect.recycle.failures import RecycleInputError
from frenzy_prefect.recycle.planners import heuristic


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
    memory_bound: MemoryBound = None,
) -> StageCosts:
    """Per-action costs under which the heuristic planner's schedule without failures (under
    ``memory_bound``) lasts exactly ``step_s``. Assumptions: balanced stages; F : B : W = ``split``; a p2p send takes
    ``p2p_per_forward`` of a forward; the all-reduce over all dp peers and the optimizer step take
    ``allreduce_fraction`` and ``optimizer_fraction`` of the step (no all-reduce when dp = 1).
    Every compute and p2p cost scales with one unit, and the schedule's makespan is that unit times
    its makespan at unit cost plus the all-reduce and optimizer, so solving for the unit is exact
    (and list scheduling, which compares times only, plans the same schedule at any unit)."""
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
    scale = (step_s - allreduce - optimizer) / heuristic.plan(dp, pp, microbatches, (0,) * pp, unit, memory_bound).iteration_s
    transfer = allreduce / ring_all_reduce_factor(dp) if dp > 1 else 0.0
    return StageCosts.uniform(
        pp, f * scale, b * scale, w * scale, p2p=p2p_per_forward * f * scale, gradient_transfer=transfer, optimizer=optimizer
    )
