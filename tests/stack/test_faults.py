"""The `frenzy` pool under faults, on real processes: a stack of its own (a Prefect server on
SQLite with durable lease storage, two `frenzy` workers), so that killing its server or a worker
disturbs no other test.

- One queue across workers: A10 runs start in order, a T4 run starts while they wait, and
  (backfill) a short run takes the A10 a blocked 2 x A10 run cannot use yet while a long one,
  predicted to hold it past the blocked run's reserved start, waits its turn.
- A worker killed with -9 while its run waits for GPUs: the run goes back to Scheduled and the
  other worker trains it.
- The server killed with -9 and restarted mid-run: the ranks keep training, their GPUs stay
  held, cancelling works afterwards, and nothing is left held. Restarted without durable lease
  storage, the server forgets the lease: the run keeps its GPUs' slots and gives them back at
  its end, and slots no live run holds are given back by the workers.
- The server and both workers killed together (a host's reboot, in-memory lease storage): rank
  0 exits at once, and the restarted worker gives the lost run's GPUs back at once, by name.
- SIGTERM to a worker, idle or having run a flow, while its server does not answer: it exits
  within seconds, saying it stopped."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
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
from frenzy_prefect.pool.leaks import LeakedGpus
from frenzy_prefect.pool.reservations import (
    LEASE_S,
    RENEW_EVERY_ENV,
    VOLATILE_LEASE_STORAGE,
    GpuReservations,
    gpu_limit,
    volatile_lease_storage_warning,
)
from frenzy_prefect.pool.worker import EXIT_FLUSH_S
from frenzy_prefect.spec.cluster import ClusterSpec
from tests.support.runs import training_job, wait_for
from tests.support.stack import BUCKET, EXAMPLE_CLUSTER, POOL, deploy_all

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

ALL_FREE = {"a10-node": [0, 1], "t4-node": [0, 1]}


WORKERS = ("fault-worker-1", "fault-worker-2")


RENEW_S = 5  # the workers' lease renewal interval (15 s by default): the same faults, seen sooner


@pytest.fixture(scope="module")
def faults(tmp_path_factory, s3, dataset) -> LocalStack:
    """Its own Prefect server and two workers; the session's S3 endpoint and dataset."""
    with LocalStack(tmp_path_factory.mktemp("fault-stack")) as stack:
        stack.env["PREFECT_WORKER_HEARTBEAT_SECONDS"] = "10"  # (30 s by default) how soon a lost worker's runs are reclaimed
        stack.env[RENEW_EVERY_ENV] = str(RENEW_S)  # (15 s by default) how soon a lease is renewed after a restart
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


def test_runs_wait_in_one_order_across_workers_a_short_one_backfills_and_other_gpu_types_go_ahead(faults, dataset):
    """One queue per GPU type across both workers. gpt-nano on one A10: 1.3 ms a step predicted,
    so the blocker is predicted to hold its A10 for about 400 s, the long run for 1300 s, the
    short one for a few milliseconds: the short one takes the A10 the blocked 2 x A10 head cannot
    use yet, the long one waits its turn behind the head, and a T4 run goes ahead of them all."""
    blocker = submit(faults, dataset, gpus=1, gpu_type="A10", steps=300_000, name="blocker")
    logged(faults, blocker, "Reserved GPUs ")
    head = submit(faults, dataset, gpus=2, gpu_type="A10", steps=2, name="head")
    logged(faults, head, "waiting for ")
    long = submit(faults, dataset, gpus=1, gpu_type="A10", steps=1_000_000, name="long")
    logged(faults, long, "waiting for ")
    short = submit(faults, dataset, gpus=1, gpu_type="A10", steps=2, name="short")
    t4 = submit(faults, dataset, gpus=1, gpu_type="T4", steps=2, name="t4")

    assert final(faults, short).state.is_completed() and final(faults, t4).state.is_completed()  # while the older A10 runs wait
    assert read(faults, head).state_type == StateType.PENDING and read(faults, long).state_type == StateType.PENDING
    (backfilled,) = logged(faults, short, "Backfilled: ")
    assert "ahead of the oldest run waiting for local-hetero/A10, predicted to end by" in backfilled.message
    assert not [log for log in logs(faults, long) if log.message.startswith(("Backfilled", "Reserved GPUs "))]
    assert any("in line for local-hetero/A10" in log.message for log in logs(faults, long))

    cancel(faults, blocker)
    assert final(faults, head).state.is_completed()
    (head_reserved,) = logged(faults, head, "Reserved GPUs ")
    (long_reserved,) = logged(faults, long, "Reserved GPUs ")  # its turn, after the head's
    assert head_reserved.timestamp < long_reserved.timestamp, "the younger A10 run went ahead of the older one"
    cancel(faults, long)
    assert final(faults, long).state.type == StateType.CANCELLED
    assert {read(faults, r).labels["frenzy.worker"] for r in (head, long, short, t4)} <= set(WORKERS)
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
    while time.monotonic() - restarted < 2 * RENEW_S + 5:
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


