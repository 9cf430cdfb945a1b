"""The `frenzy` work pool's worker: dispatches flow runs to the GPU nodes the allocator chose.

A flow run with a ``job`` parameter (a TrainingJob, as `train_llm` submits to the
`distributed-train` deployment) becomes one torchrun agent per allocated node, rank 0 of which
executes the flow run itself. Before starting it, the worker waits for the run's turn in the
pool's GPU queue (gpu_queue: one order across workers, per GPU type), places the job's plan on
the GPUs free then and takes them in one transaction (reservations). The hold is renewed while
the ranks run, through server outages, and released when they end, however they end. Any other
flow run (the `train_llm` pipeline) runs as one process on the worker's machine, like Prefect's
process worker.

Every process a worker starts dies with it (launch.orphan_guard), and every run it takes is
labelled (run_labels) so that a worker can reclaim the runs of one that is gone (reclaim).
Talking to the server, the worker rides out its transient faults (server_calls): a run fails
for its own reasons only.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.abc
from prefect.blocks.system import Secret
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.exceptions import InfrastructureNotAvailable
from prefect.workers.base import BaseJobConfiguration, BaseWorker, BaseWorkerResult
from pydantic import Field

from frenzy_prefect.blocks import CLUSTER_ENV
from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.launch.command import Launch
from frenzy_prefect.launch.local import ProcessGroup, host_and_pids, start_local, stop_process_groups
from frenzy_prefect.launch.ssh import SSH_UNREACHABLE, SshSettings, start_ssh
from frenzy_prefect.launch.torchrun import rank_launches
from frenzy_prefect.pool import run_labels
from frenzy_prefect.pool.crash import crash_naming_the_cause
from frenzy_prefect.pool.gpu_queue import GpuQueue, training_job_of
from frenzy_prefect.pool.reclaim import reclaim_lost_runs
from frenzy_prefect.pool.reservations import LEASE_S, GpuHold, GpuReservations, volatile_lease_storage_warning
from frenzy_prefect.pool.server_calls import is_transient, patiently
from frenzy_prefect.spec.plan import TrainingJob
from frenzy_prefect.storage.credentials import credentials_env, with_credentials

CANCEL_POLL_S = 1.0  # how often a running run's state is checked for cancellation


class FrenzyJobConfiguration(BaseJobConfiguration):
    """The pool's job template: each field is also a variable of the pool, typed and described
    here once (Prefect derives the variables' schema from these fields)."""

    cluster: str | None = Field(
        default=None,
        title="Cluster Block",
        description="FrenzyCluster block train-llm runs on this pool allocate on, unless a run's `cluster` parameter names another.",
    )
    storage_credentials: str | None = Field(
        default=None,
        title="Storage Credentials Block",
        description="prefect-aws block (aws-credentials/NAME, minio-credentials/NAME or s3-bucket/NAME) whose S3 keys a run's "
        "processes get in their environment (never in parameters or logs); default: the worker's environment.",
    )
    working_dir: Path | None = Field(
        default=None, title="Working Directory", description="Directory the run's processes start in; default: the worker's."
    )
    launcher: Literal["local", "ssh"] = Field(
        default="local",
        title="Launcher",
        description="local: ranks on the worker's machine; ssh: ranks on each allocated node's host, over SSH.",
    )
    ssh_user: str | None = Field(default=None, title="SSH User", description="Login on the nodes (ssh launcher).")
    ssh_port: int = Field(default=22, ge=1, le=65535, title="SSH Port", description="sshd's port on the nodes.")
    ssh_key_secret: str | None = Field(
        default=None,
        title="SSH Key Secret Block",
        description="Name of a Prefect Secret block holding the private key (never logged; written to a 0600 file for the run).",
    )
    ssh_known_hosts: Path | None = Field(
        default=None, title="SSH known_hosts", description="known_hosts file the nodes' host keys are checked against (required for ssh)."
    )
    node_python: str | None = Field(
        default=None, title="Node Python", description="Python with frenzy-prefect installed on the nodes; default: the worker's."
    )
    allowed_gpu_types: list[str] | None = Field(
        default=None, title="Allowed GPU Types", description="Training runs on other GPU types fail at once; default: any."
    )
    max_gpus_per_run: int | None = Field(
        default=None, ge=1, title="Max GPUs per Run", description="Training runs needing more GPUs fail at once; default: no cap."
    )

    @staticmethod
    def _base_flow_run_command() -> str:
        return shlex.join([sys.executable, "-m", "prefect.engine"])


class FrenzyWorkerResult(BaseWorkerResult):
    """Exit status of a run's processes (the first failure, else 0) and their PIDs."""


class FrenzyWorker(BaseWorker[FrenzyJobConfiguration, Any, FrenzyWorkerResult]):
    type = "frenzy"
    job_configuration = FrenzyJobConfiguration
    _display_name = "Frenzy"
    _description = (
        "Dispatches flow runs to the GPU nodes chosen by the Frenzy memory-aware allocator: "
        "one process per allocated GPU, ranks wired up by torch.distributed."
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._queue: GpuQueue | None = None

    async def setup(self) -> None:
        await super().setup()
        if warning := await volatile_lease_storage_warning(self.client):
            self._logger.warning(warning)

    def launches_for(
        self, configuration: FrenzyJobConfiguration, job: TrainingJob | None, credentials: dict[str, str] | None = None
    ) -> list[Launch]:
        """The run's processes; ``credentials``: the storage_credentials block's environment."""
        env = {k: v for k, v in {**os.environ, **configuration.env}.items() if v is not None}
        if configuration.cluster:
            env[CLUSTER_ENV] = configuration.cluster
        if credentials is not None:
            env = with_credentials(env, credentials)
        if job is None:
            return [Launch(host="127.0.0.1", argv=shlex.split(configuration.command or ""), env=env)]
        return rank_launches(job, python=sys.executable, env=env)  # the launcher picks the rendezvous port on the first node

    async def run(
        self,
        flow_run: FlowRun,
        configuration: FrenzyJobConfiguration,
        task_status: anyio.abc.TaskStatus[Any] | None = None,
    ) -> FrenzyWorkerResult:
        await self._label(flow_run, {run_labels.WORKER: self.name, run_labels.PROCESS: run_labels.this_process()})
        job = training_job_of(flow_run)
        if job is None:
            result, cancelled = await self._launch(flow_run, configuration, None, task_status)
        else:
            result, cancelled = await self._train(flow_run, configuration, job, task_status)
        if cancelled:
            return await self._cancelled(flow_run, cancelled, identifier=result.identifier)
        return result

    async def _train(
        self, flow_run: FlowRun, configuration: FrenzyJobConfiguration, job: TrainingJob, task_status
    ) -> tuple[FrenzyWorkerResult, str | None]:
        """A training run: its turn in the GPU queue, its ranks on the GPUs taken for it, the GPUs
        released however it ends; (result, why it was cancelled, if it was)."""
        _check_pool_policy(job, configuration)
        await patiently(GpuReservations(self.client, job.cluster).ensure, "creating the GPU reservation limits")
        if self._queue is None:
            self._queue = GpuQueue(self.client, self._work_pool_name, self.get_flow_run_logger)
        reserved = await self._queue.wait_turn(flow_run, job)
        if reserved is None:  # cancelled while it waited: nothing was taken or started
            return FrenzyWorkerResult(status_code=0, identifier=""), "Cancelled while waiting for GPUs"
        job, hold = reserved
        try:
            result, cancelled = await self._run_holding(flow_run, configuration, job, hold, task_status)
        finally:
            with anyio.CancelScope(shield=True):
                await self._release(flow_run, job, hold)
        if hold.lost.is_set():
            # (rank 0 may have reported its peers' stop as its own failure first: this is why)
            await crash_naming_the_cause(self.client, flow_run.id, f"every rank was stopped: {hold.lost_reason}", replaces_failure=True)
        return result, cancelled

    async def _run_holding(
        self, flow_run: FlowRun, configuration: FrenzyJobConfiguration, job: TrainingJob, hold: GpuHold, task_status
    ) -> tuple[FrenzyWorkerResult, str | None]:
        logger = self.get_flow_run_logger(flow_run)
        logger.info(f"Reserved GPUs {_gpus(job)} of cluster {job.cluster.name!r}")
        await self._label(flow_run, {run_labels.WAITING_FOR: "", run_labels.LEASE: str(hold.lease)})

        async def relabel(lease) -> None:
            await self._label(flow_run, {run_labels.LEASE: str(lease)})

        async with anyio.create_task_group() as renewals:
            renewals.start_soon(hold.keep, relabel)
            result = await self._launch(flow_run, configuration, job, task_status, hold)
            renewals.cancel_scope.cancel()
        return result

    async def _release(self, flow_run: FlowRun, job: TrainingJob, hold: GpuHold) -> None:
        self.get_flow_run_logger(flow_run).info(f"Releasing GPUs {_gpus(job)}")
        try:
            await hold.release()
            await self._label(flow_run, {run_labels.LEASE: run_labels.RELEASED})
        except Exception as exc:  # the lease then expires by itself
            self.get_flow_run_logger(flow_run).warning(
                f"Could not release GPUs {_gpus(job)} ({type(exc).__name__}); their lease expires within {LEASE_S:.0f} s"
            )

    async def _label(self, flow_run: FlowRun, labels: dict[str, str]) -> None:
        await patiently(lambda: self.client.update_flow_run_labels(flow_run.id, labels), "labelling the flow run")

    async def _give_worker_labels_to_flow_run(self, flow_run_id) -> None:
        # Prefect's own labelling at submission, which 'database is locked' made crash runs.
        await patiently(lambda: super(FrenzyWorker, self)._give_worker_labels_to_flow_run(flow_run_id), "labelling the flow run")

    async def _cancelled(self, flow_run: FlowRun, message: str, identifier: str) -> FrenzyWorkerResult:
        """Mark a run the worker saw being cancelled Cancelled, unless it is already (rank 0
        reports it so itself when it gets the SIGTERM in time: flows.distributed_train) or was
        never cancelled (a waiting run that stopped pending for another reason)."""
        run = await patiently(lambda: self.client.read_flow_run(flow_run.id), "reading the flow run")
        if run.state is not None and run.state.type in (StateType.CANCELLING, StateType.CRASHED):
            await patiently(lambda: self._mark_flow_run_as_cancelled(run, {"message": message}), "marking the flow run cancelled")
        return FrenzyWorkerResult(status_code=0, identifier=identifier)  # not a crash

    async def _launch(
        self,
        flow_run: FlowRun,
        configuration: FrenzyJobConfiguration,
        job: TrainingJob | None,
        task_status: anyio.abc.TaskStatus[Any] | None,
        hold: GpuHold | None = None,
    ) -> tuple[FrenzyWorkerResult, str | None]:
        """Start the run's processes and wait for them; (result, why it was cancelled, if it was)."""
        credentials = await credentials_env(configuration.storage_credentials) if configuration.storage_credentials else None
        launches = self.launches_for(configuration, job, credentials)
        with tempfile.TemporaryDirectory(prefix="frenzy-ssh-") as keys:
            if job is not None and configuration.launcher == "ssh":
                group = await start_ssh(launches, await _ssh_settings(configuration, Path(keys)), cwd=configuration.working_dir)
            else:
                group = await start_local(launches, cwd=configuration.working_dir)
            return await self._supervise(flow_run, configuration, group, launches, task_status, hold)

    async def _supervise(
        self,
        flow_run: FlowRun,
        configuration: FrenzyJobConfiguration,
        group: ProcessGroup,
        launches: list[Launch],
        task_status: anyio.abc.TaskStatus[Any] | None,
        hold: GpuHold | None,
    ) -> tuple[FrenzyWorkerResult, str | None]:
        """Wait for the run's processes. Prefect's own cancellation only reaches runs that have
        not started, so the worker watches its running runs and stops every rank of one that is
        being cancelled, or whose GPUs were lost to another run; a server outage only pauses the
        watching."""
        logger = self.get_flow_run_logger(flow_run)
        nodes = ", ".join(f"{l.node or l.host} x{l.processes}" for l in launches)
        logger.info(f"Started {sum(l.processes for l in launches)} process(es) on {nodes}; PIDs {group.identifier}")
        if task_status is not None:
            task_status.started(group.identifier)
        cancelled = anyio.Event()

        async def stop_when_cancelling() -> None:
            while not await self._is_cancelling(flow_run):
                await anyio.sleep(CANCEL_POLL_S)
            cancelled.set()
            logger.info("Cancelling: stopping every rank")
            await stop_process_groups(group.pids)

        async def stop_when_lost() -> None:
            await hold.lost.wait()
            logger.error(f"Stopping every rank: {hold.lost_reason}")
            await stop_process_groups(group.pids)

        try:
            async with anyio.create_task_group() as watch:
                watch.start_soon(stop_when_cancelling)
                if hold is not None:
                    watch.start_soon(stop_when_lost)
                code = await group.wait()
                watch.cancel_scope.cancel()
        except BaseException:  # the worker is stopping: ProcessGroup.wait signalled the ranks; they are gone before the GPUs go
            with anyio.CancelScope(shield=True):
                await stop_process_groups(group.pids)
            raise
        stopped_here = cancelled.is_set() or (hold is not None and hold.lost.is_set())
        if code != 0 and group.failure and not stopped_here:  # name the rank, its node and the signal
            logger.error(group.failure)
            await crash_naming_the_cause(self.client, flow_run.id, group.failure, replaces_failure=group.failed_rank not in (None, 0))
        if code == SSH_UNREACHABLE and configuration.launcher == "ssh":
            logger.error(
                f"ssh to {group.failed_host} failed (exit {code}): the host is unreachable, refused the key, or its host key "
                f"is not in {configuration.ssh_known_hosts}; every rank was stopped"
            )
        why_cancelled = "Cancelled: every rank stopped" if cancelled.is_set() else None
        return FrenzyWorkerResult(status_code=code, identifier=group.identifier), why_cancelled

    async def _is_cancelling(self, flow_run: FlowRun) -> bool:
        try:
            state = (await self.client.read_flow_run(flow_run.id)).state
        except Exception as exc:
            if is_transient(exc):
                return False  # the server is away: the ranks go on, and so does the watch
            raise
        return state is not None and state.type in (StateType.CANCELLING, StateType.CANCELLED)

    async def kill_infrastructure(self, infrastructure_pid: str, configuration: FrenzyJobConfiguration, grace_seconds: int = 30) -> None:
        host, pids = host_and_pids(infrastructure_pid)
        if host != socket.gethostname():
            raise InfrastructureNotAvailable(f"the run's processes were started on {host}; only a worker there can stop them")
        await stop_process_groups(pids, grace_seconds)

    async def sync_with_backend(self) -> None:
        await super().sync_with_backend()
        if self._work_pool is not None:
            try:
                await reclaim_lost_runs(self)
            except Exception:  # never let housekeeping stop the worker's heartbeat
                self._logger.exception("Reclaiming the runs of lost workers failed; trying again at the next heartbeat")


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


def _gpus(job: TrainingJob) -> str:
    return ", ".join(f"{p.node}{p.gpus}" for p in job.allocation.placements)
