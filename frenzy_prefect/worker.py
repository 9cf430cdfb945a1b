"""The `frenzy` work pool's worker: dispatches flow runs to the GPU nodes the allocator chose.

A flow run with a ``job`` parameter (a TrainingJob, as `train_llm` submits to the
`distributed-train` deployment) becomes one torchrun agent per allocated node, rank 0 of which
executes the flow run itself. Before starting it, the worker places the job's plan on the GPUs
free *now* (HAS stage 2 over the reservations every worker of the pool shares) and takes them
in one transaction; while they are not free the run waits, first come first served within this
worker, and its log says what it waits for. The reservation's lease is renewed while the ranks
run and released when they end, however they end. Any other flow run (the `train_llm`
pipeline) runs as one process on the worker's machine, like Prefect's process worker.

Every process a worker starts dies with it (launch.orphan_guard), and every run it takes is
labelled with the worker's process (``frenzy.worker-process``) and its GPU lease
(``frenzy.lease``). When a worker starts, and at each heartbeat, it reclaims the runs whose
worker is gone (killed with -9, its machine lost): their processes are stopped, their GPUs
released and they are marked Crashed. Without that a lease would still expire by itself a
minute after its worker stopped renewing it, but the run would stay Running forever.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
import tempfile
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Literal, Optional

from uuid import UUID

import anyio
import anyio.abc
from prefect import get_client
from prefect.blocks.system import Secret
from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterEndTime, FlowRunFilterState, FlowRunFilterStateType, WorkPoolFilter, WorkPoolFilterName
from prefect.client.schemas.objects import FlowRun, StateType, WorkerStatus
from prefect.exceptions import InfrastructureNotAvailable
from prefect.workers.base import BaseJobConfiguration, BaseVariables, BaseWorker, BaseWorkerResult
from pydantic import Field

from frenzy_prefect.allocator.placement import place
from frenzy_prefect.crash import crash_naming_the_cause
from frenzy_prefect.launch.command import Launch
from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.launch.local import ProcessGroup, host_and_pids, is_running, start_local, stop_process_groups
from frenzy_prefect.launch.ssh import SSH_UNREACHABLE, SshSettings, start_ssh
from frenzy_prefect.launch.torchrun import rank_launches
from frenzy_prefect.reservations import LEASE_S, GpuReservations
from frenzy_prefect.spec.plan import TrainingJob

JOB_PARAMETER = "job"
RETRY_S = 2.0  # how often a waiting run looks at the reservations again
CANCEL_POLL_S = 1.0  # how often a running run's state is checked for cancellation
CANCEL_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this: every rank is gone within ~7 s
WORKER_LABEL = "frenzy.worker"  # the worker's name
PROCESS_LABEL = "frenzy.worker-process"  # HOST:PID of the worker process that took the run
LEASE_LABEL = "frenzy.lease"  # the run's GPU reservation, RELEASED once its worker let it go
RELEASED = "released"
RECLAIMED_LABEL = "frenzy.reclaimed-by"  # the worker that reclaimed the run after its own was lost
RECLAIM_WINDOW_S = 3 * LEASE_S  # a lease outlives its last renewal by at most LEASE_S plus the server's sweep


class FrenzyJobConfiguration(BaseJobConfiguration):
    working_dir: Optional[Path] = Field(default=None)
    launcher: Literal["local", "ssh"] = Field(default="local")
    ssh_user: Optional[str] = Field(default=None)
    ssh_port: int = Field(default=22)
    ssh_key_secret: Optional[str] = Field(default=None)
    ssh_known_hosts: Optional[Path] = Field(default=None)
    node_python: Optional[str] = Field(default=None)
    allowed_gpu_types: Optional[list[str]] = Field(default=None)
    max_gpus_per_run: Optional[int] = Field(default=None)

    @staticmethod
    def _base_flow_run_command() -> str:
        return shlex.join([sys.executable, "-m", "prefect.engine"])


class FrenzyVariables(BaseVariables):
    working_dir: Optional[Path] = Field(
        default=None,
        title="Working Directory",
        description="Directory the run's processes start in; default: the worker's.",
    )
    launcher: Literal["local", "ssh"] = Field(
        default="local",
        title="Launcher",
        description="local: ranks on the worker's machine; ssh: ranks on each allocated node's host, over SSH.",
    )
    ssh_user: Optional[str] = Field(default=None, title="SSH User", description="Login on the nodes (ssh launcher).")
    ssh_port: int = Field(default=22, ge=1, le=65535, title="SSH Port", description="sshd's port on the nodes.")
    ssh_key_secret: Optional[str] = Field(
        default=None,
        title="SSH Key Secret Block",
        description="Name of a Prefect Secret block holding the private key (never logged; written to a 0600 file for the run).",
    )
    ssh_known_hosts: Optional[Path] = Field(
        default=None, title="SSH known_hosts", description="known_hosts file the nodes' host keys are checked against (required for ssh)."
    )
    node_python: Optional[str] = Field(
        default=None, title="Node Python", description="Python with frenzy-prefect installed on the nodes; default: the worker's."
    )
    allowed_gpu_types: Optional[list[str]] = Field(
        default=None, title="Allowed GPU Types", description="Training runs on other GPU types fail at once; default: any."
    )
    max_gpus_per_run: Optional[int] = Field(
        default=None, ge=1, title="Max GPUs per Run", description="Training runs needing more GPUs fail at once; default: no cap."
    )


class FrenzyWorkerResult(BaseWorkerResult):
    """Exit status of a run's processes (the first failure, else 0) and their PIDs."""


