"""Reclaiming the runs of a `frenzy` worker that is gone (killed with -9, its machine lost).

Each run a worker takes is labelled with the worker's process and its GPU lease (run_labels).
When a worker starts, and at each heartbeat, it looks at its pool's active runs and at those
that ended in the last RECLAIM_WINDOW_S. A run's worker counts as gone when its PID is dead on
this host, or, on another host, when Prefect shows that worker OFFLINE. Then:

- a run that was still waiting for GPUs had started nothing: it goes back to Scheduled, for any
  worker of the pool to take, keeping its place in the GPU queue (its creation time);
- any other run has what is left of its processes here stopped, its Kubernetes objects deleted
  (kubernetes launcher: its watcher, which deletes them when its worker dies, may have died
  with the worker's machine), its GPUs given back at once (instead of when the lease expires, or,
  if the server forgot the lease in a restart, when the leak sweep finds them: _give_back_gpus)
  and, if not final yet, is marked Crashed, naming the lost worker.
"""

from __future__ import annotations

import socket
from datetime import UTC, datetime, timedelta
from uuid import UUID

from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterEndTime,
    FlowRunFilterState,
    FlowRunFilterStateType,
    WorkPoolFilter,
    WorkPoolFilterName,
)
from prefect.client.schemas.objects import FlowRun, StateType, WorkerStatus
from prefect.exceptions import PrefectHTTPStatusError
from prefect.states import Scheduled
from prefect.workers.base import BaseWorker

from frenzy_prefect.launch.local import host_and_pids, is_running, stop_process_groups
from frenzy_prefect.pool import run_labels
from frenzy_prefect.pool.crash import crash_naming_the_cause
from frenzy_prefect.pool.kubernetes import KUBERNETES_JOB_LABEL, delete_objects_of_lost_run
from frenzy_prefect.pool.leaks import give_back_unclaimed
from frenzy_prefect.pool.reservations import GONE, LEASE_S

RECLAIM_WINDOW_S = 3 * LEASE_S  # a lease outlives its last renewal by at most LEASE_S plus the server's sweep


async def reclaim_lost_runs(worker: BaseWorker) -> None:
    """Reclaim the runs of ``worker``'s pool whose worker is gone."""
    client = worker.client
    pool = WorkPoolFilter(name=WorkPoolFilterName(any_=[worker._work_pool_name]))
    active = FlowRunFilter(
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PENDING, StateType.RUNNING, StateType.CANCELLING]))
    )
    ended = FlowRunFilter(end_time=FlowRunFilterEndTime(after_=datetime.now(UTC) - timedelta(seconds=RECLAIM_WINDOW_S)))
    runs = [run for f in (active, ended) for run in await client.read_flow_runs(work_pool_filter=pool, flow_run_filter=f)]
    offline = {w.name for w in await client.read_workers_for_work_pool(worker._work_pool_name) if w.status == WorkerStatus.OFFLINE}
    for run in {run.id: run for run in runs}.values():
        if _worker_is_gone(run, offline):
            if run.labels.get(run_labels.WAITING_FOR) and run.state_type == StateType.PENDING:
                await _reschedule(worker, run)
            else:
                await _reclaim(worker, run)


def _worker_is_gone(run: FlowRun, offline: set[str]) -> bool:
    owner, lease = run.labels.get(run_labels.PROCESS), run.labels.get(run_labels.LEASE, run_labels.RELEASED)
    final = run.state is not None and run.state.is_final()
    if not owner or owner == run_labels.this_process() or run_labels.RECLAIMED_BY in run.labels or (final and lease == run_labels.RELEASED):
        return False
    host, (pid,) = host_and_pids(owner)
    if host == socket.gethostname():
        return not is_running(pid, group=False)
    return run.labels.get(run_labels.WORKER) in offline


