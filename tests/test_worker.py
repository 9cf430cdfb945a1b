"""The `frenzy` worker type: registered through the entry point, typed job template, launches;
a rank that dies is named with its node, PID and signal."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from uuid import uuid4

import pytest
from prefect.client.schemas.objects import FlowRun
from prefect.workers.base import BaseWorker

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.launch.command import Launch
from frenzy_prefect.launch.local import ProcessGroup, is_running, start_local
from frenzy_prefect.launch.torchrun import rank_launches
from frenzy_prefect.pool.worker import FrenzyJobConfiguration, FrenzyWorker, training_job_of
from frenzy_prefect.profiling.dataset import profile_dataset
from frenzy_prefect.spec.plan import ParallelPlan, Placement
from frenzy_prefect.training.entry import JOB_ENV

from .conftest import BUCKET, ROOT
from .test_training import NANO, make_job, unchecked


def test_prefect_finds_the_frenzy_worker_type_through_the_entry_point():
    assert BaseWorker.get_worker_class_from_type("frenzy") is FrenzyWorker


def test_the_worker_carries_prefects_catalogue_metadata():
    assert FrenzyWorker.get_documentation_url().startswith("https://docs.prefect.io/")
    assert FrenzyWorker.get_logo_url().startswith("https://raw.githubusercontent.com/PrefectHQ/prefect/")
    assert FrenzyWorker.get_logo_url().endswith(".png")
    assert "frenzy.gpu.waiting" in FrenzyWorker.get_description() and "Frenzy" in FrenzyWorker.get_description()


def test_the_base_job_template_is_typed_and_described():
    template = FrenzyWorker.get_default_base_job_template()
    props = template["variables"]["properties"]
    assert {"working_dir", "env", "command"} <= set(props)
    assert all(p.get("description") for p in props.values())
    assert template["job_configuration"]["working_dir"] == "{{ working_dir }}"


def _run(parameters):
    return FlowRun(flow_id=uuid4(), parameters=parameters)


def test_a_training_run_becomes_one_torchrun_agent_per_node():
    job = make_job(
        unchecked("s3://b/d.txt"),
        "s3://b/out",
        ParallelPlan(dp=3, micro_batch=1),
        global_batch=12,
        placements=[Placement(node="a", host="127.0.0.1", gpus=[0, 1]), Placement(node="b", host="127.0.0.1", gpus=[3])],
    )
    config = FrenzyJobConfiguration(command="ignored for training runs", env={"EXTRA": "1"})
    launches = FrenzyWorker(work_pool_name="p").launches_for(config, training_job_of(_run({"job": job.model_dump(mode="json")})))
    assert [l.processes for l in launches] == [2, 1]
    assert [l.env["CUDA_VISIBLE_DEVICES"] for l in launches] == ["0,1", "3"]
    assert all(l.env["EXTRA"] == "1" and JOB_ENV in l.env for l in launches)
    first, second = (" ".join(l.argv) for l in launches)
    assert "--nnodes=2 --node-rank=0 --nproc-per-node=2" in first and "--node-rank=1 --nproc-per-node=1" in second
    # The rendezvous port is left to the launcher, which picks it free on the first node's host.
    assert not any(a.startswith("--master-port") for l in launches for a in l.argv)
    assert [l.port_env for l in launches] == ["PET_MASTER_PORT"] * 2 and all("--master-addr=127.0.0.1" in l.argv for l in launches)


def test_any_other_run_is_one_engine_process_here():
    config = FrenzyJobConfiguration(command=f"{sys.executable} -m prefect.engine")
    (launch,) = FrenzyWorker(work_pool_name="p").launches_for(config, training_job_of(_run({"request": {}})))
    assert launch.argv == [sys.executable, "-m", "prefect.engine"] and launch.host == "127.0.0.1"


def test_the_local_launcher_refuses_remote_hosts_before_starting_anything():
    with pytest.raises(FrenzyError, match="runs only on this machine, but the job is placed on gpu-17"):
        asyncio.run(start_local([Launch(host="127.0.0.1", argv=["true"]), Launch(host="gpu-17", argv=["true"])]))


def test_kill_infrastructure_stops_every_process_of_the_run():
    async def scenario():
        group = await start_local(
            [Launch(host="127.0.0.1", argv=["sleep", "60"]), Launch(host="127.0.0.1", argv=["sh", "-c", "sleep 60 & wait"])]
        )
        await FrenzyWorker(work_pool_name="p").kill_infrastructure(group.identifier, FrenzyJobConfiguration(), grace_seconds=2)
        return group.pids, await group.wait()

    pids, code = asyncio.run(scenario())
    assert code != 0 and not any(is_running(p) for p in pids)


def rank_pid(agent: int, rank: int, timeout_s: float = 120) -> int:
    """The PID of global rank ``rank`` among the torchrun agent ``agent``'s children (from /proc)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                if ppid == agent and f"RANK={rank}".encode() in (stat.parent / "environ").read_bytes().split(b"\0"):
                    return int(stat.parent.name)
            except (OSError, ValueError, IndexError):
                continue
        time.sleep(0.2)
    raise AssertionError(f"no rank {rank} under torchrun agent {agent} after {timeout_s:.0f} s")