def training_job_of(flow_run: FlowRun) -> TrainingJob | None:
    raw = (flow_run.parameters or {}).get(JOB_PARAMETER)
    return None if raw is None else TrainingJob.model_validate(raw)


class FrenzyWorker(BaseWorker[FrenzyJobConfiguration, FrenzyVariables, FrenzyWorkerResult]):
    type = "frenzy"
    job_configuration = FrenzyJobConfiguration
    job_configuration_variables = FrenzyVariables
    _display_name = "Frenzy"
    _description = (
        "Dispatches flow runs to the GPU nodes chosen by the Frenzy memory-aware allocator: "
        "one process per allocated GPU, ranks wired up by torch.distributed."
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._waiting: list[UUID] = []  # flow runs of this worker waiting for GPUs, in arrival order

    def launches_for(self, configuration: FrenzyJobConfiguration, job: TrainingJob | None) -> list[Launch]:
        env = {k: v for k, v in {**os.environ, **configuration.env}.items() if v is not None}
        if job is None:
            return [Launch(host="127.0.0.1", argv=shlex.split(configuration.command or ""), env=env)]
        return rank_launches(job, python=sys.executable, env=env)  # the launcher picks the rendezvous port on the first node

    async def run(
        self,
        flow_run: FlowRun,
        configuration: FrenzyJobConfiguration,
        task_status: Optional[anyio.abc.TaskStatus[Any]] = None,
    ) -> FrenzyWorkerResult:
        await self.client.update_flow_run_labels(flow_run.id, {WORKER_LABEL: self.name, PROCESS_LABEL: _this_process()})
        job = training_job_of(flow_run)
        if job is None:
            result, cancelled = await self._launch(flow_run, configuration, None, task_status)
        else:
            _check_pool_policy(job, configuration)
            async with get_client() as client:
                reservations = GpuReservations(client, job.cluster)
                await reservations.ensure()
                reserved = await self._reserve(flow_run, job, reservations, client)
                if reserved is None:  # cancelled while it waited: nothing was taken or started
                    await self._mark_flow_run_as_cancelled(flow_run, {"message": "Cancelled while waiting for GPUs"})
                    return FrenzyWorkerResult(status_code=0, identifier="")
                job, lease = reserved
                try:
                    await client.update_flow_run_labels(flow_run.id, {LEASE_LABEL: str(lease)})
                    async with anyio.create_task_group() as renewals:
                        renewals.start_soon(self._keep, reservations, lease)
                        result, cancelled = await self._launch(flow_run, configuration, job, task_status)
                        renewals.cancel_scope.cancel()
                finally:
                    with anyio.CancelScope(shield=True):
                        self.get_flow_run_logger(flow_run).info(f"Releasing GPUs {_gpus(job)}")
                        await reservations.release(lease)
                        await client.update_flow_run_labels(flow_run.id, {LEASE_LABEL: RELEASED})
        if cancelled:
            await self._mark_flow_run_as_cancelled(await self.client.read_flow_run(flow_run.id), {"message": "Cancelled: every rank stopped"})
            return FrenzyWorkerResult(status_code=0, identifier=result.identifier)  # not a crash
        return result

    async def _reserve(
        self, flow_run: FlowRun, job: TrainingJob, reservations: GpuReservations, client: PrefectClient
    ) -> tuple[TrainingJob, UUID] | None:
        """The job's plan placed on GPUs free now, and the lease that holds them; waits its
        turn. None if the run is cancelled while it waits."""
        logger = self.get_flow_run_logger(flow_run)
        waiting = self._waiting
        waiting.append(flow_run.id)
        plan, gpu_type = job.allocation.plan, job.allocation.gpu_type
        said = ""
        try:
            while not await _cancelling(client, flow_run.id):
                position = waiting.index(flow_run.id)
                if position == 0:
                    state = await reservations.state()
                    free = [(n, state.free_gpus[n.name]) for n in job.cluster.nodes if n.gpu_type == gpu_type]
                    placements = place(plan.gpus, free, group=plan.tp)
                    lease = placements and await reservations.acquire(placements, flow_run.id)
                    if lease:
                        placed = job.model_copy(update={"allocation": job.allocation.model_copy(update={"placements": placements})})
                        logger.info(f"Reserved GPUs {_gpus(placed)} of cluster {job.cluster.name!r}")
                        return placed, lease
                    reason = f"waiting for {plan.gpus} x {gpu_type}; {sum(len(g) for _, g in free)} free now, held by other runs"
                else:
                    reason = f"waiting for {plan.gpus} x {gpu_type}: position {position + 1} in this worker's queue"
                if reason != said:
                    logger.info(reason)
                    said = reason
                await anyio.sleep(RETRY_S)
            return None
        finally:
            waiting.remove(flow_run.id)

    async def _keep(self, reservations: GpuReservations, lease: UUID) -> None:
        while True:
            await anyio.sleep(LEASE_S / 4)
            await reservations.renew(lease)

    async def _launch(
        self, flow_run: FlowRun, configuration: FrenzyJobConfiguration, job: TrainingJob | None, task_status: Optional[anyio.abc.TaskStatus[Any]]
    ) -> tuple[FrenzyWorkerResult, bool]:
        """Start the run's processes and wait for them; (result, whether it was cancelled).
        Prefect's own cancellation only reaches runs that have not started, so the worker
        watches its running runs and stops every rank of one that is being cancelled."""
        launches = self.launches_for(configuration, job)
        with tempfile.TemporaryDirectory(prefix="frenzy-ssh-") as keys:
            if job is not None and configuration.launcher == "ssh":
                group = await start_ssh(launches, await _ssh_settings(configuration, Path(keys)), cwd=configuration.working_dir)
            else:
                group = await start_local(launches, cwd=configuration.working_dir)
            return await self._supervise(flow_run, configuration, group, launches, task_status)

    async def _supervise(
        self, flow_run: FlowRun, configuration: FrenzyJobConfiguration, group: ProcessGroup, launches: list[Launch], task_status: Optional[anyio.abc.TaskStatus[Any]]
    ) -> tuple[FrenzyWorkerResult, bool]:
        logger = self.get_flow_run_logger(flow_run)
        nodes = ", ".join(f"{l.node or l.host} x{l.processes}" for l in launches)
        logger.info(f"Started {sum(l.processes for l in launches)} process(es) on {nodes}; PIDs {group.identifier}")
        if task_status is not None:
            task_status.started(group.identifier)
        cancelled = anyio.Event()

        async def stop_when_cancelling() -> None:
            async with get_client() as client:
                while not await _cancelling(client, flow_run.id):
                    await anyio.sleep(CANCEL_POLL_S)
            cancelled.set()
            logger.info("Cancelling: stopping every rank")
            await stop_process_groups(group.pids, CANCEL_GRACE_S)

        async with anyio.create_task_group() as watch:
            watch.start_soon(stop_when_cancelling)
            code = await group.wait()
            watch.cancel_scope.cancel()
        if code != 0 and group.failure and not cancelled.is_set():  # issue 12, 7c: name the rank, node and signal
            logger.error(group.failure)
            await crash_naming_the_cause(self.client, flow_run.id, group.failure)
        if code == SSH_UNREACHABLE and configuration.launcher == "ssh":
            logger.error(
                f"ssh to {group.failed_host} failed (exit {code}): the host is unreachable, refused the key, or its host key "
                f"is not in {configuration.ssh_known_hosts}; every rank was stopped"
            )
        return FrenzyWorkerResult(status_code=code, identifier=group.identifier), cancelled.is_set()

    async def kill_infrastructure(
        self, infrastructure_pid: str, configuration: FrenzyJobConfiguration, grace_seconds: int = 30
    ) -> None:
        host, pids = host_and_pids(infrastructure_pid)
        if host != socket.gethostname():
            raise InfrastructureNotAvailable(f"the run's processes were started on {host}; only a worker there can stop them")
        await stop_process_groups(pids, grace_seconds)

    async def sync_with_backend(self) -> None:
        await super().sync_with_backend()
        if self._work_pool is not None:
            try:
                await self._reclaim_orphans()
            except Exception:  # never let housekeeping stop the worker's heartbeat
                self._logger.exception("Reclaiming the runs of lost workers failed; trying again at the next heartbeat")

    async def _reclaim_orphans(self) -> None:
        """Reclaim the runs of this pool whose worker is gone: stop what is left of their
        processes here, release their GPUs, and crash those not yet final (a rank that got the
        parent-death signal may have reported its run Crashed itself; its lease remains)."""
        pool = WorkPoolFilter(name=WorkPoolFilterName(any_=[self._work_pool_name]))
        active = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PENDING, StateType.RUNNING, StateType.CANCELLING])))
        ended = FlowRunFilter(end_time=FlowRunFilterEndTime(after_=datetime.now(timezone.utc) - timedelta(seconds=RECLAIM_WINDOW_S)))
        runs = [run for f in (active, ended) for run in await self.client.read_flow_runs(work_pool_filter=pool, flow_run_filter=f)]
        offline = {w.name for w in await self.client.read_workers_for_work_pool(self._work_pool_name) if w.status == WorkerStatus.OFFLINE}
        for run in {run.id: run for run in runs}.values():
            owner, lease = run.labels.get(PROCESS_LABEL), run.labels.get(LEASE_LABEL, RELEASED)
            final = run.state is not None and run.state.is_final()
            if owner is None or owner == _this_process() or RECLAIMED_LABEL in run.labels or (final and lease == RELEASED):
                continue
            host, (pid,) = host_and_pids(owner)
            if is_running(pid, group=False) if host == socket.gethostname() else run.labels.get(WORKER_LABEL) not in offline:
                continue
            started_on, pids = host_and_pids(run.infrastructure_pid or "")
            if started_on == socket.gethostname():
                await stop_process_groups(pids, CANCEL_GRACE_S)
            if lease != RELEASED:
                await self.client.release_concurrency_slots_with_lease(UUID(lease))  # a no-op once expired
            await self.client.update_flow_run_labels(run.id, {RECLAIMED_LABEL: self.name})
            message = f"its frenzy worker {run.labels.get(WORKER_LABEL)!r} ({owner}) is gone; {self.name!r} stopped its processes and released its GPUs"
            self.get_flow_run_logger(run).warning(f"Reclaimed: {message}")
            if not final:
                await self._propose_crashed_state(run, f"Crashed: {message}")


