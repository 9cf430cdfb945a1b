"""Fault: the S3 endpoint stalls mid-run (issue 12, item 4), on real processes: the session's
Prefect server and `frenzy` worker, torchrun ranks, and a moto server of this test's own that
is stopped with SIGSTOP (its kernel still accepts connections and bytes; nothing answers)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

from frenzy_prefect.launch.local import host_and_pids, is_running
from frenzy_prefect.spec.plan import TrainingJob
from frenzy_prefect.storage import STALL_BOUND_S, exists, filesystem

from .conftest import frozen, moto_server, sentences
from .test_e2e import free_now, training_job, wait_final

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

STALLED_BUCKET = "frenzy-stalled"
SECRET = "stall-fault-secret-must-not-appear"  # the ranks' S3 secret (moto takes any)
ALL_FREE = {"a10-node": [0, 1], "t4-node": [0, 1]}


def logs_of(run_id) -> list[str]:
    with get_client(sync_client=True) as client:
        return [log.message for log in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))]


@pytest.mark.timeout(540)
def test_a_stalled_endpoint_fails_the_run_within_minutes_naming_uri_and_endpoint_and_frees_the_gpus(
    stack, worker_pool, tmp_path, monkeypatch
):
    with moto_server(tmp_path / "moto.log") as (endpoint, server):
        # The dataset and the output on this endpoint; the ranks reach it through job variables.
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        dataset = f"s3://{STALLED_BUCKET}/data/sentences.txt"
        fs, path = filesystem(dataset)
        fs.mkdir(STALLED_BUCKET)
        fs.pipe_file(path, sentences(64_000))
        parameters = training_job(dataset, gpus=2, gpu_type="A10", steps=200, output=f"s3://{STALLED_BUCKET}/runs/stalled")
        parameters["job"]["request"]["log_every"] = 50
        job = TrainingJob.model_validate(parameters["job"])
        env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "stall-fault-key", "AWS_SECRET_ACCESS_KEY": SECRET}

        with stack.client_settings():
            from prefect.deployments import run_deployment

            run_id = run_deployment("distributed-train/frenzy", parameters=parameters, job_variables={"env": env}, timeout=0).id
            deadline = time.monotonic() + 240
            while not any(m.startswith("step ") for m in logs_of(run_id)):
                assert time.monotonic() < deadline, "the training run never started stepping"
                time.sleep(0.5)
            with get_client(sync_client=True) as client:
                _, ranks = host_and_pids(client.read_flow_run(run_id).infrastructure_pid)

            # Not a race: the ranks (torchrun's process groups) pause while the endpoint freezes,
            # and the run's last S3 write (metrics.json, after the checkpoint) has not happened.
            for pid in ranks:
                os.killpg(pid, signal.SIGSTOP)
            try:
                assert not exists(job.metrics_uri), "the run finished its writes before the endpoint froze: raise its steps"
                with frozen(server):
                    froze = time.monotonic()
                    for pid in ranks:
                        os.killpg(pid, signal.SIGCONT)
                    run = wait_final(run_id, timeout_s=300)
                    ended_s = time.monotonic() - froze
                    released = time.monotonic()
                    while any(is_running(p) for p in ranks) or free_now(stack) != ALL_FREE:
                        assert time.monotonic() - released < 30, (
                            f"ranks {ranks} or GPUs {free_now(stack)} still held 30 s after the run ended"
                        )
                        time.sleep(0.5)
                    logs = logs_of(run_id)
            finally:
                for pid in ranks:
                    try:
                        os.killpg(pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass

    message = run.state.message or ""
    assert run.state.is_failed() or run.state.is_crashed(), run.state
    # Rank 0 reports the cause itself (StorageUnreachable), not 'aborted by a termination signal'.
    assert "StorageUnreachable" in message and endpoint in message, message
    assert job.checkpoint_uri in message or job.metrics_uri in message, message
    assert "did not answer within" in message, message
    # The stalled write gives up within STALL_BOUND_S (~52 s measured); the rest of the run's
    # 200 steps and its report come on top.
    assert ended_s < 3 * STALL_BOUND_S, f"the run ended {ended_s:.0f} s after the endpoint froze: {message}"
    for text in [message, *logs, *(p.read_text(errors="replace") for p in Path(stack.logs).glob("*.log"))]:
        assert SECRET not in text, "the S3 secret leaked into the run's state, its logs or a process log"
