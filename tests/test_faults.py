"""The `frenzy` pool under faults, on real processes: a stack of its own (a Prefect server on
SQLite with durable lease storage, two `frenzy` workers), so that killing its server or a worker
disturbs no other test.

- One queue across workers: a T4 run starts while an A10 run waits; A10 runs start in order.
- A worker killed with -9 while its run waits for GPUs: the run goes back to Scheduled and the
  other worker trains it.
- The server killed with -9 and restarted mid-run: the ranks keep training, their GPUs stay
  held, cancelling works afterwards, and nothing is left held. Restarted without durable lease
  storage, the server forgets the lease: the worker stops the ranks rather than let them train
  on GPUs nobody holds."""

from __future__ import annotations

import asyncio
import time
from uuid import UUID

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.sorting import LogSort
from prefect.states import Cancelling

from frenzy_prefect.launch.local import host_and_pids, is_running
from frenzy_prefect.localstack import LocalStack
from frenzy_prefect.pool.reservations import RENEW_EVERY_S, VOLATILE_LEASE_STORAGE, GpuReservations
from frenzy_prefect.spec.cluster import ClusterSpec

from .conftest import BUCKET, EXAMPLE_CLUSTER, POOL, deploy_all
from .test_e2e import training_job

pytestmark = [pytest.mark.e2e, pytest.mark.faults]
ALL_FREE = {"a10-node": [0, 1], "t4-node": [0, 1]}
WORKERS = ("fault-worker-1", "fault-worker-2")


@pytest.fixture(scope="module")
def faults(tmp_path_factory, s3, dataset) -> LocalStack:
    """Its own Prefect server and two workers; the session's S3 endpoint and dataset."""
    with LocalStack(tmp_path_factory.mktemp("fault-stack")) as stack:
        stack.start_s3()
        stack.start_prefect()
        stack.run_cli("frenzy_prefect.cli", "cluster", "save", str(EXAMPLE_CLUSTER))
        for name in WORKERS:
            stack.start_worker(POOL, name=name)
        deploy_all(stack)
        yield stack


def submit(stack: LocalStack, dataset: str, *, gpus: int, gpu_type: str, steps: int, name: str) -> UUID:
    parameters = training_job(dataset, gpus=gpus, gpu_type=gpu_type, steps=steps, output=f"s3://{BUCKET}/faults/{name}")
    with stack.client_settings():
        from prefect.deployments import run_deployment

        return run_deployment("distributed-train/frenzy", parameters=parameters, timeout=0).id


def logs(stack: LocalStack, run_id: UUID) -> list:
    with stack.client_settings(), get_client(sync_client=True) as client:
        return sorted(client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id]))), key=lambda log: log.timestamp)


def newest_log(stack: LocalStack, run_id: UUID):
    with stack.client_settings(), get_client(sync_client=True) as client:
        return client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), limit=1, sort=LogSort.TIMESTAMP_DESC)[0]


def read(stack: LocalStack, run_id: UUID):
    with stack.client_settings(), get_client(sync_client=True) as client:
        return client.read_flow_run(run_id)