def test_a_server_that_forgets_leases_in_a_restart_leaks_no_gpu_and_never_hands_one_out_twice(faults, dataset):
    """Prefect's default, in-memory lease storage forgets every lease in a restart, while the
    slots they held stay taken. The run that holds GPUs then keeps them (their slots are still
    its own, held without a lease), says so in its log, and gives them back when it ends: the
    run waiting for them gets them at once. A slot no live run holds (taken under a lease the
    server forgot, by a run that ended meanwhile) is given back by the pool's workers; a slot a
    live run holds is not, whoever looks."""
    t4 = gpu_limit("local-hetero", "t4-node", 0)
    run_id = submit(faults, dataset, gpus=2, gpu_type="A10", steps=100_000, name="forgetful-server")
    logged(faults, run_id, "step ")
    _, ranks = host_and_pids(read(faults, run_id).infrastructure_pid)
    take_unclaimed(faults, t4)  # as a run's that ended while the server was away

    faults.kill_prefect()
    faults.restart_prefect(PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE=VOLATILE_LEASE_STORAGE)
    warning = lease_storage_warning(faults)  # what a worker starting now logs
    assert warning and "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE=prefect.server.concurrency.lease_storage.filesystem" in warning
    (forgot,) = logged(faults, run_id, "The Prefect server forgot GPU lease ", timeout_s=2 * RENEW_S + 30)
    assert "the GPUs stay this run's" in forgot.message
    assert all(is_running(p) for p in ranks), "the ranks were stopped"
    assert free_now(faults) == {"a10-node": [], "t4-node": [1]}  # the run's, and the leaked one

    waiting = submit(faults, dataset, gpus=2, gpu_type="A10", steps=2, name="after-the-forgetful-server")
    logged(faults, waiting, "waiting for ")
    assert sweep_for_leaks(faults) == [t4]  # the held A10s are claimed by their run: never given back
    assert free_now(faults) == {"a10-node": [], "t4-node": [0, 1]}

    cancel(faults, run_id)
    wait_for("every rank to stop", lambda: not any(is_running(p) for p in ranks), 30)
    stopped = time.monotonic()
    (reserved,) = logged(faults, waiting, "Reserved GPUs ", timeout_s=60)
    print(f"the waiting run reserved the GPUs {time.monotonic() - stopped:.1f} s after the first run's ranks stopped")
    assert reserved.message.startswith("Reserved GPUs a10-node[0, 1]")
    assert final(faults, waiting).state.is_completed()
    assert final(faults, run_id).state.type == StateType.CANCELLED
    all_free(faults)


def test_a_server_and_its_workers_lost_together_give_a_lost_runs_gpus_back_at_once(faults, dataset):
    """A host's reboot on Prefect's default, in-memory lease storage: the server is killed with
    -9, then both workers, while one run trains on both A10s and another waits for them; all are
    started again. The server has forgotten the training run's lease while its GPUs' slots stay
    taken: the worker that reclaims the lost run gives them back by name, and the waiting run
    takes them at once (the leak sweep alone frees them 9-10 minutes later). Rank 0, stopped by
    torchrun once its worker is gone, finds the server down and exits at once instead of trying
    to report until torchrun kills it 30 s later. Last, the worker that trained the waiting run,
    idle again, is sent SIGTERM while its server is down once more: it exits within EXIT_FLUSH_S
    of the signal whatever its shutdown still waits for, its output ending with its "stopped" line."""
    from tests.support.ranks import rank_pid

    run_id = submit(faults, dataset, gpus=2, gpu_type="A10", steps=100_000, name="rebooted")
    logged(faults, run_id, "step ")
    _, (agent,) = host_and_pids(read(faults, run_id).infrastructure_pid)
    rank0, owner = rank_pid(agent, 0), read(faults, run_id).labels["frenzy.worker"]
    waiting = submit(faults, dataset, gpus=2, gpu_type="A10", steps=2, name="after-the-reboot")
    logged(faults, waiting, "waiting for ")
    said_before = (faults.logs / f"{owner}.log").read_text(errors="replace")

    faults.kill_prefect()
    for name in WORKERS:
        faults.processes[name].kill()
        faults.processes[name].wait()
    wait_for("rank 0 to exit", lambda: not is_running(rank0, group=False), 60)
    ranks_said = (faults.logs / f"{owner}.log").read_text(errors="replace")[len(said_before) :]
    assert "rank 0: the Prefect server does not answer; exit 143 without a report" in ranks_said, ranks_said[-3000:]
    assert "forcefully exiting via Signals.SIGKILL" not in ranks_said, ranks_said[-3000:]

    faults.restart_prefect(PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE=VOLATILE_LEASE_STORAGE)
    for name in WORKERS:
        faults.start_worker(POOL, name=name)
    (reclaimed,) = logged(faults, run_id, "Reclaimed: ", timeout_s=120)
    assert "by name (the Prefect server no longer knew its lease " in reclaimed.message, reclaimed.message
    logged(faults, waiting, "Reserved GPUs a10-node[0, 1]", timeout_s=180)  # (not 540-600 s, the leak sweep's)
    assert final(faults, waiting).state.is_completed()
    assert read(faults, run_id).state.is_crashed() and read(faults, run_id).labels["frenzy.gpus"] == ""
    all_free(faults)
    assert_a_used_worker_stops_within_its_bound(faults, read(faults, waiting).labels["frenzy.worker"])


