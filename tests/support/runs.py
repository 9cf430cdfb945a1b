"""Flow runs through the test stack: a training request, waiting for a run's end or a condition, its child runs, the free GPUs."""

from __future__ import annotations

import asyncio
import time
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterParentFlowRunId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.client.schemas.objects import FlowRun

from frenzy_prefect.pool.reservations import GpuReservations
from frenzy_prefect.spec.cluster import ClusterSpec
from tests.support.stack import EXAMPLE_CLUSTER

GOOD = {"model": "gpt-nano", "global_batch": 32, "seq_len": 64, "steps": 30, "precision": "fp32"}


def wait_final(run_id: UUID, timeout_s: float = 420) -> FlowRun:
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            run = client.read_flow_run(run_id)
            if run.state is not None and run.state.is_final():
                return run
            time.sleep(1)
    raise AssertionError(f"flow run {run_id} did not finish in {timeout_s} s")


def children(stack, run: FlowRun) -> list[FlowRun]:
    with stack.client_settings(), get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id])))


def training_job(dataset: str, *, gpus: int, gpu_type: str, steps: int, output: str, cluster=None, **request) -> dict:
    """A `distributed-train` job parameter, as `train_llm` would submit it: ``gpus`` GPUs of
    ``gpu_type`` on ``cluster`` (the example cluster by default), placed on the idle cluster; the
    worker re-places it at dispatch."""
    from frenzy_prefect import allocator
    from frenzy_prefect.profiling.dataset import profile_dataset
    from frenzy_prefect.profiling.model import resolve_model
    from frenzy_prefect.spec.cluster import ClusterState
    from frenzy_prefect.spec.plan import TrainingJob
    from frenzy_prefect.spec.request import TrainingRequest

    cluster = cluster or ClusterSpec.from_file(EXAMPLE_CLUSTER)
    request = TrainingRequest(**(GOOD | {"dataset": dataset, "global_batch": 8, "steps": steps, "log_every": 1} | request))
    model = resolve_model(request.model, seq_len=request.seq_len)
    fitting = [c for c in allocator.candidate_plans(model, request, cluster) if c.fits and c.plan.gpus == gpus and c.gpu_type == gpu_type]
    job = TrainingJob(
        request=request,
        model=model,
        dataset=profile_dataset(dataset, request.seq_len, model.vocab_size),
        allocation=allocator.allocate(fitting, ClusterState.idle(cluster)),
        cluster=cluster,
        output=output,
    )
    return {"job": job.model_dump(mode="json")}


def free_now(stack) -> dict[str, list[int]]:
    async def read() -> dict[str, list[int]]:
        async with get_client() as client:
            return (await GpuReservations(client, ClusterSpec.from_file(EXAMPLE_CLUSTER)).state()).free_gpus

    with stack.client_settings():
        return asyncio.run(read())


def wait_for(what: str, check, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(1)
    return result


def run_logs(stack, run_id: UUID) -> list[str]:
    from prefect.client.orchestration import get_client

    from tests.support.stack import all_logs

    with stack.client_settings(), get_client(sync_client=True) as client:
        return [log.message for log in all_logs(client, run_id)]


def wait_for_log(stack, run_id: UUID, prefix: str, timeout_s: float = 240) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while not any(m.startswith(prefix) for m in run_logs(stack, run_id)):
        logs = run_logs(stack, run_id)
        assert time.monotonic() < deadline, f"no log line {prefix!r} in {timeout_s:.0f} s: {logs[-20:]}"
        time.sleep(1)
    return run_logs(stack, run_id)


def cancel(stack, run_id: UUID) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    with stack.client_settings(), get_client(sync_client=True) as client:
        client.set_flow_run_state(run_id, Cancelling(message="cancelled by the test"), force=True)


def flow_run(stack, run_id: UUID):
    from prefect.client.orchestration import get_client

    with stack.client_settings(), get_client(sync_client=True) as client:
        return client.read_flow_run(run_id)


def job_of_run(stack, run_id: UUID):
    from frenzy_prefect.spec.plan import TrainingJob

    return TrainingJob.model_validate(flow_run(stack, run_id).parameters["job"])


def run_events(stack, run_id: UUID, prefix: str, done, timeout_s: float = 30) -> list[dict]:
    """The events named ``prefix``... about a flow run (its resource or a related one), once
    ``done(events)`` (the server stores events a moment after they are sent)."""
    about = {"event": {"prefix": [prefix]}, "any_resource": {"id": [f"prefect.flow-run.{run_id}"]}}
    deadline = time.monotonic() + timeout_s
    with stack.client_settings(), get_client(sync_client=True) as client:
        while not done(events := client._client.post("/events/filter", json={"filter": about}).json()["events"]):
            assert time.monotonic() < deadline, [(e["event"], e["resource"]) for e in events]
            time.sleep(0.5)
    return events


def training_events(stack, training_run: UUID, until: str, timeout_s: float = 30) -> list[dict]:
    """The frenzy.training.* events about a training flow run, once ``until`` is among them."""
    return run_events(stack, training_run, "frenzy.training.", lambda events: any(e["event"] == until for e in events), timeout_s)


def training_after_a_checkpoint(stack, client, run_id: UUID) -> UUID:
    """The training flow run of train-llm run ``run_id``, once it has written a checkpoint."""
    deadline = time.monotonic() + 300
    while not (trainings := children(stack, client.read_flow_run(run_id))) or not any(
        log.message.startswith("checkpoint of step")
        for log in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[trainings[0].id])))
    ):
        assert time.monotonic() < deadline, "the training run wrote no checkpoint"
        time.sleep(0.5)
    return trainings[0].id
