"""A run's restart after a Slurm node failure (``max_restarts``): where its new job goes.

When a node of the run's Slurm job fails (the job ends NODE_FAIL), the job cannot go on: Slurm
ends every step of it. So the watcher submits a new job, which resumes from the last complete
checkpoint as torchrun's own restarts do. Each node that failed is replaced by another node of
the same GPU type with at least as many GPUs, one that takes jobs now and is not already the
run's; among those, nodes that have not failed in this run first (a node set down by hand may
return at once with ``ReturnToService=2``), then the ones with the most GPUs free now (others'
jobs are respected). The other nodes stay. The run's TrainingJob moves with it: the replaced
placement names the new node and its address, so the ranks' accounts of a death name the
node they ran on. Core only: no Prefect, no subprocess.
"""

from __future__ import annotations

from frenzy_prefect.launch.slurm_inventory import SlurmNode
from frenzy_prefect.spec.plan import Placement, TrainingJob


def replacements(
    nodes: list[tuple[str, int]], lost: list[str], found: list[SlurmNode], failed_before: set[str]
) -> dict[str, SlurmNode] | None:
    """For each lost node, the node that takes its place (``found``: Slurm's nodes now), or None
    when one of them has no replacement."""
    by_name = {n.name: n for n in found}
    taken = {name for name, _ in nodes if name not in lost}
    counts = dict(nodes)
    chosen: dict[str, SlurmNode] = {}
    for node in lost:
        gpu_type = by_name[node].gpu_type if node in by_name else None
        fits = [
            n
            for n in found
            if n.schedulable and n.gpu_type == gpu_type and n.gpus >= counts[node] and n.name not in taken and n.name not in lost
        ]
        if not fits:
            return None
        best = min(fits, key=lambda n: (n.name in failed_before, -n.gpus_free, found.index(n)))
        chosen[node] = best
        taken.add(best.name)
    return chosen


def moved_nodes(nodes: list[tuple[str, int]], moves: dict[str, SlurmNode]) -> list[tuple[str, int]]:
    """The job's nodes in rank order, each lost one replaced."""
    return [(moves[name].name if name in moves else name, count) for name, count in nodes]


def moved_job(job: TrainingJob, moves: dict[str, SlurmNode]) -> TrainingJob:
    """``job`` with its placements on the lost nodes moved to their replacements (the GPU
    indices are Slurm's choice on the new node, as they were on the old one)."""
    placements = [
        Placement(node=moves[p.node].name, host=moves[p.node].addr, gpus=p.gpus) if p.node in moves else p
        for p in job.allocation.placements
    ]
    allocation = job.allocation.model_copy(update={"placements": placements})
    return job.model_copy(update={"allocation": allocation})