def wait_for(what: str, check, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(1)
    return result


def logged(stack: LocalStack, run_id: UUID, prefix: str, timeout_s: float = 240):
    return wait_for(
        f"{run_id} to log {prefix!r}", lambda: [log for log in logs(stack, run_id) if log.message.startswith(prefix)], timeout_s
    )


def final(stack: LocalStack, run_id: UUID, timeout_s: float = 300):
    return wait_for(f"{run_id} to end", lambda: (run := read(stack, run_id)).state.is_final() and run, timeout_s)


def cancel(stack: LocalStack, run_id: UUID) -> None:
    with stack.client_settings(), get_client(sync_client=True) as client:
        client.set_flow_run_state(run_id, Cancelling(message="cancelled by the test"), force=True)


def free_now(stack: LocalStack) -> dict[str, list[int]]:
    async def state() -> dict[str, list[int]]:
        async with get_client() as client:
            return (await GpuReservations(client, ClusterSpec.from_file(EXAMPLE_CLUSTER)).state()).free_gpus

    with stack.client_settings():
        return asyncio.run(state())


def all_free(stack: LocalStack) -> None:
    wait_for("every GPU to be free", lambda: free_now(stack) == ALL_FREE, 60)


def test_runs_wait_in_one_order_across_workers_and_other_gpu_types_go_ahead(faults, dataset):
    blocker = submit(faults, dataset, gpus=2, gpu_type="A10", steps=100_000, name="blocker")
    logged(faults, blocker, "step ")
    first = submit(faults, dataset, gpus=2, gpu_type="A10", steps=2, name="a10-first")
    logged(faults, first, "waiting for ")
    second = submit(faults, dataset, gpus=1, gpu_type="A10", steps=2, name="a10-second")
    logged(faults, second, "waiting for ")
    t4 = submit(faults, dataset, gpus=1, gpu_type="T4", steps=2, name="t4")

    assert final(faults, t4).state.is_completed()  # while both A10 runs still wait behind the blocker
    assert read(faults, first).state_type == StateType.PENDING and read(faults, second).state_type == StateType.PENDING
    assert {read(faults, r).labels["frenzy.worker"] for r in (first, second, t4)} <= set(WORKERS)

    cancel(faults, blocker)
    assert final(faults, first).state.is_completed() and final(faults, second).state.is_completed()
    (first_reserved,) = logged(faults, first, "Reserved GPUs ")
    (second_reserved,) = logged(faults, second, "Reserved GPUs ")
    assert first_reserved.timestamp < second_reserved.timestamp, "the younger A10 run went ahead of the older one"
    assert any("in line for local-hetero/A10" in log.message for log in logs(faults, second))
    all_free(faults)


def test_a_run_waiting_on_a_worker_killed_with_9_is_trained_by_the_other(faults, dataset):
    blocker = submit(faults, dataset, gpus=2, gpu_type="A10", steps=100_000, name="blocker-2")
    logged(faults, blocker, "step ")
    waiting = submit(faults, dataset, gpus=2, gpu_type="A10", steps=2, name="orphaned")
    logged(faults, waiting, "waiting for ")
    lost = read(faults, waiting).labels["frenzy.worker"]
    faults.processes[lost].kill()  # SIGKILL: no cleanup of any kind
    faults.processes[lost].wait()

    logged(faults, waiting, "Rescheduled: ", timeout_s=120)
    (survivor,) = set(WORKERS) - {lost}
    wait_for("the other worker to take the run", lambda: read(faults, waiting).labels.get("frenzy.worker") == survivor, 60)
    cancel(faults, blocker)  # if the blocker was the lost worker's, it was reclaimed already
    run = final(faults, waiting)
    assert run.state.is_completed(), run.state.message
    assert run.labels["frenzy.worker"] == survivor
    all_free(faults)
    faults.start_worker(POOL, name=lost)


def test_a_server_killed_with_9_and_restarted_loses_neither_the_ranks_nor_their_gpus(faults, dataset):
    run_id = submit(faults, dataset, gpus=2, gpu_type="A10", steps=100_000, name="server-restart")
    logged(faults, run_id, "step ")
    _, ranks = host_and_pids(read(faults, run_id).infrastructure_pid)

    faults.kill_prefect()
    time.sleep(5)
    faults.restart_prefect()
    restarted = time.monotonic()
    # Past two renewals: had the server forgotten the lease, the renewal would have failed and the
    # worker, unable to take the leaked GPUs again, would have stopped the ranks (the next test).
    while time.monotonic() - restarted < 2 * RENEW_EVERY_S + 5:
        assert all(is_running(p) for p in ranks), "a rank stopped after the server restart"
        assert free_now(faults)["a10-node"] == [], "the running ranks' GPUs were freed"
        time.sleep(5)
    before = newest_log(faults, run_id).timestamp

    def stepped_since() -> bool:  # a step's line (a checkpoint's may come between)
        with faults.client_settings(), get_client(sync_client=True) as client:
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), limit=20, sort=LogSort.TIMESTAMP_DESC)
        return any(log.timestamp > before and log.message.startswith("step ") for log in logs)

    wait_for("the run to log a step after the restart", stepped_since, 60)

    asked = time.monotonic()
    cancel(faults, run_id)
    wait_for("every rank to stop", lambda: not any(is_running(p) for p in ranks), 20)
    assert time.monotonic() - asked < 20
    assert final(faults, run_id, timeout_s=30).state.type == StateType.CANCELLED
    all_free(faults)


def test_a_server_that_forgets_leases_in_a_restart_has_the_ranks_stopped_not_sharing_gpus(faults, dataset):
    """Prefect's default, in-memory lease storage loses the lease in a restart while the GPUs'
    slots stay taken: the worker cannot take them again, so it stops the ranks and says why
    (the alternative, ranks training on GPUs nobody holds, could hand a GPU to two runs)."""
    run_id = submit(faults, dataset, gpus=2, gpu_type="A10", steps=100_000, name="forgetful-server")
    logged(faults, run_id, "step ")
    _, ranks = host_and_pids(read(faults, run_id).infrastructure_pid)

    faults.kill_prefect()
    faults.restart_prefect(PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE=VOLATILE_LEASE_STORAGE)
    wait_for("the ranks to be stopped", lambda: not any(is_running(p) for p in ranks), 2 * RENEW_EVERY_S + 30)
    run = final(faults, run_id, timeout_s=60)
    assert run.state.is_crashed() and "the Prefect server forgot this run's GPU lease" in run.state.message, run.state
