"""The interface every scheduling policy implements, and what it decides."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from frenzy_prefect.scheduling.cluster import SimCluster
from frenzy_prefect.scheduling.jobs import SimJob, Waiting
from frenzy_prefect.spec.plan import ParallelPlan, Placement


@dataclass(frozen=True, slots=True)
class Start:
    waiting: Waiting
    gpu_type: str
    plan: ParallelPlan
    placements: list[Placement]  # already taken from the cluster


@dataclass(frozen=True, slots=True)
class Reject:
    waiting: Waiting
    reason: str


class Policy(Protocol):
    name: ClassVar[str]
    round_s: ClassVar[float | None]  # None: decide at every arrival and completion

    def prepare(self, job: SimJob, cluster: SimCluster, underestimate: float = 1.0) -> None:
        """At submission, and at resubmission after running out of memory (``underestimate``:
        what that proved of the job's estimates): anything computed once per job (MARP's plans),
        outside decision time."""
        ...

    def schedule(self, now: float, queue: list[Waiting], cluster: SimCluster) -> list[Start | Reject]:
        """Which queued jobs start now (taking their GPUs from ``cluster``), in queue order,
        and which can never run."""
        ...


def no_plan_fits(waiting: Waiting, cluster: SimCluster) -> str:
    """Why a memory-aware policy gives a job up: no plan fits, as estimated or as its out-of-memory runs corrected the estimates."""
    types = ", ".join(cluster.types)
    if waiting.out_of_memory:
        return (
            f"ran out of memory {waiting.out_of_memory} times; no plan fits any GPU type of the cluster ({types}) "
            f"with its estimates x{waiting.underestimate:.3f}"
        )
    return f"no plan fits any GPU type of the cluster ({types}) in memory"
