"""The pool's own events, for automations to trigger on: ``frenzy.gpu.waiting`` (a training run
has to wait for GPUs other runs hold; once per run), ``frenzy.gpu.reserved`` (its GPUs are taken
for it) and ``frenzy.gpu.released`` (given back).

The resource is the flow run (``prefect.flow-run.<id>``), so a trigger can follow one run or
match every run of a deployment; related: the work pool, the cluster and, once taken, the lease
and each GPU (``frenzy-gpu.<cluster>.<node>.<index>``, its reservation limit's name). Payload: the
GPU type, GPU count, nodes (``{node: [indices]}``; while waiting, the plan's placement on the idle
cluster), and seconds waited (reserved) or held (released); ``waiting`` also says why it waits.
"""

from __future__ import annotations

import time
from uuid import UUID

from prefect.client.schemas.objects import FlowRun
from prefect.events import Event, emit_event

from frenzy_prefect.pool.reservations import gpu_limit
from frenzy_prefect.spec.plan import Placement, TrainingJob

WAITING, RESERVED, RELEASED = "frenzy.gpu.waiting", "frenzy.gpu.reserved", "frenzy.gpu.released"


class GpuEvents:
    """One training run's frenzy.gpu.* events, from its first look at the queue to its release."""

    def __init__(self, flow_run: FlowRun, job: TrainingJob, pool: str, pool_id: UUID | None = None) -> None:
        self.flow_run, self.job, self.pool, self.pool_id = flow_run, job, pool, pool_id
        self.asked = time.monotonic()
        self.reserved_at: float | None = None
        self.last: Event | None = None  # each event follows the one before it
        self.waited = False

    def waiting(self, why: str) -> None:
        if not self.waited:
            self.waited = True
            self._emit(WAITING, self.job.allocation.placements, None, {"reason": why})

    def reserved(self, placements: list[Placement], lease: UUID) -> None:
        self.reserved_at = time.monotonic()
        self._emit(RESERVED, placements, lease, {"waited_s": round(self.reserved_at - self.asked, 3)})

    def released(self, placements: list[Placement], lease: UUID) -> None:
        held = None if self.reserved_at is None else round(time.monotonic() - self.reserved_at, 3)
        self._emit(RELEASED, placements, lease, {"held_s": held})

    def _emit(self, event: str, placements: list[Placement], lease: UUID | None, extra: dict) -> None:
        allocation, cluster = self.job.allocation, self.job.cluster.name
        payload = {
            "gpu_type": allocation.gpu_type,
            "gpus": allocation.plan.gpus,
            "nodes": {p.node: list(p.gpus) for p in placements},
            "cluster": cluster,
            **extra,
        }
        self.last = emit_event(
            event=event,
            resource={"prefect.resource.id": f"prefect.flow-run.{self.flow_run.id}", "prefect.resource.name": self.flow_run.name},
            related=self._related(placements, lease),
            payload=payload,
            follows=self.last,
        )

    def _related(self, placements: list[Placement], lease: UUID | None) -> list[dict[str, str]]:
        cluster = self.job.cluster.name
        related = [_resource(f"frenzy.cluster.{cluster}", "cluster", cluster)]
        if self.pool_id is not None:
            related.append(_resource(f"prefect.work-pool.{self.pool_id}", "work-pool", self.pool))
        if lease is not None:
            related.append(_resource(f"frenzy.gpu-lease.{lease}", "gpu-lease"))
            related += [_resource(gpu_limit(cluster, p.node, i), "gpu", f"{p.node} GPU {i}") for p in placements for i in p.gpus]
        return related


def _resource(resource_id: str, role: str, name: str | None = None) -> dict[str, str]:
    return {"prefect.resource.id": resource_id, "prefect.resource.role": role} | ({"prefect.resource.name": name} if name else {})
