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

    def prepare(self, job: SimJob, cluster: SimCluster) -> None:
        """At submission: anything computed once per job (MARP's plans), outside decision time."""
        ...

    def schedule(self, now: float, queue: list[Waiting], cluster: SimCluster) -> list[Start | Reject]:
        """Which queued jobs start now (taking their GPUs from ``cluster``), in queue order,
        and which can never run."""
        ...
