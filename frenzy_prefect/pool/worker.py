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
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.abc
from prefect.blocks.system import Secret
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
from prefect.client.schemas.objects import FlowRun, State, StateType
from prefect.exceptions import InfrastructureNotAvailable
from prefect.states import Cancelled, Cancelling
from prefect.workers.base import BaseJobConfiguration, BaseWorker, BaseWorkerResult
from pydantic import Field

from frenzy_prefect.blocks import CLUSTER_ENV
from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.launch.command import Launch
from frenzy_prefect.launch.local import STOP_GRACE_S, ProcessGroup, host_and_pids, start_local, stop_process_groups
from frenzy_prefect.launch.ssh import SSH_UNREACHABLE, SshSettings, start_ssh
from frenzy_prefect.launch.torchrun import rank_launches
from frenzy_prefect.launch.watcher import start_watcher
from frenzy_prefect.pool import run_labels
from frenzy_prefect.pool.crash import crash_naming_the_cause
from frenzy_prefect.pool.gpu_queue import GpuQueue, training_job_of
from frenzy_prefect.pool.kubernetes import (
    cluster_connection,
    gpu_products,
    kubernetes_free_narrowing,
    kubernetes_launches,
    kubernetes_log_forwarder,
)
from frenzy_prefect.pool.leaks import LeakedGpus
from frenzy_prefect.pool.reclaim import reclaim_lost_runs
from frenzy_prefect.pool.reservations import LEASE_S, GpuHold, GpuReservations, renew_every_s, volatile_lease_storage_warning
from frenzy_prefect.pool.server_calls import is_transient, patiently
from frenzy_prefect.pool.slurm import (
    WATCHER_STOP_GRACE_S,
    refuse_what_slurm_cannot_hold,
    slurm_free_narrowing,
    slurm_launches,
    slurm_log_forwarder,
)
from frenzy_prefect.spec.plan import TrainingJob
from frenzy_prefect.storage.credentials import credentials_env, with_credentials
from frenzy_prefect.training.fence import ATTEMPT_ENV, first_attempt