async def _cancelling(client: PrefectClient, flow_run_id: UUID) -> bool:
    state = (await client.read_flow_run(flow_run_id)).state
    return state is not None and state.type in (StateType.CANCELLING, StateType.CANCELLED)


def _check_pool_policy(job: TrainingJob, configuration: FrenzyJobConfiguration) -> None:
    """The pool's limits on what a training run may use; breaking one fails the run at once."""
    a = job.allocation
    if configuration.allowed_gpu_types is not None and a.gpu_type not in configuration.allowed_gpu_types:
        raise FrenzyError(f"this pool allows GPU types {', '.join(configuration.allowed_gpu_types)}; the run was allocated {a.gpu_type}")
    if configuration.max_gpus_per_run is not None and a.plan.gpus > configuration.max_gpus_per_run:
        raise FrenzyError(f"this pool allows at most {configuration.max_gpus_per_run} GPUs per run; the run needs {a.plan.gpus}")


async def _ssh_settings(configuration: FrenzyJobConfiguration, keys: Path) -> SshSettings:
    """The ssh launcher's settings; the key from its Secret block into a 0600 file under ``keys``."""
    missing = [n for n in ("ssh_user", "ssh_key_secret", "ssh_known_hosts") if getattr(configuration, n) is None]
    if missing:
        raise FrenzyError(f"the ssh launcher needs the pool's {', '.join(missing)} set (work pool job template variables)")
    try:
        secret = await Secret.aload(configuration.ssh_key_secret)
    except ValueError:
        raise FrenzyError(f"no Secret block named {configuration.ssh_key_secret!r} (ssh_key_secret) holds the SSH key") from None
    key = keys / "id"
    key.touch(mode=0o600)
    key.write_text(secret.get().rstrip("\n") + "\n")
    return SshSettings(
        user=configuration.ssh_user,
        port=configuration.ssh_port,
        identity_file=key,
        known_hosts=configuration.ssh_known_hosts,
        python=configuration.node_python or sys.executable,
    )


def _this_process() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _gpus(job: TrainingJob) -> str:
    return ", ".join(f"{p.node}{p.gpus}" for p in job.allocation.placements)