async def _reschedule(worker: BaseWorker, run: FlowRun) -> None:
    lost = f"{run.labels.get(run_labels.WORKER)!r} ({run.labels.get(run_labels.PROCESS)})"
    # (A take the lost worker had begun holds a lease nobody renews: it expires.)
    await worker.client.update_flow_run_labels(run.id, {run_labels.WAITING_FOR: "", run_labels.PROCESS: "", run_labels.GPUS: ""})
    await worker.client.set_flow_run_state(run.id, Scheduled(message=f"Rescheduled: its frenzy worker {lost} is gone"), force=True)
    worker.get_flow_run_logger(run).warning(
        f"Rescheduled: its frenzy worker {lost} is gone while it waited for GPUs;"
        " it had started nothing, so any worker of the pool may take it"
    )


async def _reclaim(worker: BaseWorker, run: FlowRun) -> None:
    owner = run.labels.get(run_labels.PROCESS)
    started_on, pids = host_and_pids(run.infrastructure_pid or "")
    if started_on == socket.gethostname():
        await stop_process_groups(pids)
    deleted = await _delete_cluster_objects(worker, run)
    # Labelled before the lease goes: a holder that is not gone after all (another host's worker
    # taken for OFFLINE) then knows its lease was revoked, not forgotten (reservations.GpuHold).
    await worker.client.update_flow_run_labels(run.id, {run_labels.RECLAIMED_BY: worker.name})
    gave_back = await _give_back_gpus(worker, run)
    message = (
        f"its frenzy worker {run.labels.get(run_labels.WORKER)!r} ({owner}) is gone;"
        f" {worker.name!r} stopped its processes{f', deleted {deleted}' if deleted else ''} and {gave_back}"
    )
    worker.get_flow_run_logger(run).warning(f"Reclaimed: {message}")
    if deleted:  # (its pods' rank 0, stopped by the deletion, may have reported its SIGTERM first)
        await crash_naming_the_cause(worker.client, run.id, f"Crashed: {message}", replaces_failure=True)
    elif not (run.state is not None and run.state.is_final()):
        await worker._propose_crashed_state(run, f"Crashed: {message}")


async def _give_back_gpus(worker: BaseWorker, run: FlowRun) -> str:
    """The lost run's GPUs let go of now, in words. By its lease where the server still knows it
    (renewed first: an unknown lease's release is a silent no-op); else, the server having
    forgotten it (a restart of a server that keeps leases in memory, likely with the worker: a
    host's reboot), by name, what the run still claims and no other run does (leaks)."""
    client, lease, claimed = worker.client, run.labels.get(run_labels.LEASE, run_labels.RELEASED), run.labels.get(run_labels.GPUS)
    if lease == run_labels.RELEASED:  # none taken, or lost mid-take or mid-release: a lease nobody renews expires
        await client.update_flow_run_labels(run.id, {run_labels.GPUS: ""})
        return f"left its GPUs' lease to expire (within {LEASE_S:.0f} s)" if claimed else "found no GPU held"
    try:
        await client.renew_concurrency_lease(UUID(lease), lease_duration=LEASE_S)
        await client.release_concurrency_slots_with_lease(UUID(lease))
        await client.update_flow_run_labels(run.id, {run_labels.GPUS: "", run_labels.LEASE: run_labels.RELEASED})
        return "released its GPUs"
    except PrefectHTTPStatusError as exc:
        if exc.response.status_code not in GONE:
            raise
    freed = await give_back_unclaimed(client, run.id)
    await client.update_flow_run_labels(run.id, {run_labels.LEASE: run_labels.RELEASED})
    forgotten = f"the Prefect server no longer knew its lease {lease}"
    if freed is None:
        return f"left its GPUs to the pool's leak sweep ({forgotten}, and another worker kept the give-back lock)"
    return f"gave back GPUs {', '.join(freed)} by name ({forgotten})" if freed else f"found its GPUs free already ({forgotten})"


async def _delete_cluster_objects(worker: BaseWorker, run: FlowRun) -> str:
    """The run's Kubernetes objects deleted (kubernetes launcher), in words; '' where it has none.
    A cluster that cannot be reached is logged, not raised: the reclaim goes on."""
    try:
        return ", ".join(await delete_objects_of_lost_run(worker, run))
    except Exception as exc:
        worker.get_flow_run_logger(run).warning(
            f"Could not delete the Kubernetes objects of run {run.name!r} ({run.labels.get(KUBERNETES_JOB_LABEL)}): "
            f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}; delete them by the label frenzy.prefect.io/job"
        )
        return ""