CANCEL_POLL_S = 1.0  # how often a running run's state is checked for cancellation
EXIT_FLUSH_S = 3.0  # how long a stopped worker's process may spend flushing its last events and logs
SLURM_LATE_REPORT_S = 10.0  # a Slurm job may end before its ranks on a failed node report their SIGTERM
ENDED_GRACE_S = 60.0  # how long a run's processes may outlive its final state (rank 0 exits first)
CHILDREN_CANCEL_WAIT_S = 30.0  # for a cancelled pipeline run to end itself once its training runs are (their ranks stop in ~7 s)


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
    launcher: Literal["local", "ssh", "slurm", "kubernetes"] = Field(
        default="local",
        title="Launcher",
        description="local: ranks on the worker's machine; ssh: ranks on each allocated node's host, over SSH; "
        "slurm: each training run one Slurm job on the allocated nodes (sbatch + srun); "
        "kubernetes: each training run one JobSet, one pod per allocated node.",
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
    partition: str | None = Field(default=None, title="Slurm Partition", description="sbatch --partition (slurm launcher).")
    account: str | None = Field(default=None, title="Slurm Account", description="sbatch --account (slurm launcher).")
    qos: str | None = Field(default=None, title="Slurm QOS", description="sbatch --qos (slurm launcher).")
    time_limit: str | None = Field(default=None, title="Slurm Time Limit", description="sbatch --time, e.g. 4:00:00 (slurm launcher).")
    sbatch_args: list[str] | None = Field(
        default=None, title="Extra sbatch Arguments", description="Further sbatch options, one argument each, e.g. --cpus-per-task=8."
    )
    slurm_conf: Path | None = Field(
        default=None, title="Slurm Config", description="slurm.conf for the worker's Slurm commands (SLURM_CONF); default: Slurm's own."
    )
    cluster_config: str | None = Field(
        default=None,
        title="Kubernetes Cluster Config Block",
        description="KubernetesClusterConfig block (prefect-kubernetes) to reach the cluster; default: in-cluster, else KUBECONFIG.",
    )
    image: str | None = Field(default=None, title="Image", description="The pods' image, with frenzy-prefect installed (kubernetes).")
    namespace: str = Field(default="default", title="Namespace", description="Where the run's JobSet goes (kubernetes).")
    service_account_name: str | None = Field(default=None, title="Service Account", description="The pods' service account.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, title="Image Pull Policy", description="The pods' imagePullPolicy; default: Kubernetes' own (kubernetes)."
    )
    kubernetes_api: Literal["auto", "jobset", "job"] = Field(
        default="auto",
        title="Kubernetes API",
        description="jobset (JobSet CRD), job (Indexed Jobs + a headless Service), or auto: JobSet where the cluster serves it.",
    )
    resources: dict[str, dict[str, str | int]] | None = Field(
        default=None, title="Pod Resources", description="The pod's requests and limits besides its GPUs, e.g. {requests: {cpu: 8}}."
    )
    pod_spec: dict[str, Any] | None = Field(
        default=None, title="Extra Pod Spec", description="Further pod-spec fields: tolerations, volumes, nodeSelector, priorityClassName."
    )
    storage_secret: str | None = Field(
        default=None,
        title="Storage Secret",
        description="Kubernetes Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY the pods read S3 with (secretKeyRef).",
    )
    api_key_secret: str | None = Field(
        default=None, title="Prefect API Key Secret", description="Kubernetes Secret whose key 'key' is the Prefect API key (kubernetes)."
    )
    ttl_seconds_after_finished: int = Field(default=3600, ge=0, title="TTL After Finished", description="JobSet/Job cleanup (s).")
    rendezvous_port: int = Field(default=29500, ge=1, le=65535, title="Rendezvous Port", description="torchrun's port in pod 0.")
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
        "one process per allocated GPU, ranks wired up by torch.distributed. Runs wait in one queue per GPU type "
        "across the pool's workers; frenzy.gpu.waiting, frenzy.gpu.reserved and frenzy.gpu.released events say when."
    )
    # Prefect's catalogue entry (the work pool type picker). The project has no public home yet:
    # the page on writing and running workers, and the process worker's logo (also a local-process
    # launcher), both Prefect's own and published.
    _documentation_url = "https://docs.prefect.io/v3/concepts/workers"
    _logo_url = (
        "https://raw.githubusercontent.com/PrefectHQ/prefect/420d0d6a78bb6df1fc18bcf188fdad43c1d22ea9/assets/block-logos/process.png"
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._queue: GpuQueue | None = None
        self._leaks: LeakedGpus | None = None
        self._runs_in_flight = 0
        self._torn_down = False  # then Prefect says the worker stopped (`prefect worker start`)
        self._unbind_stop: Callable[[], None] = lambda: None

    async def setup(self) -> None:
        renew_every_s()  # a bad setting stops the worker now, not a run's renewals later
        self._unbind_stop = _bound_the_stop(lambda: self._runs_in_flight, self._stopped_line)
        await super().setup()
        if warning := await volatile_lease_storage_warning(self.client):
            self._logger.warning(warning)

    async def teardown(self, *exc_info: Any) -> None:
        """Once stopped (its runs' processes stopped and their GPUs released), the process exits
        within EXIT_FLUSH_S: of the SIGTERM, or, the runs in flight, of their release
        (_bound_the_stop), and within EXIT_FLUSH_S of its main thread's end however it was
        stopped. What is left then is Prefect's events worker sending the worker's last events,
        which it waits for with no bound of its own (its interpreter-shutdown hook): against a
        server that does not answer, 10-13 s measured, an idle worker taking that long to go."""
        try:
            await super().teardown(*exc_info)
        finally:
            self._torn_down = True
            self._unbind_stop()
            if exc_info[0] is None or not issubclass(exc_info[0], Exception):  # stopped, not crashed: exit code 0
                # The hook Prefect's services register their flush with: run at interpreter
                # shutdown, the latest registered first, so the timer starts before their flush.
                threading._register_atexit(_exit_within, EXIT_FLUSH_S)

    def _stopped_line(self) -> str | None:
        """What the exit bound says as the process ends: Prefect's line, which `prefect worker
        start` prints once the teardown is over (None then: it has)."""
        if self._torn_down:
            return None
        return f"Worker {self.name!r} stopped! (its shutdown cut short after {EXIT_FLUSH_S:g} s: events not sent by then are dropped)"

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
        if configuration.launcher == "slurm":
            return slurm_launches(configuration, job, env)
        return rank_launches(job, python=sys.executable, env=env)  # the launcher picks the rendezvous port on the first node

    async def run(
        self,
        flow_run: FlowRun,
        configuration: FrenzyJobConfiguration,
        task_status: anyio.abc.TaskStatus[Any] | None = None,
    ) -> FrenzyWorkerResult:
        self._runs_in_flight += 1
        try:
            await self._label(flow_run, {run_labels.WORKER: self.name, run_labels.PROCESS: run_labels.this_process()})
            job = training_job_of(flow_run)
            if job is None:
                result, cancelled = await self._launch(flow_run, configuration, None, task_status)
            else:
                result, cancelled = await self._train(flow_run, configuration, job, task_status)
        finally:
            self._runs_in_flight -= 1
        if cancelled:
            return await self._cancelled(flow_run, cancelled, identifier=result.identifier)
        return result

    async def _cancel_training_runs(self, flow_run: FlowRun, say: Callable[[str], None]) -> bool:
        """A pipeline run (train-llm) being cancelled: its training runs still going are
        cancelled now (Prefect's server would at its next cancellation sweep, up to 20 s later,
        their ranks training meanwhile); whether there were any."""
        children = FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run.id]))
        read = await patiently(lambda: self.client.read_flow_runs(flow_run_filter=children), "reading the run's training runs")
        live = [c for c in read if not _is_final(c)]
        why = f"its pipeline run {flow_run.name!r} was cancelled"
        for child in live:  # (one that has not started yet, at once)
            state = Cancelled(message=why) if child.state_type == StateType.SCHEDULED else Cancelling(message=why)
            await patiently(lambda c=child, s=state: self.client.set_flow_run_state(c.id, s), "cancelling a training run")
        if live:
            names = ", ".join(repr(c.name) for c in live)
            say(f"Cancelling: cancelling its training run {names} first; the run ends once it sees that run cancelled")
        return bool(live)

    async def _train(
        self, flow_run: FlowRun, configuration: FrenzyJobConfiguration, job: TrainingJob, task_status
    ) -> tuple[FrenzyWorkerResult, str | None]:
        """A training run: its turn in the GPU queue, its ranks on the GPUs taken for it, the GPUs
        released however it ends; (result, why it was cancelled, if it was)."""
        _check_pool_policy(job, configuration)
        _check_ssh_launcher(configuration)  # before any GPU is reserved
        if configuration.launcher == "slurm":
            await refuse_what_slurm_cannot_hold(job, configuration.slurm_conf)
        await patiently(GpuReservations(self.client, job.cluster).ensure, "creating the GPU reservation limits")
        if self._queue is None:
            narrowing = None
            if configuration.launcher == "slurm":
                narrowing = slurm_free_narrowing(configuration.slurm_conf)
            elif configuration.launcher == "kubernetes":
                narrowing = kubernetes_free_narrowing(await cluster_connection(configuration))
            self._queue = GpuQueue(
                self.client, self._work_pool_name, self.get_flow_run_logger, pool_id=self.work_pool.id, narrow_free=narrowing
            )
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

        with _ungrouped():
            async with anyio.create_task_group() as renewals:
                renewals.start_soon(hold.keep, relabel, logger.warning)
                result = await self._launch(flow_run, configuration, job, task_status, hold)
                renewals.cancel_scope.cancel()
        return result

    async def _release(self, flow_run: FlowRun, job: TrainingJob, hold: GpuHold) -> None:
        self.get_flow_run_logger(flow_run).info(f"Releasing GPUs {_gpus(job)}")
        try:
            await hold.release()
            await self._label(flow_run, {run_labels.LEASE: run_labels.RELEASED, run_labels.GPUS: ""})
        except Exception as exc:  # the lease then expires by itself (a forgotten one's slots: leaks.py)
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
        if job is not None:  # this attempt's place among the run's (training.fence): every launcher passes it on
            configuration.env[ATTEMPT_ENV] = first_attempt()
        if job is not None and configuration.launcher == "kubernetes":
            launches = await _kubernetes_launches(configuration, job)
        else:
            credentials = await credentials_env(configuration.storage_credentials) if configuration.storage_credentials else None
            launches = self.launches_for(configuration, job, credentials)
        with tempfile.TemporaryDirectory(prefix="frenzy-ssh-") as keys:
            if job is not None and configuration.launcher == "kubernetes":
                forward = kubernetes_log_forwarder(
                    self.get_flow_run_logger(flow_run),
                    lambda labels: self._label(flow_run, labels),
                    flow_run,
                    self._work_pool_name,
                    self.work_pool.id,
                )
                group = await start_watcher(launches[0], forward, cwd=configuration.working_dir)
            elif job is not None and configuration.launcher == "slurm":
                forward = slurm_log_forwarder(self.get_flow_run_logger(flow_run), lambda labels: self._label(flow_run, labels))
                group = await start_watcher(launches[0], forward, cwd=configuration.working_dir)
            elif job is not None and configuration.launcher == "ssh":
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
        being cancelled, whose GPUs were lost to another run, or that ended ENDED_GRACE_S ago
        (its GPUs are released only once its processes are gone); a server outage only pauses
        the watching."""
        logger = self.get_flow_run_logger(flow_run)
        what = "every rank" if hold is not None else "its process"  # (a training run holds GPUs; a pipeline run, none)
        # (the Slurm watcher, signalled, waits for the ranks' end itself: its GPUs go only once they are gone)
        grace_s = WATCHER_STOP_GRACE_S if configuration.launcher == "slurm" else STOP_GRACE_S
        nodes = ", ".join(f"{l.node or l.host} x{l.processes}" for l in launches)
        logger.info(f"Started {sum(l.processes for l in launches)} process(es) on {nodes}; PIDs {group.identifier}")
        if task_status is not None:
            task_status.started(group.identifier)
        cancelled, over = anyio.Event(), anyio.Event()

        async def stop_when_cancelling_or_over() -> None:
            ended = None  # when the run was first seen in a final state
            while True:
                state = await self._state_of(flow_run)
                if state is not None and state.type in (StateType.CANCELLING, StateType.CANCELLED):
                    cancelled.set()
                    if hold is None and await self._cancel_training_runs(flow_run, logger.info):
                        # it ends itself then, Cancelled (group.wait returning ends this wait)
                        await anyio.sleep(CHILDREN_CANCEL_WAIT_S)
                    logger.info(f"Cancelling: stopping {what}")
                    break
                ended = (ended or time.monotonic()) if state is not None and state.is_final() else None
                if ended is not None and time.monotonic() - ended > ENDED_GRACE_S:
                    over.set()  # (its GPUs must not stay held by processes nobody waits for)
                    logger.warning(f"The run ended ({state.type.value}) {ENDED_GRACE_S:.0f} s ago; its processes still ran: stopping them")
                    break
                await anyio.sleep(CANCEL_POLL_S)
            await stop_process_groups(group.pids, grace_s)

        async def stop_when_lost() -> None:
            await hold.lost.wait()
            logger.error(f"Stopping every rank: {hold.lost_reason}")
            await stop_process_groups(group.pids, grace_s)

        try:
            async with anyio.create_task_group() as watch:
                watch.start_soon(stop_when_cancelling_or_over)
                if hold is not None:
                    watch.start_soon(stop_when_lost)
                code = await group.wait()
                watch.cancel_scope.cancel()
        except BaseException:  # the worker is stopping: ProcessGroup.wait signalled the ranks; they are gone before the GPUs go
            with anyio.CancelScope(shield=True):
                await stop_process_groups(group.pids, grace_s)
            raise
        stopped_here = cancelled.is_set() or over.is_set() or (hold is not None and hold.lost.is_set())
        if code != 0 and group.failure and not stopped_here:  # name the rank, its node and the signal
            logger.error(group.failure)
            settle_s = SLURM_LATE_REPORT_S if configuration.launcher == "slurm" else 0.0
            await crash_naming_the_cause(
                self.client, flow_run.id, group.failure, replaces_failure=group.failed_rank not in (None, 0), settle_s=settle_s
            )
        if code == SSH_UNREACHABLE and configuration.launcher == "ssh":
            logger.error(
                f"ssh to {group.failed_host} failed (exit {code}): the host is unreachable, refused the key, or its host key "
                f"is not in {configuration.ssh_known_hosts}; every rank was stopped"
            )
        why_cancelled = f"Cancelled: {what} stopped" if cancelled.is_set() else None
        return FrenzyWorkerResult(status_code=code, identifier=group.identifier), why_cancelled

    async def _state_of(self, flow_run: FlowRun) -> State | None:
        try:
            return (await self.client.read_flow_run(flow_run.id)).state
        except Exception as exc:
            if is_transient(exc):
                return None  # the server is away: the ranks go on, and so does the watch
            raise

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
                if self._leaks is None:
                    self._leaks = LeakedGpus(self.client, self._logger)
                await self._leaks.sweep()
            except Exception:  # never let housekeeping stop the worker's heartbeat
                self._logger.exception("Reclaiming lost runs or leaked GPUs failed; trying again at the next heartbeat")


def _bound_the_stop(in_flight: Callable[[], int], stopped_line: Callable[[], str | None]) -> Callable[[], None]:
    """On SIGTERM (what `prefect worker start` turns into its stop) the process exits within
    EXIT_FLUSH_S, counted from the signal or, with runs in flight, from when the last of them has
    stopped its ranks and released its GPUs, whatever else its shutdown waits for: its teardown
    (closing the worker channel, the cancellation observer's event stream, the client) and
    Prefect's events flush can each wait on a server that does not answer or is down (seen past
    60 s on a loaded host); with its runs stopped and no GPU held, nothing is lost by not waiting.
    Before it exits so it says ``stopped_line()`` on stdout, unless that is None (Prefect said
    its own), so that a stop always ends with a line. Returns what puts the previous handler
    back, unless another has replaced this one since (Prefect's, after a first SIGTERM)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # a worker run inside another program (its signals are that program's)
    previous = signal.getsignal(signal.SIGTERM)
    started = threading.Event()

    def on_sigterm(signum: int, frame: Any) -> None:
        if not started.is_set():
            started.set()
            threading.Thread(target=_exit_once_stopped, args=(in_flight, stopped_line), name="frenzy-exit-bound", daemon=True).start()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:  # then what it would have done: end the process
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_sigterm)

    def unbind() -> None:
        if signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, previous)

    return unbind


