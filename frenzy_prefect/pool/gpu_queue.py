"""Training runs waiting for GPUs, served in one order across every worker of a pool.

A run that waits is labelled ``frenzy.waiting-for`` (its cluster and GPU type), so every worker
sees the same queue on the server: the pool's pending runs so labelled, oldest first. Each GPU
type is served first come first served, with backfill (allocator.backfill decides; this module
reads its inputs and acts on its answer): the oldest waiting run of a type starts once its plan
fits that type's free GPUs; while it cannot, a younger run of the type starts on free GPUs only
where it cannot delay it, by the allocator's predicted run times. A run of another type never
waits behind it: it wants other GPUs.

A run that takes GPUs is labelled ``frenzy.holds`` (its cluster, GPUs, and predicted end: when
it took them + the allocator's predicted time of all its steps), which the pool's decisions read
to know when the held GPUs are predicted to free up. A backfilled run that outlives its
prediction is not stopped: the run it passed waits longer (allocator.backfill). Set
FRENZY_BACKFILL=off on a pool's workers (all of them) for strict first come first served.

Each worker sweeps the queue for all of its waiting runs at once, every RETRY_S, so the load on
the server grows with the number of workers rather than of waiting runs. A run that has to wait,
and one whose GPUs are taken, is announced as an event (gpu_events).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from uuid import UUID

import anyio
from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType, WorkPoolFilter, WorkPoolFilterName
from prefect.client.schemas.objects import FlowRun, StateType
from pydantic import AwareDatetime, BaseModel, ValidationError

from frenzy_prefect.allocator.backfill import Holder, Start, Wait, Want, decide
from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.pool import run_labels
from frenzy_prefect.pool.gpu_events import GpuEvents
from frenzy_prefect.pool.reservations import GpuHold, GpuReservations
from frenzy_prefect.pool.server_calls import is_transient, patiently
from frenzy_prefect.spec.cluster import ClusterSpec
from frenzy_prefect.spec.plan import TrainingJob

RETRY_S = 2.0  # how often a worker looks at the queue and the free GPUs again
BACKFILL_ENV = "FRENZY_BACKFILL"  # on (the default) or off: strict first come first served per GPU type
logger = logging.getLogger(__name__)
JOB_PARAMETER = "job"


def backfill_enabled() -> bool:
    value = os.environ.get(BACKFILL_ENV, "on").strip().lower()
    if value not in ("on", "off"):
        raise FrenzyError(
            f"{BACKFILL_ENV}={value!r} on this worker: expected on (backfill, the default) or off (strict first come first served)"
        )
    return value == "on"


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


def _is_waiting(run: FlowRun) -> bool:
    """Pending, in the queue, and not served yet."""
    return bool(run.labels.get(run_labels.WAITING_FOR)) and not run.labels.get(run_labels.HOLDS) and run.state_type == StateType.PENDING


class Holds(BaseModel):
    """The ``frenzy.holds`` label of a run that took GPUs."""

    cluster: str
    gpus: dict[str, list[int]]  # node -> indices
    predicted_end: AwareDatetime | None  # None: the allocator had no prediction


def _holders(runs: list[FlowRun]) -> dict[str, list[Holder]]:
    """Per cluster, who holds GPUs and until when (a released lease holds nothing; an unreadable
    label's GPUs count as held by a run nobody knows, so its type gets no backfill)."""
    out: dict[str, list[Holder]] = {}
    for run in runs:
        raw = run.labels.get(run_labels.HOLDS)
        if not raw or run.labels.get(run_labels.LEASE) == run_labels.RELEASED:
            continue
        try:
            holds = Holds.model_validate_json(raw)
        except ValidationError:
            continue
        ends = None if holds.predicted_end is None else holds.predicted_end.timestamp()
        out.setdefault(holds.cluster, []).append(Holder(frozenset((n, i) for n, idx in holds.gpus.items() for i in idx), ends))
    return out


@dataclass
class _Waiter:
    flow_run: FlowRun
    job: TrainingJob
    events: GpuEvents
    served: anyio.Event = field(default_factory=anyio.Event)
    hold: GpuHold | None = None  # None once served: cancelled while it waited
    said: str = ""


class GpuQueue:
    """This worker's waiting runs, served in the pool's one order."""

    def __init__(
        self,
        client: PrefectClient,
        pool: str,
        logger_for: Callable[[FlowRun], logging.LoggerAdapter],
        pool_id: UUID | None = None,
        narrow_free: Callable[[ClusterSpec, dict[str, list[int]]], Awaitable[dict[str, list[int]]]] | None = None,
    ) -> None:
        """``narrow_free``: what a cluster manager (Slurm) says of the GPUs the reservations leave free."""
        self.backfill = backfill_enabled()
        self.client = client
        self.narrow_free = narrow_free
        self.pool = pool
        self.pool_id = pool_id  # the events' related work pool
        self.logger_for = logger_for
        self._waiters: dict[UUID, _Waiter] = {}
        self._sweeping = anyio.Lock()
        self._last_sweep = -float("inf")

    async def wait_turn(self, flow_run: FlowRun, job: TrainingJob) -> tuple[TrainingJob, GpuHold] | None:
        """The job placed on GPUs taken for it, once its turn comes; None if the run is
        cancelled while it waits (nothing is taken then)."""
        waiter = _Waiter(flow_run, job, GpuEvents(flow_run, job, self.pool, self.pool_id))
        await patiently(
            lambda: self.client.update_flow_run_labels(flow_run.id, {run_labels.WAITING_FOR: queue_key(job), run_labels.HOLDS: ""}),
            "joining the GPU queue",
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
        runs = await self._read_pool_runs()
        waiting = sorted((r for r in runs if _is_waiting(r)), key=lambda r: (r.created, str(r.id)))
        await self._drop_cancelled({run.id for run in waiting})
        lines: dict[str, list[tuple[FlowRun, TrainingJob]]] = {}  # cluster -> its waiting runs, oldest first
        for run in waiting:
            waiter = self._waiters.get(run.id)
            job = waiter.job if waiter else _job_or_none(run)
            if job is not None:
                lines.setdefault(job.cluster.name, []).append((run, job))
        holders = _holders(runs)
        for cluster, line in lines.items():
            await self._serve(line, holders.get(cluster, []))

    async def _serve(self, line: list[tuple[FlowRun, TrainingJob]], holders: list[Holder]) -> None:
        """Decide on one cluster's line (every worker's runs, so that each worker decides alike),
        then take the GPUs of this worker's runs that start."""
        cluster = line[0][1].cluster
        free = (await GpuReservations(self.client, cluster).state()).free_gpus
        if self.narrow_free is not None:
            free = await self.narrow_free(cluster, free)
        decisions = decide([Want.of(job) for _, job in line], cluster.nodes, free, holders, time.time(), self.backfill)
        lost: set[str] = set()  # GPU types where another worker took GPUs first: the rest waits for the next sweep
        for (run, job), decision in zip(line, decisions, strict=True):
            waiter = self._waiters.get(run.id)
            if waiter is None:
                continue  # another worker's run: it takes its GPUs in its own sweep
            a = job.allocation
            if isinstance(decision, Wait):
                self._say(waiter, _why_waiting(job, decision))
            elif a.gpu_type in lost or not await self._take(waiter, decision):
                lost.add(a.gpu_type)
                self._say(waiter, f"waiting for {a.plan.gpus} x {a.gpu_type}: another run took the free ones first")

    async def _read_pool_runs(self) -> list[FlowRun]:
        """The pool's runs that may wait for GPUs or hold them."""
        pool = WorkPoolFilter(name=WorkPoolFilterName(any_=[self.pool]))
        active = [StateType.PENDING, StateType.RUNNING, StateType.CANCELLING]
        return await self.client.read_flow_runs(
            work_pool_filter=pool, flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=active)))
        )

    async def _drop_cancelled(self, pending: set[UUID]) -> None:
        """Serve, with nothing, this worker's waiting runs that are no longer pending (being
        cancelled, mostly)."""
        for run_id, waiter in list(self._waiters.items()):
            if run_id in pending or waiter.served.is_set():
                continue
            if (await self.client.read_flow_run(run_id)).state_type != StateType.PENDING:
                waiter.served.set()

    async def _take(self, waiter: _Waiter, start: Start) -> GpuHold | None:
        """The GPUs of a run whose turn it is, labelled with what the other workers' decisions
        read of it; None if another worker took one of them first."""
        run, job = waiter.flow_run, waiter.job
        reservations = GpuReservations(self.client, job.cluster)
        lease = await reservations.acquire(start.placements, run.id)
        if lease is None:
            return None
        waiter.hold = GpuHold(reservations, start.placements, run.id, lease, on_release=waiter.events.released)
        waiter.events.reserved(start.placements, lease)
        waiter.served.set()
        predicted = job.allocation.total_time_s
        ends = None if predicted is None else datetime.now(UTC) + timedelta(seconds=predicted)
        holds = Holds(cluster=job.cluster.name, gpus={p.node: p.gpus for p in start.placements}, predicted_end=ends)
        labels = {run_labels.HOLDS: holds.model_dump_json()}  # (the worker clears waiting-for when it starts the ranks)
        await patiently(lambda: self.client.update_flow_run_labels(run.id, labels), "labelling the flow run")
        if start.passed is not None:
            self.logger_for(run).info(_why_backfilled(job, start))
        return waiter.hold

    def _say(self, waiter: _Waiter, why: str) -> None:
        waiter.events.waiting(why)
        if why != waiter.said:
            self.logger_for(waiter.flow_run).info(why)
            waiter.said = why


def _why_waiting(job: TrainingJob, wait: Wait) -> str:
    a = job.allocation
    if wait.position > 1:
        return f"waiting for {a.plan.gpus} x {a.gpu_type}: {_ordinal(wait.position)} in line for {queue_key(job)} across the pool's workers"
    why = f"waiting for {a.plan.gpus} x {a.gpu_type}; {wait.free} free now, held by other runs"
    if wait.reservation is not None and wait.reservation.at > time.time():  # (not when a holder is past its predicted end)
        why += f"; enough are predicted free by {_clock(wait.reservation.at)}, and younger runs predicted to end by then may go first"
    return why


def _why_backfilled(job: TrainingJob, start: Start) -> str:
    passed = start.passed
    how = (
        f"predicted to end by {_clock(start.ends_at)}, before that run's predicted start at {_clock(passed.at)}"
        if start.ends_at <= passed.at
        else "on GPUs that run does not need"
    )
    return f"Backfilled: started ahead of the oldest run waiting for {queue_key(job)}, {how}"


def _clock(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%H:%M:%S UTC")


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"
