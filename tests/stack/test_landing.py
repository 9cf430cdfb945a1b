"""Runs when data lands (issue 17, part 2): `watch-datasets` announces each new version of a raw
dataset once its files stand still, and `frenzy deploy --on-new-data --approve` turns each
announcement into exactly one train-llm run, which prepares the version, plans and waits for
approval, on the real Prefect server, worker and moto S3."""

from __future__ import annotations

import json
import time

import pytest

from tests.support.datasets import TINY_BPE_MODEL, put, texts
from tests.support.stack import BUCKET

pytestmark = pytest.mark.pipelines


def test_files_landing_in_several_puts_start_exactly_one_training_run_and_a_new_version_one_more(stack, worker_pool, s3, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId
    from prefect.flow_runs import resume_flow_run

    from frenzy_prefect.flows import watch_datasets
    from tests.support.runs import wait_final

    from .test_plan_first import wait_paused

    prefix = f"s3://{BUCKET}/landing/"
    request = tmp_path / "request.yaml"
    request.write_text(json.dumps({"model": TINY_BPE_MODEL, "global_batch": 8, "seq_len": 32, "steps": 2, "precision": "fp32"}))
    settle = ["--settle-s", "2", "--every-s", "86400"]  # the test looks itself, instead of the schedule
    # --approve: each run prepares its version and plans, then waits for a person; the test
    # declines it, so no GPU is reserved (training on a prepared prefix: test_datasets, the demo).
    stack.run_cli("frenzy_prefect.cli", "deploy", "--on-new-data", prefix, "--request", str(request), *settle, "--approve")

    def training_runs() -> list:
        with stack.client_settings(), get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name("train-llm/frenzy-frenzy-tests-landing")
            return client.read_flow_runs(flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[deployment.id])))

    def look() -> str | None:
        with stack.client_settings():
            return watch_datasets(prefix, settle_s=2)

    def runs_settle_at(count: int) -> list:
        deadline = time.monotonic() + 60
        while len(runs := training_runs()) < count:
            assert time.monotonic() < deadline, f"{len(runs)} training runs, expected {count}"
            time.sleep(1)
        time.sleep(5)  # and no more come
        return training_runs()

    assert look() is None  # nothing there yet
    put(f"{prefix}a.jsonl", "\n".join(json.dumps({"text": t}) for t in texts(30, seed=1)).encode())
    assert look() is None  # first seen
    put(f"{prefix}b.jsonl", "\n".join(json.dumps({"text": t}) for t in texts(30, seed=2)).encode())  # a second put
    assert look() is None  # changed: the settle time starts again
    time.sleep(2.5)
    first = look()
    assert first is not None and look() is None  # announced once
    (run,) = runs_settle_at(1)
    assert run.parameters["request"]["dataset"] == prefix  # the event's prefix, templated in

    put(f"{prefix}c.jsonl", "\n".join(json.dumps({"text": t}) for t in texts(30, seed=3)).encode())  # another version
    assert look() is None
    time.sleep(2.5)
    second = look()
    assert second not in (None, first)
    runs = runs_settle_at(2)
    assert len(runs) == 2 and all(r.parameters["approve"] for r in runs)
    with stack.client_settings():
        for run in runs:
            wait_paused(stack, run.id)  # prepared and planned, nothing reserved
            resume_flow_run(run.id, run_input={"run": False})
        assert all(wait_final(r.id).state.is_cancelled() for r in runs)