def assert_a_used_worker_stops_within_its_bound(faults: LocalStack, name: str) -> None:
    """SIGTERM to worker ``name``, which has run flows and is idle, with its server killed (an
    outage or a reboot): it exits within EXIT_FLUSH_S of the signal and says it stopped. The
    server and the worker are started again."""
    worker, log = faults.processes[name], faults.logs / f"{name}.log"
    said_before = len(log.read_text(errors="replace"))
    time.sleep(3)  # idle again, past its next poll
    faults.kill_prefect()
    try:
        asked = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
        took = time.monotonic() - asked
    finally:
        faults.restart_prefect()
        faults.start_worker(POOL, name=name)
    said = log.read_text(errors="replace")[said_before:]
    print(f"the worker that had run flows exited {took:.1f} s after SIGTERM, its server down")
    assert worker.returncode == 0 and took < 2 * EXIT_FLUSH_S + 2, f"exit {worker.returncode} after {took:.1f} s"
    assert f"Worker {name!r} stopped!" in said, said[-2000:]


def test_an_idle_worker_exits_within_seconds_of_sigterm_even_while_its_server_does_not_answer(faults):
    """`prefect worker start` with nothing to do, sent SIGTERM (what a service manager sends)
    while its server is frozen (SIGSTOP: a server that accepts connections and never answers):
    Prefect's flush of the worker's last events at exit has no bound of its own (11.2-13.6 s
    measured here without it), the worker's exit does (pool.worker.EXIT_FLUSH_S). Nothing it started
    outlives it."""
    from .test_demo import descendants

    idle = faults.start_worker(POOL, name="idle-worker")
    time.sleep(3)  # past its first poll and heartbeat
    started = descendants(idle.pid)
    server = faults.processes["prefect-server"]
    os.killpg(server.pid, signal.SIGSTOP)
    try:
        asked = time.monotonic()
        idle.send_signal(signal.SIGTERM)
        idle.wait(timeout=60)
        took = time.monotonic() - asked
    finally:
        os.killpg(server.pid, signal.SIGCONT)
    print(f"the idle worker exited {took:.1f} s after SIGTERM, its server frozen")
    assert idle.returncode == 0 and took < 2 * EXIT_FLUSH_S + 2, f"exit {idle.returncode} after {took:.1f} s"
    assert not [pid for pid in started if os.path.exists(f"/proc/{pid}")], started


def lease_storage_warning(stack: LocalStack) -> str | None:
    async def warning() -> str | None:
        async with get_client() as client:
            return await volatile_lease_storage_warning(client)

    with stack.client_settings():
        return asyncio.run(warning())


def take_unclaimed(stack: LocalStack, name: str) -> None:
    async def take() -> None:
        async with get_client() as client:
            await client.increment_concurrency_slots_with_lease(names=[name], slots=1, mode="concurrency", lease_duration=LEASE_S)

    with stack.client_settings():
        asyncio.run(take())


def sweep_for_leaks(stack: LocalStack) -> list[str]:
    """One look for leaked GPUs, as a worker's heartbeat takes, that gives back at once what no
    live run claims (the workers wait LEAK_AFTER_S: long enough for a lease to expire first)."""

    async def sweep() -> list[str]:
        async with get_client() as client:
            return await LeakedGpus(client, logging.getLogger("test"), after_s=0).sweep()

    with stack.client_settings():
        return asyncio.run(sweep())