@pytest.mark.faults
def test_a_rank_killed_with_sigkill_is_named_with_its_node_and_signal(dataset):
    """A real two-rank job (one torchrun agent, gloo); rank 1 is killed with -9 mid-training. The
    group's one-line failure names the rank, its node, its PID and the signal (torchrun's own
    account of which rank died, through the failure file), and every process is gone."""
    job = make_job(
        profile_dataset(dataset, 64, NANO.vocab_size),
        f"s3://{BUCKET}/runs/rank-killed",
        ParallelPlan(dp=2, micro_batch=4),
        [Placement(node="n0", host="127.0.0.1", gpus=[0, 1])],
        steps=100_000,
    )

    async def scenario() -> tuple[int, int, ProcessGroup]:
        group = await start_local(rank_launches(job, python=sys.executable, env=dict(os.environ)))
        victim = await asyncio.to_thread(rank_pid, group.pids[0], 1)
        os.kill(victim, signal.SIGKILL)
        return await group.wait(), victim, group

    code, victim, group = asyncio.run(scenario())
    assert code != 0 and not any(is_running(p) for p in group.pids)
    assert group.failure == f"rank 1 on n0 (pid {victim}) was killed by SIGKILL" and group.failed_rank == 1


@pytest.mark.faults
def test_a_command_without_ranks_is_named_by_its_node_and_pid():
    async def scenario() -> tuple[int, int, ProcessGroup]:
        group = await start_local(
            [Launch(host="127.0.0.1", node="n0", argv=["sleep", "60"]), Launch(host="127.0.0.1", argv=["sleep", "60"])]
        )
        os.kill(group.pids[0], signal.SIGKILL)
        return await group.wait(grace_s=2), group.pids[0], group

    code, pid, group = asyncio.run(scenario())
    assert code == -signal.SIGKILL and group.failure == f"the command on n0 (pid {pid}) was killed by SIGKILL"


def test_cancelling_the_wait_stops_every_command_at_once():
    """A stopping worker cancels its runs: their processes get SIGTERM then, instead of running on
    (and competing for the CPU with the worker's shutdown) until the parent-death signal at its
    exit."""

    async def scenario() -> list[int]:
        group = await start_local(
            [Launch(host="127.0.0.1", argv=["sleep", "60"]), Launch(host="127.0.0.1", argv=["sh", "-c", "sleep 60 & wait"])]
        )
        waiting = asyncio.ensure_future(group.wait())
        await asyncio.sleep(0.5)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return group.pids

    pids = asyncio.run(scenario())
    deadline = time.monotonic() + 20  # a failure guard, not a timing: SIGTERM ends sleep at once
    while any(is_running(p) for p in pids):
        assert time.monotonic() < deadline, "commands still running after their wait was cancelled"
        time.sleep(0.1)


def test_the_worker_process_does_not_import_torch():
    """`prefect worker start` loads the worker through the collection entry point; torch (seconds
    to import, and more to tear down at exit) is for the ranks, never the worker."""
    probe = "import sys, frenzy_prefect.collection\nprint(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


STOP_PROBE = """
import signal, sys, time
from frenzy_prefect.pool.worker import _bound_a_stop_while_idle
if sys.argv[1] == "handler":  # what `prefect worker start` installs: it forwards the stop
    signal.signal(signal.SIGTERM, lambda *_: print("forwarded", flush=True))
unbind = _bound_a_stop_while_idle(lambda: sys.argv[2] != "busy")
if sys.argv[2] == "unbound":  # the worker's teardown: the previous handler is back
    unbind()
print("ready", flush=True)
time.sleep(60)  # a shutdown that waits on a server which never answers
"""


@pytest.mark.parametrize(
    ("previous", "state", "ends"),
    [
        ("handler", "idle", 0),  # the bound ends it, the previous handler ran first
        ("default", "idle", -signal.SIGTERM),  # no handler before: SIGTERM's own action
        ("handler", "busy", None),  # runs in flight: their stop comes first, no early exit
        ("handler", "unbound", None),  # after teardown, only the previous handler
    ],
)
def test_a_sigterm_to_an_idle_worker_bounds_its_exit_and_still_reaches_the_previous_handler(previous, state, ends):
    from frenzy_prefect.pool.worker import EXIT_FLUSH_S

    probe = subprocess.Popen([sys.executable, "-c", STOP_PROBE, previous, state], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert probe.stdout.readline().strip() == "ready"
        probe.send_signal(signal.SIGTERM)
        try:
            code = probe.wait(timeout=EXIT_FLUSH_S + 3)
        except subprocess.TimeoutExpired:
            code = None
        assert code == ends
        if previous == "handler":
            assert probe.stdout.readline().strip() == "forwarded"
    finally:
        probe.kill()
        probe.wait()