def _exit_once_stopped(in_flight: Callable[[], int], stopped_line: Callable[[], str | None]) -> None:
    """End the process (exit code 0) EXIT_FLUSH_S after no run is in flight any more."""
    deadline = time.monotonic() + EXIT_FLUSH_S
    while time.monotonic() < deadline or in_flight():
        if in_flight():
            deadline = time.monotonic() + EXIT_FLUSH_S
        time.sleep(0.05)
    if line := stopped_line():
        os.write(1, f"{line}\n".encode())
    os._exit(0)


def _exit_within(seconds: float) -> None:
    """End the process (exit code 0) in ``seconds`` unless it has ended by then (the other
    shutdown hooks run meanwhile)."""
    timer = threading.Timer(seconds, os._exit, args=(0,))
    timer.daemon = True
    timer.start()


def _is_final(run: FlowRun) -> bool:
    return run.state is not None and run.state.is_final()


def _check_pool_policy(job: TrainingJob, configuration: FrenzyJobConfiguration) -> None:
    """The pool's limits on what a training run may use; breaking one fails the run at once."""
    a = job.allocation
    if configuration.allowed_gpu_types is not None and (
        barred := [t for t in a.gpus_by_type() if t not in configuration.allowed_gpu_types]
    ):
        raise FrenzyError(
            f"this pool allows GPU types {', '.join(configuration.allowed_gpu_types)}; the run was allocated {a.gpu_type}, "
            f"and {', '.join(barred)} is not allowed"
        )
    if configuration.max_gpus_per_run is not None and a.plan.gpus > configuration.max_gpus_per_run:
        raise FrenzyError(f"this pool allows at most {configuration.max_gpus_per_run} GPUs per run; the run needs {a.plan.gpus}")


