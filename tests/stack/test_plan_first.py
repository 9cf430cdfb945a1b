"""Plan first (issue 17, part 3), through the real server and `frenzy` worker: train-llm with
`plan_only` publishes the ranked plans and stops; with `approve` it pauses before asking for any
GPU, and a person's answer (another plan, or no) decides what runs."""

from __future__ import annotations

import time
from uuid import UUID

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

from frenzy_prefect.flows.training import default_output
from frenzy_prefect.spec.result import TrainingReport
from frenzy_prefect.storage import open_uri
from tests.support.runs import GOOD, children, wait_final

pytestmark = pytest.mark.pipelines


def start(stack, request: dict, **parameters) -> UUID:
    from prefect.deployments import run_deployment

    with stack.client_settings():
        return run_deployment("train-llm/frenzy", parameters={"request": request, "cluster": "local-hetero", **parameters}, timeout=0).id


def ranked_plans(stack, run_id: UUID) -> list[dict]:
    with stack.client_settings(), get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
    (estimates,) = [a for a in artifacts if a.key == "memory-estimates"]
    import json

    return json.loads(estimates.data) if isinstance(estimates.data, str) else estimates.data


def wait_paused(stack, run_id: UUID, timeout_s: float = 180):
    with stack.client_settings(), get_client(sync_client=True) as client:
        deadline = time.monotonic() + timeout_s
        while not (run := client.read_flow_run(run_id)).state.is_paused():
            assert time.monotonic() < deadline and not run.state.is_final(), run.state
            time.sleep(0.5)
    return run


def test_plan_only_publishes_the_ranked_plans_with_time_and_cost_and_starts_nothing(stack, worker_pool, dataset):
    run_id = start(stack, GOOD | {"dataset": dataset}, plan_only=True)
    with stack.client_settings():
        run = wait_final(run_id, timeout_s=180)
    assert run.state.is_completed(), run.state
    plans = ranked_plans(stack, run_id)
    assert [p["#"] for p in plans[:3]] == ["1", "2", "3"] and all("total time (predicted)" in p and "cost (predicted)" in p for p in plans)
    assert children(stack, run) == []


def test_approval_pauses_before_any_gpu_is_asked_for_and_runs_the_plan_a_person_picks(stack, worker_pool, dataset):
    from prefect.flow_runs import resume_flow_run

    request = GOOD | {"dataset": dataset, "steps": 3}
    run_id = start(stack, request, approve=True)
    run = wait_paused(stack, run_id)
    assert children(stack, run) == []  # no training run, so no GPU reservation, while it waits
    plans = ranked_plans(stack, run_id)
    picked = plans[2]  # the third: not the allocator's choice
    assert picked["fits"] == "yes" and (picked["gpu"], picked["plan"]) != (plans[0]["gpu"], plans[0]["plan"])
    with stack.client_settings():
        resume_flow_run(run_id, run_input={"run": True, "plan": int(picked["#"])})
        run = wait_final(run_id)
    assert run.state.is_completed(), run.state
    with open_uri(f"{default_output(dataset, run.name)}/report.json", "r") as f:
        report = TrainingReport.model_validate_json(f.read())
    assert (report.allocation.gpu_type, report.allocation.plan.label()) == (picked["gpu"], picked["plan"])


def test_declining_the_plans_ends_the_run_cancelled_without_training(stack, worker_pool, dataset):
    from prefect.flow_runs import resume_flow_run

    run_id = start(stack, GOOD | {"dataset": dataset}, approve=True)
    wait_paused(stack, run_id)
    with stack.client_settings():
        resume_flow_run(run_id, run_input={"run": False})
        run = wait_final(run_id, timeout_s=180)
    assert run.state.is_cancelled() and "not approved" in run.state.message
    assert children(stack, run) == []
