"""Stage 1 of HAS: the first plan, in priority order, that the free GPUs can hold."""

from __future__ import annotations

from frenzy_prefect.allocator.placement import place_by_type
from frenzy_prefect.errors import ClusterBusy, NoFeasiblePlan
from frenzy_prefect.spec.cluster import ClusterState
from frenzy_prefect.spec.plan import Allocation, PlanCandidate
from frenzy_prefect.units import gib


def allocate(candidates: list[PlanCandidate], state: ClusterState) -> Allocation:
    """``candidates`` as ``candidate_plans`` returns them (priority order)."""
    cluster = state.cluster
    if not candidates:
        raise NoFeasiblePlan(f"no candidate plans for cluster {cluster.name!r}")
    feasible = [c for c in candidates if c.fits]
    if not feasible:
        smallest = min(candidates, key=lambda c: c.memory.peak_bytes)
        closest = max(candidates, key=lambda c: c.spare_bytes)
        biggest_gpu, node = max(((cluster.gpu_of(n), n) for n in cluster.nodes), key=lambda g: g[0].memory_bytes)
        raise NoFeasiblePlan(
            f"no GPU type in cluster {cluster.name!r} can hold this job under any plan: the smallest "
            f"per-GPU requirement found is {gib(smallest.memory.peak_bytes, 2)} GiB ({smallest.plan.label()} on "
            f"{smallest.gpu_type}), the largest GPU available is {node.gpu_type} with "
            f"{gib(biggest_gpu.memory_bytes, 2)} GiB (node {node.name}); the closest plan, {closest.plan.label()} on "
            f"{closest.gpu_type}, is {gib(-closest.spare_bytes, 2)} GiB short: {gib(closest.memory.peak_bytes, 2)} GiB predicted "
            f"+ {gib(closest.margin_bytes, 2)} GiB margin > {gib(closest.gpu_memory_bytes, 2)} GiB"
        )
    for c in feasible:
        placements = place_by_type(((c.gpu_type, c.plan.gpus),), cluster.nodes, state.free_gpus, group=c.plan.tp)
        if placements:
            return Allocation(**dict(c), placements=placements)
    fewest = min(feasible, key=lambda c: c.plan.gpus)
    raise ClusterBusy(
        f"{len(feasible)} plans fit cluster {cluster.name!r}, but not its free GPUs now; the smallest needs "
        f"{fewest.plan.gpus} x {fewest.gpu_type}"
    )
