"""The `frenzy` work pool's worker: dispatches flow runs to the GPU nodes the allocator chose.

A flow run with a ``job`` parameter (a TrainingJob, as `train_llm` submits to the
`distributed-train` deployment) becomes one torchrun agent per allocated node, rank 0 of which
executes the flow run itself. Any other flow run (the `train_llm` pipeline) runs as one
process on the worker's machine, like Prefect's process worker.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

import anyio.abc
from prefect.client.schemas.objects import FlowRun
from prefect.workers.base import BaseJobConfiguration, BaseVariables, BaseWorker, BaseWorkerResult
from pydantic import Field

from frenzy_prefect.launch.command import Launch
from frenzy_prefect.launch.local import start_local, stop_process_groups
from frenzy_prefect.launch.torchrun import rank_launches
from frenzy_prefect.spec.plan import TrainingJob
from frenzy_prefect.training.distributed import free_port

JOB_PARAMETER = "job"


class FrenzyJobConfiguration(BaseJobConfiguration):
    working_dir: Optional[Path] = Field(default=None)

    @staticmethod
    def _base_flow_run_command() -> str:
        return shlex.join([sys.executable, "-m", "prefect.engine"])


class FrenzyVariables(BaseVariables):
    working_dir: Optional[Path] = Field(
        default=None,
        title="Working Directory",
        description="Directory the run's processes start in; default: the worker's.",
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

    def launches_for(self, flow_run: FlowRun, configuration: FrenzyJobConfiguration) -> list[Launch]:
        env = {k: v for k, v in {**os.environ, **configuration.env}.items() if v is not None}
        job = training_job_of(flow_run)
        if job is None:
            return [Launch(host="127.0.0.1", argv=shlex.split(configuration.command or ""), env=env)]
        return rank_launches(job, python=sys.executable, master_port=free_port(), env=env)

    async def run(
        self,
        flow_run: FlowRun,
        configuration: FrenzyJobConfiguration,
        task_status: Optional[anyio.abc.TaskStatus[Any]] = None,
    ) -> FrenzyWorkerResult:
        logger = self.get_flow_run_logger(flow_run)
        launches = self.launches_for(flow_run, configuration)
        nodes = ", ".join(f"{l.node or l.host} x{l.processes}" for l in launches)
        group = await start_local(launches, cwd=configuration.working_dir)
        logger.info(f"Started {sum(l.processes for l in launches)} process(es) on {nodes}; PIDs {group.identifier}")
        if task_status is not None:
            task_status.started(group.identifier)
        code = await group.wait()
        return FrenzyWorkerResult(status_code=code, identifier=group.identifier)

    async def kill_infrastructure(
        self, infrastructure_pid: str, configuration: FrenzyJobConfiguration, grace_seconds: int = 30
    ) -> None:
        await stop_process_groups([int(p) for p in infrastructure_pid.split(",") if p], grace_seconds)
