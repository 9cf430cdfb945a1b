"""Fault: the S3 endpoint stalls mid-checkpoint, on real processes: a moto server of the test's
own stopped with SIGSTOP (its kernel still accepts connections and bytes; nothing answers). A
checkpoint's whole write has one bound, however many requests it makes (each of which has its
own, longer here); a two-rank `distributed-train` run through the session's Prefect server and
`frenzy` worker fails within it, naming the URI, the endpoint and the real time, and frees its
GPUs. The bounds come from the environment: short ones prove the same property fast."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

from frenzy_prefect.errors import StorageUnreachable
from frenzy_prefect.launch.local import host_and_pids, is_running
from frenzy_prefect.spec.plan import ParallelPlan, TrainingJob
from frenzy_prefect.spec.workload import Workload
from frenzy_prefect.storage import CHECKPOINT_WRITE_TIMEOUT_ENV, exists, filesystem, stall_bound_s
from frenzy_prefect.training import checkpoint
from frenzy_prefect.training.engine import Engine
from frenzy_prefect.training.fence import claim
from frenzy_prefect.training.manifest import step_uri
from tests.support.runs import free_now, training_job, wait_final
from tests.support.stack import frozen, moto_server, sentences
from tests.support.training import NANO

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

STALLED_BUCKET = "frenzy-stalled"


SECRET = "stall-fault-secret-must-not-appear"  # the ranks' S3 secret (moto takes any)


ALL_FREE = {"a10-node": [0, 1], "t4-node": [0, 1]}


WRITE_BOUND_S = 6  # the whole write's, through the environment; each request keeps its default 54 s
SET_BOUND = f"{CHECKPOINT_WRITE_TIMEOUT_ENV}={WRITE_BOUND_S}"  # what the message says of a bound that was set


def test_a_checkpoint_write_to_a_stalled_endpoint_fails_within_its_whole_bound_not_each_requests(s3, tmp_path, monkeypatch):
    """One rank saves a checkpoint to a frozen endpoint: every request would wait out its own
    bound (54 s by default), one after another; the write as a whole gives up at its bound."""
    monkeypatch.setenv(CHECKPOINT_WRITE_TIMEOUT_ENV, str(WRITE_BOUND_S))
    engine = Engine(NANO, ParallelPlan(dp=1, micro_batch=4), Workload(global_batch=4, seq_len=64, precision="fp32"))
    with moto_server(tmp_path / "moto.log") as (endpoint, server):
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        fs, _ = filesystem(f"s3://{STALLED_BUCKET}")
        fs.mkdir(STALLED_BUCKET)
        prefix = f"s3://{STALLED_BUCKET}/runs/bounded/checkpoints"
        held = claim(prefix, None)
        checkpoint.save(engine, held, 1, [1.0], keep=2)  # the endpoint answering: written
        with frozen(server):
            started = time.monotonic()
            with pytest.raises(StorageUnreachable) as failed:
                checkpoint.save(engine, held, 2, [1.0, 0.9], keep=2)
            took = time.monotonic() - started
    message = str(failed.value)
    assert stall_bound_s() > 5 * WRITE_BOUND_S and took < 3 * WRITE_BOUND_S, f"{took:.1f} s: {message}"
    assert step_uri(prefix, 2) in message and endpoint in message, message
    assert f"did not finish writing the checkpoint within {WRITE_BOUND_S} s, its bound ({SET_BOUND})" in message, message


def logs_of(run_id) -> list[str]:
    with get_client(sync_client=True) as client:
        return [log.message for log in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))]


@pytest.mark.timeout(540)
def test_a_stalled_endpoint_fails_the_run_within_the_write_bound_naming_uri_and_endpoint_and_frees_the_gpus(
    stack, worker_pool, tmp_path, monkeypatch
):
    with moto_server(tmp_path / "moto.log") as (endpoint, server):
        # The dataset and the output on this endpoint; the ranks reach it through job variables.
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        dataset = f"s3://{STALLED_BUCKET}/data/sentences.txt"
        fs, path = filesystem(dataset)
        fs.mkdir(STALLED_BUCKET)
        fs.pipe_file(path, sentences(64_000))
        parameters = training_job(
            dataset, gpus=2, gpu_type="A10", steps=200, output=f"s3://{STALLED_BUCKET}/runs/stalled", log_every=50, checkpoint_every=10
        )
        job = TrainingJob.model_validate(parameters["job"])
        env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "stall-fault-key",
            "AWS_SECRET_ACCESS_KEY": SECRET,
            CHECKPOINT_WRITE_TIMEOUT_ENV: str(WRITE_BOUND_S),
        }

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
    assert job.checkpoint_uri in message, message
    assert f"did not finish writing the checkpoint within {WRITE_BOUND_S} s, its bound ({SET_BOUND})" in message, message
    # Every rank's write gives up at the bound, long before one request would (54 s); up to ten
    # more steps, rank 0's report and the ranks' exit come on top.
    print(f"the run ended {ended_s:.1f} s after the endpoint froze: {message}")
    assert ended_s < stall_bound_s(), f"the run ended {ended_s:.0f} s after the endpoint froze: {message}"
    for text in [message, *logs, *(p.read_text(errors="replace") for p in Path(stack.logs).glob("*.log"))]:
        assert SECRET not in text, "the S3 secret leaked into the run's state, its logs or a process log"
