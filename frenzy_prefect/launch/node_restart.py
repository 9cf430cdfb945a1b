"""A run's restart after a node failure (``max_restarts``), on Slurm or Kubernetes: where its
new job goes.

When a node of the run fails (its Slurm job ends NODE_FAIL, its pod is evicted from a lost
node), the job cannot go on where it was, so the launcher's watcher submits a new one, which
resumes from the last committed checkpoint as torchrun's own restarts do, as the run's next
generation (training.fence: the old job's ranks, if they live on, commit nothing more). Each
node that failed is replaced by another node of the same GPU kind (Slurm's GRES type,
Kubernetes' GPU product) with at least as many GPUs, one that takes jobs now and is not already
the run's; among those, nodes that have not failed in this run first (a node set down by hand
may return at once), then the ones with the most GPUs free now (others' jobs are respected).
The other nodes stay. The run's TrainingJob moves with it: the replaced placement names the new
node and its address, so the ranks' accounts of a death name the node they ran on. Core only: no
Prefect, no subprocess.
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


def claimed_for_restart(job: TrainingJob, env: dict[str, str]) -> tuple[dict[str, str], str]:
    """The new job's environment, its attempt the launcher's next submission (training.fence's
    ATTEMPT_ENV), and where it resumes: ``step S (generation G)``. The run's next generation is
    claimed for the new job here, before it is submitted, so that the failed node's ranks, if
    they live on (a node cut off, its slurmd dead), are fenced from now on, and S is exactly the
    checkpoint the new job resumes from (unless that one turns out corrupt: its rank 0 says).
    Where the storage cannot be reached from here, the new job's rank 0 claims the run itself."""
    from frenzy_prefect.training.fence import ATTEMPT_ENV, attempt_key, claim, next_submission  # object storage's clients

    if not env.get(ATTEMPT_ENV):
        return env, "its last committed checkpoint"
    env = {**env, ATTEMPT_ENV: next_submission(env[ATTEMPT_ENV])}
    try:
        held = claim(job.checkpoint_uri, attempt_key({ATTEMPT_ENV: env[ATTEMPT_ENV]}))
    except Exception:  # (storage unreachable from here, or a newer attempt holds the run: the new job's rank 0 finds out)
        return env, "its last committed checkpoint"
    return env, f"step {held.committed[0].step if held.committed else 0} (generation {held.generation})"
