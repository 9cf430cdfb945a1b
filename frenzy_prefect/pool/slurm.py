"""The `frenzy` pool on a Slurm cluster (``launcher: slurm``): the pool's Slurm variables as the
launcher's settings, a training run as one Slurm job (launch.slurm), and Slurm's own bookkeeping
of its GPUs in what the pool's queue hands out (a GPU held by a job that is not ours is free to
no run of the pool)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.launch.command import Launch
from frenzy_prefect.launch.slurm import PENDING, PLACED, SUBMITTED, SlurmSettings, SlurmSubmission, slurm_launch
from frenzy_prefect.launch.slurm_inventory import capacity_shortfall, free_counts, narrow_to_slurm, read_nodes
from frenzy_prefect.spec.cluster import ClusterSpec
from frenzy_prefect.spec.plan import JOB_ENV, TrainingJob

FreeNarrowing = Callable[[ClusterSpec, dict[str, list[int]]], Awaitable[dict[str, list[int]]]]
# How long the worker lets a signalled watcher end before SIGKILL: the watcher scancels the job and
# waits for its ranks' end itself, at most Slurm's KillWait plus launch.slurm.CANCEL_SLACK_S; this
# only bounds a watcher that hangs (killed, it would let the GPUs go while the ranks still run).
WATCHER_STOP_GRACE_S = 180.0


def slurm_settings(configuration: Any) -> SlurmSettings:
    """The launcher's settings from the pool's job configuration (FrenzyJobConfiguration)."""
    return SlurmSettings(
        partition=configuration.partition,
        account=configuration.account,
        qos=configuration.qos,
        time_limit=configuration.time_limit,
        sbatch_args=configuration.sbatch_args or [],
        python=configuration.node_python or sys.executable,
        working_dir=(configuration.working_dir or Path.cwd()).resolve(),
        slurm_conf=configuration.slurm_conf,
    )


def slurm_launches(configuration: Any, job: TrainingJob, env: dict[str, str]) -> list[Launch]:
    """The run's one launched command: the watcher of its Slurm job (named after the flow run)."""
    run_id = env.get("PREFECT__FLOW_RUN_ID", "")
    submission = SlurmSubmission(
        settings=slurm_settings(configuration),
        job_name=f"frenzy-{configuration.name or run_id}",
        comment=f"prefect flow run {run_id}",
        nodes=[(p.node, len(p.gpus)) for p in job.allocation.placements],
        max_restarts=job.request.max_restarts,
    )
    return [slurm_launch(submission, {**env, JOB_ENV: job.model_dump_json()}, gpus=job.allocation.plan.gpus)]


async def refuse_what_slurm_cannot_hold(job: TrainingJob, conf: Path | None) -> None:
    """FrenzyError, in one line, for a run Slurm can never place (its type's GPUs are too few,
    not Slurm's, or down): it fails at once instead of waiting in the queue."""
    nodes = await anyio.to_thread.run_sync(read_nodes, conf)
    for gpu_type, gpus in job.allocation.gpus_by_type().items():  # (a run across types: each of its types)
        if why := capacity_shortfall(job.cluster, gpu_type, gpus, nodes):
            raise FrenzyError(why)


SLURM_JOB_LABEL = "frenzy.slurm-job"  # the run's Slurm job id
PENDING_LABEL = "frenzy.slurm-pending"  # why Slurm holds it back (Resources, Priority, ...), empty once it runs


def slurm_log_forwarder(
    logger: logging.LoggerAdapter, label: Callable[[dict[str, str]], Awaitable[None]]
) -> Callable[[str], Awaitable[None]]:
    """The watcher's lines into the run's log; its job id and pending reason into its labels."""
    job = ""

    async def forward(line: str) -> None:
        nonlocal job
        logger.info(line)
        if line.startswith(SUBMITTED):
            job = line.removeprefix(SUBMITTED).split()[0]
            await label({SLURM_JOB_LABEL: job, PENDING_LABEL: ""})
        elif job and line.startswith(prefix := PENDING.format(job=job)):
            await label({PENDING_LABEL: line.removeprefix(prefix)})
        elif job and line.startswith(PLACED.format(job=job)):
            await label({PENDING_LABEL: ""})

    return forward


def slurm_free_narrowing(conf: Path | None) -> FreeNarrowing:
    """What the pool's queue calls on the GPUs its reservations leave free: cut to Slurm's free counts."""

    async def narrow(cluster: ClusterSpec, free: dict[str, list[int]]) -> dict[str, list[int]]:
        nodes = await anyio.to_thread.run_sync(read_nodes, conf)
        return narrow_to_slurm(free, free_counts(nodes))

    return narrow
