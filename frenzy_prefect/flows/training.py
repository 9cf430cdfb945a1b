"""The training flows: `train-llm` (the pipeline step a data team adds) and `distributed-train` (its
ranks, which the `frenzy` worker starts)."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import nullcontext
from typing import NoReturn

from prefect import flow, pause_flow_run
from prefect.context import FlowRunContext
from prefect.input import RunInput
from prefect.logging import get_run_logger
from prefect.logging.handlers import APILogHandler
from prefect.runtime import flow_run
from prefect.states import Cancelled, Failed, State
from pydantic import Field

from frenzy_prefect.blocks import cluster_block_name
from frenzy_prefect.datasets.prepare import for_model
from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.flows.cancellation import sigterm_cancels_when_cancelling
from frenzy_prefect.flows.rank_deaths import crashed_naming_a_dead_rank, noting_a_restart
from frenzy_prefect.flows.reporting import TrainingReporter
from frenzy_prefect.flows.restarts import failures_restart_while_torchrun_can, restarts_left
from frenzy_prefect.flows.tasks import (
    allocate,
    estimate_memory,
    prepare_dataset,
    profile_cluster,
    profile_dataset,
    profile_model,
    record_run,
    report,
    train,
)
from frenzy_prefect.profiling.dataset import is_token_data
from frenzy_prefect.spec.plan import PlanCandidate, TrainingJob
from frenzy_prefect.spec.request import TrainingRequest
from frenzy_prefect.spec.result import TrainingReport, TrainingResult

TRAINING_DEPLOYMENT = "distributed-train/frenzy"  # deployments named otherwise pass their own (deployments.py)


def _folder(uri: str) -> str:
    """The folder holding ``uri`` (a path or URI; "." for a bare name)."""
    uri = uri.rstrip("/")
    return uri.rsplit("/", 1)[0] if "/" in uri else "."


def default_output(dataset: str, run_name: str) -> str:
    """Beside the dataset: <dataset dir>/frenzy-runs/<flow run name> (a raw prefix's parent, not inside it)."""
    return f"{_folder(dataset)}/frenzy-runs/{run_name}"


def calibration_store_uri(output: str, cluster: str) -> str:
    """The cluster's calibration store: beside the run's output folder (by default, the
    dataset's frenzy-runs/), so the runs that write there share it."""
    return f"{_folder(output)}/frenzy-calibration/{cluster}.json"


class PlanChoice(RunInput):
    """What a person answers when train-llm pauses for approval (`approve`)."""

    run: bool = Field(default=True, description="Run a plan (false: decline; the run ends Cancelled).")
    plan: int = Field(default=1, ge=1, description="Which plan: its # in the memory-estimates artifact (1: the first, the allocator's).")


def chosen_first(candidates: list[PlanCandidate], rank: int) -> list[PlanCandidate]:
    """The candidates with the one ranked ``rank`` (1-based) first, if it fits."""
    if rank > len(candidates) or not candidates[rank - 1].fits:
        fitting = sum(c.fits for c in candidates)
        raise FrenzyError(f"plan #{rank} cannot run: choose one of the {fitting} plans that fit, #1 to #{fitting}")
    return [candidates[rank - 1], *candidates[: rank - 1], *candidates[rank:]]


@flow(name="train-llm")
def train_llm(
    request: TrainingRequest,
    cluster: str | None = None,
    training_deployment: str = TRAINING_DEPLOYMENT,
    approve: bool = False,
    plan_only: bool = False,
    approval_timeout_s: int = 3600,
) -> TrainingReport | State | None:
    """Train ``request.model`` on ``request.dataset``: prepare it if it is raw text, profile,
    estimate memory, allocate GPUs, train on them, report. ``cluster`` names a FrenzyCluster
    block; default: the `cluster` variable of the frenzy work pool the run is on. The ranked
    plans (predicted memory, time, cost) are the `memory-estimates` artifact; ``plan_only`` stops
    there, and ``approve`` pauses there for a person to accept the first, pick another or
    decline, before any GPU is asked for.

    A cause the run can name (bad input, missing data, no plan that fits, the training run's
    failure) ends it Failed with that one line as its state message, which `prefect deployment
    run --watch` and the UI's run list show; a cancelled training run ends it Cancelled."""
    context = FlowRunContext.get()
    try:
        with sigterm_cancels_when_cancelling(context.flow_run.id) if context and context.flow_run else nullcontext():
            return _train_llm(request, cluster, training_deployment, approve, plan_only, approval_timeout_s)
    except FrenzyError as exc:
        if context is not None and context.flow_run is not None and context.flow_run.run_count <= context.flow.retries:
            raise  # (the engine retries it)
        return Failed(message=str(exc))


def _train_llm(
    request: TrainingRequest, cluster: str | None, training_deployment: str, approve: bool, plan_only: bool, approval_timeout_s: int
) -> TrainingReport | State | None:
    cluster = cluster_block_name(cluster)  # before any work: a run that names no cluster fails at once
    model = profile_model(request)
    data = request.dataset
    if request.prepare is not None or not is_token_data(data):
        data = prepare_dataset(data, for_model(request.prepare, model.vocab_size)).manifest_uri
    dataset = profile_dataset(request, model, data)
    state = profile_cluster(cluster)
    output = request.output or default_output(request.dataset, flow_run.get_name() or "local")
    store = calibration_store_uri(output, state.cluster.name)
    candidates = estimate_memory(model, request, state, store)
    if plan_only:
        return None
    if approve:
        choice = pause_flow_run(wait_for_input=PlanChoice, timeout=approval_timeout_s)
        if not choice.run:
            return Cancelled(message="the plans were not approved")
        candidates = chosen_first(candidates, choice.plan)
    allocation = allocate(candidates, state) if approve else allocate(candidates, state, model, request)  # (a person's choice stands)
    job = TrainingJob(
        request=request,
        model=model,
        dataset=dataset,
        allocation=allocation,
        cluster=state.cluster,
        output=output,
        run=flow_run.get_id() or "local",  # a retry of this flow run resumes from its checkpoints
    )
    result, training_run = train(job, training_deployment)
    if result is None:  # (training_run: its name then)
        return Cancelled(message=f"its training run {training_run} was cancelled")
    summary = report(job, result, training_run)
    record_run(job, result, training_run, store)
    return summary


@flow(name="distributed-train")
def distributed_train(job: TrainingJob) -> TrainingResult:
    """Rank 0 of a training job (the `frenzy` worker starts the other ranks beside it)."""
    # (imported here: torch and the trainer are rank 0's alone, not every flow run's of this module)
    from frenzy_prefect.training.distributed import DistributedContext
    from frenzy_prefect.training.fence import Fenced
    from frenzy_prefect.training.resilient.supervisor import supervise
    from frenzy_prefect.training.trainer import train as train_ranks

    run_id, log = FlowRunContext.get().flow_run.id, get_run_logger().info
    report = TrainingReporter(run_id, job)
    notify = noting_a_restart(report, job, log)
    with sigterm_cancels_when_cancelling(run_id), crashed_naming_a_dead_rank(run_id, job), failures_restart_while_torchrun_can(run_id, log):
        try:
            if job.request.resilience == "recycle":  # rank 0's trainer runs beside this flow run, which survives it
                result = supervise(job, DistributedContext.from_env(), log=log, notify=notify)
            else:
                result = train_ranks(job, DistributedContext.from_env(), log=log, notify=notify)
        except Fenced as exc:
            _fenced_exit(exc, log)
        except Exception as exc:
            if restarts_left() <= 0:  # (else torchrun starts the ranks again)
                report("failed", {"error": f"{type(exc).__name__}: {exc}"[:500]})
            raise
        finally:
            report.close()
    report("completed", {"steps": result.steps, "loss": result.losses[-1], "checkpoint": result.checkpoint})
    return result


def _fenced_exit(exc: Exception, log: Callable[[str], None]) -> NoReturn:
    """A newer generation of the run's attempts holds the run (training.fence): its one line,
    and an exit 0 with no state, event or artifact. The flow run is the newer generation's too
    (a restart on another node runs it again), and torchrun restarts no rank that exited 0."""
    log(str(exc))
    try:
        APILogHandler().flush()  # os._exit skips the handler's own flush at exit
    finally:
        os._exit(0)
