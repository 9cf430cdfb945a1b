"""A run's restart after a node failure (``max_restarts``), on Slurm or Kubernetes: where its
new job goes.

When a node of the run fails (its Slurm job ends NODE_FAIL, its pod is evicted from a lost
node), the job cannot go on where it was, so the launcher's watcher submits a new one, which
resumes from the last complete checkpoint as torchrun's own restarts do. Each node that failed
is replaced by another node of the same GPU kind (Slurm's GRES type, Kubernetes' GPU product)
with at least as many GPUs, one that takes jobs now and is not already the run's; among those,
nodes that have not failed in this run first (a node set down by hand may return at once), then
the ones with the most GPUs free now (others' jobs are respected). The other nodes stay. The
run's TrainingJob moves with it: the replaced placement names the new node and its address, so
the ranks' accounts of a death name the node they ran on. Core only: no Prefect, no subprocess.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from frenzy_prefect.spec.plan import Placement, TrainingJob


class NodeNow(Protocol):
    """A node as its cluster shows it now (slurm_inventory.SlurmNode, kubernetes_inventory.KubeNode)."""

    @property
    def name(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def schedulable(self) -> bool: ...
    @property
    def gpus(self) -> int: ...


N = TypeVar("N", bound=NodeNow)


def replacements(
    nodes: list[tuple[str, int]],
    lost: list[str],
    found: list[N],
    failed_before: set[str],
    kind: Callable[[N], str | None] = lambda n: n.gpu_type,  # type: ignore[attr-defined]
    free: Callable[[N], int] = lambda n: n.gpus_free,  # type: ignore[attr-defined]
) -> dict[str, N] | None:
    """For each lost node, the node that takes its place (``found``: the cluster's nodes now;
    ``kind``: a node's GPU kind, ``free``: its GPUs free now), or None when one of them has no
    replacement."""
    by_name = {n.name: n for n in found}
    taken = {name for name, _ in nodes if name not in lost}
    counts = dict(nodes)
    chosen: dict[str, N] = {}
    for node in lost:
        wanted, excluded = kind(by_name[node]) if node in by_name else None, taken | set(lost)
        fits = [n for n in found if n.schedulable and kind(n) == wanted and n.gpus >= counts[node] and n.name not in excluded]
        if not fits:
            return None
        best = min(fits, key=lambda n: (n.name in failed_before, -free(n), found.index(n)))
        chosen[node] = best
        taken.add(best.name)
    return chosen


def moved_nodes(nodes: list[tuple[str, int]], moves: dict[str, NodeNow]) -> list[tuple[str, int]]:
    """The job's nodes in rank order, each lost one replaced."""
    return [(moves[name].name if name in moves else name, count) for name, count in nodes]


def moved_job(job: TrainingJob, moves: dict[str, NodeNow]) -> TrainingJob:
    """``job`` with its placements on the lost nodes moved to their replacements (the GPU
    indices are the cluster's choice on the new node, as they were on the old one)."""
    placements = [
        Placement(node=moves[p.node].name, host=moves[p.node].address, gpus=p.gpus) if p.node in moves else p
        for p in job.allocation.placements
    ]
    allocation = job.allocation.model_copy(update={"placements": placements})
    return job.model_copy(update={"allocation": allocation})


def resume_point(job: TrainingJob) -> str:
    """``step S``: the step of the checkpoint a restarted job resumes from (``step 0``: none)."""
    from frenzy_prefect.training.manifest import latest  # object storage's clients: only when a run restarts

    try:
        found = latest(job.checkpoint_uri)
    except Exception:  # storage unreachable from here: the new job's rank 0 logs what it resumed from
        return "its last complete checkpoint"
    return f"step {found[1].step if found else 0}"