def _check_ssh_settings_set(configuration: FrenzyJobConfiguration) -> None:
    missing = [n for n in ("ssh_user", "ssh_key_secret", "ssh_known_hosts") if getattr(configuration, n) is None]
    if missing:
        raise FrenzyError(f"the ssh launcher needs the pool's {', '.join(missing)} set (work pool job template variables)")


def _check_ssh_launcher(configuration: FrenzyJobConfiguration) -> None:
    """The ssh launcher's settings, each set and the known_hosts file readable (ssh would only
    say it cannot verify the host, after the GPUs were reserved)."""
    if configuration.launcher != "ssh":
        return
    _check_ssh_settings_set(configuration)
    path = configuration.ssh_known_hosts
    if not (path.is_file() and os.access(path, os.R_OK)):
        problem = "is not a readable file" if path.exists() else "does not exist"
        raise FrenzyError(
            f"the ssh launcher's known_hosts file {path} {problem}: set the pool's ssh_known_hosts job variable to a readable "
            "file holding the nodes' host keys (e.g. the output of ssh-keyscan -p PORT HOST)"
        )


@contextmanager
def _ungrouped() -> Iterator[None]:
    """A lone exception out of a task group as itself: anyio groups even one, and the run's state
    would say "ExceptionGroup: unhandled errors in a TaskGroup" instead of what went wrong."""
    try:
        yield
    except BaseExceptionGroup as group:
        lone: BaseException = group
        while isinstance(lone, BaseExceptionGroup) and len(lone.exceptions) == 1:
            lone = lone.exceptions[0]
        if lone is group:
            raise
        raise lone from None


async def _ssh_settings(configuration: FrenzyJobConfiguration, keys: Path) -> SshSettings:
    """The ssh launcher's settings; the key from its Secret block into a 0600 file under ``keys``."""
    _check_ssh_settings_set(configuration)
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


async def _kubernetes_launches(configuration: FrenzyJobConfiguration, job: TrainingJob) -> list[Launch]:
    """The watcher of the run's JobSet: the pods' environment is the run's job configuration's
    (never the worker's own), S3 keys from the pool's storage_secret."""
    if configuration.storage_credentials:
        raise FrenzyError(
            "the kubernetes launcher's pods read S3 keys from a Kubernetes Secret: set storage_secret, not storage_credentials"
        )
    kube = await cluster_connection(configuration)
    extra = {CLUSTER_ENV: configuration.cluster} if configuration.cluster else {}
    return kubernetes_launches(configuration, job, extra, kube, await gpu_products(kube))


def _gpus(job: TrainingJob) -> str:
    return ", ".join(f"{p.node}{p.gpus}" for p in job.allocation.placements)
