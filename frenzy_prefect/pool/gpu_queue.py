"""Training runs waiting for GPUs, served in one order across every worker of a pool.

A run that waits is labelled ``frenzy.waiting-for`` (its cluster and GPU type), so every worker
sees the same queue on the server: the pool's pending runs so labelled, oldest first. Each GPU
type is served first come first served: the oldest waiting run of a type starts once its plan
fits that type's free GPUs, a younger one only after every older one of its type has started.
A run of another type never waits behind it: it wants other GPUs, so starting it now cannot
delay the blocked one (the backfill HAS does in the simulator, without runtime predictions).

Each worker sweeps the queue for all of its waiting runs at once, every RETRY_S, so the load on
the server grows with the number of workers rather than of waiting runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from uuid import UUID

import anyio
from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType, WorkPoolFilter, WorkPoolFilterName
from prefect.client.schemas.objects import FlowRun, StateType
from pydantic import ValidationError

from frenzy_prefect.allocator.placement import place
from frenzy_prefect.pool import run_labels
from frenzy_prefect.pool.reservations import GpuHold, GpuReservations
from frenzy_prefect.pool.server_calls import is_transient, patiently
from frenzy_prefect.spec.plan import TrainingJob

RETRY_S = 2.0  # how often a worker looks at the queue and the free GPUs again
logger = logging.getLogger(__name__)
JOB_PARAMETER = "job"


def training_job_of(flow_run: FlowRun) -> TrainingJob | None:
    raw = (flow_run.parameters or {}).get(JOB_PARAMETER)
    return None if raw is None else TrainingJob.model_validate(raw)


def _job_or_none(flow_run: FlowRun) -> TrainingJob | None:
    """Another worker's waiting run's job; None if it cannot be read (that run fails on its own
    worker, never a run that shares the queue with it)."""
    try:
        return training_job_of(flow_run)
    except ValidationError:
        return None


def queue_key(job: TrainingJob) -> str:
    """What a run waits for: GPUs of one type in one cluster."""
    return f"{job.cluster.name}/{job.allocation.gpu_type}"


@dataclass
class _Waiter:
    flow_run: FlowRun
    job: TrainingJob
    served: anyio.Event = field(default_factory=anyio.Event)
    hold: GpuHold | None = None  # None once served: cancelled while it waited
    said: str = ""


class GpuQueue:
    """This worker's waiting runs, served in the pool's one order."""

    def __init__(self, client: PrefectClient, pool: str, logger_for: Callable[[FlowRun], logging.LoggerAdapter]) -> None:
        self.client = client
        self.pool = pool
        self.logger_for = logger_for
        self._waiters: dict[UUID, _Waiter] = {}
        self._sweeping = anyio.Lock()
        self._last_sweep = -float("inf")

    async def wait_turn(self, flow_run: FlowRun, job: TrainingJob) -> tuple[TrainingJob, GpuHold] | None:
        """The job placed on GPUs taken for it, once its turn comes; None if the run is
        cancelled while it waits (nothing is taken then)."""
        waiter = _Waiter(flow_run, job)
        await patiently(
            lambda: self.client.update_flow_run_labels(flow_run.id, {run_labels.WAITING_FOR: queue_key(job)}), "joining the GPU queue"
        )
        self._waiters[flow_run.id] = waiter
        try:
            while not waiter.served.is_set():
                await self._sweep_when_due()
                with anyio.move_on_after(RETRY_S):
                    await waiter.served.wait()
        except BaseException:
            if waiter.hold is not None:  # served just as the worker stops: give the GPUs back
                with anyio.CancelScope(shield=True):
                    await waiter.hold.release()
            raise
        finally:
            del self._waiters[flow_run.id]
        if waiter.hold is None:
            return None
        placed = job.model_copy(update={"allocation": job.allocation.model_copy(update={"placements": waiter.hold.placements})})
        return placed, waiter.hold

    async def _sweep_when_due(self) -> None:
        async with self._sweeping:
            if time.monotonic() - self._last_sweep < RETRY_S:
                return
            try:
                await self._sweep()
            except Exception as exc:  # never a waiting run's failure: the next sweep tries again
                if is_transient(exc):
                    logger.warning("GPU queue: the Prefect server did not answer (%s); waiting runs keep waiting", exc)
                else:
                    logger.exception("GPU queue: a sweep failed; waiting runs keep waiting and the next sweep tries again")
            finally:
                self._last_sweep = time.monotonic()

    async def _sweep(self) -> None:
        queue = await self._read_queue()
        await self._drop_cancelled({run.id for run in queue if run.state_type == StateType.PENDING})
        free: dict[str, dict[str, list[int]]] = {}  # cluster -> node -> free GPUs, as this sweep hands them out
        blocked: dict[str, int] = {}  # queue key -> runs waiting behind its blocked head
        for run in queue:
            key = run.labels.get(run_labels.WAITING_FOR) or ""
            waiter = self._waiters.get(run.id)
            job = waiter.job if waiter else _job_or_none(run)
            if not key or run.state_type != StateType.PENDING or job is None:
                continue
            if key in blocked:
                blocked[key] += 1
                if waiter:
                    self._say(
                        waiter,
                        f"waiting for {job.allocation.plan.gpus} x {job.allocation.gpu_type}:"
                        f" {_ordinal(blocked[key])} in line for {key} across the pool's workers",
                    )
                continue
            if job.cluster.name not in free:
                free[job.cluster.name] = (await GpuReservations(self.client, job.cluster).state()).free_gpus
            placements = self._place(job, free[job.cluster.name])
            hold = placements and waiter and await self._take(waiter, placements)
            if not placements or (waiter and not hold):
                blocked[key] = 1
                if waiter:
                    n = sum(
                        len(free[job.cluster.name][node.name]) for node in job.cluster.nodes if node.gpu_type == job.allocation.gpu_type
                    )
                    self._say(
                        waiter, f"waiting for {job.allocation.plan.gpus} x {job.allocation.gpu_type}; {n} free now, held by other runs"
                    )
                continue
            for p in placements:  # handed out in this sweep, whoever's turn it was
                free[job.cluster.name][p.node] = [g for g in free[job.cluster.name][p.node] if g not in p.gpus]

    async def _read_queue(self) -> list[FlowRun]:
        pool = WorkPoolFilter(name=WorkPoolFilterName(any_=[self.pool]))
        states = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PENDING, StateType.CANCELLING])))
        runs = await self.client.read_flow_runs(work_pool_filter=pool, flow_run_filter=states)
        return sorted((r for r in runs if r.labels.get(run_labels.WAITING_FOR)), key=lambda r: (r.created, str(r.id)))

    async def _drop_cancelled(self, pending: set[UUID]) -> None:
        """Serve, with nothing, this worker's waiting runs that are no longer pending (being
        cancelled, mostly)."""
        for run_id, waiter in list(self._waiters.items()):
            if run_id in pending or waiter.served.is_set():
                continue
            if (await self.client.read_flow_run(run_id)).state_type != StateType.PENDING:
                waiter.served.set()

    @staticmethod
    def _place(job: TrainingJob, free: dict[str, list[int]]):
        plan, gpu_type = job.allocation.plan, job.allocation.gpu_type
        return place(plan.gpus, [(n, free[n.name]) for n in job.cluster.nodes if n.gpu_type == gpu_type], group=plan.tp)

    async def _take(self, waiter: _Waiter, placements) -> GpuHold | None:
        reservations = GpuReservations(self.client, waiter.job.cluster)
        lease = await reservations.acquire(placements, waiter.flow_run.id)
        if lease is None:  # another worker took one of them first
            return None
        waiter.hold = GpuHold(reservations, placements, waiter.flow_run.id, lease)
        waiter.served.set()
        return waiter.hold

    def _say(self, waiter: _Waiter, why: str) -> None:
        if why != waiter.said:
            self.logger_for(waiter.flow_run).info(why)
            waiter.said = why


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"
