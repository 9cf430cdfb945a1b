"""The `frenzy` worker type: registered through the entry point, typed job template, launches;
a rank that dies is named with its node, PID and signal."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from frenzy_prefect.launch.command import Launch
from frenzy_prefect.launch.local import ProcessGroup, is_running, start_local
from frenzy_prefect.pool.worker import FrenzyJobConfiguration, FrenzyWorker
from tests.support.stack import ROOT


def test_kill_infrastructure_stops_every_process_of_the_run():
    async def scenario():
        group = await start_local(
            [Launch(host="127.0.0.1", argv=["sleep", "60"]), Launch(host="127.0.0.1", argv=["sh", "-c", "sleep 60 & wait"])]
        )
        await FrenzyWorker(work_pool_name="p").kill_infrastructure(group.identifier, FrenzyJobConfiguration(), grace_seconds=2)
        return group.pids, await group.wait()

    pids, code = asyncio.run(scenario())
    assert code != 0 and not any(is_running(p) for p in pids)


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
from frenzy_prefect.pool.worker import _bound_the_stop
if sys.argv[1] == "handler":  # what `prefect worker start` installs: it forwards the stop
    signal.signal(signal.SIGTERM, lambda *_: print("forwarded", flush=True))
unbind = _bound_the_stop(lambda: int(sys.argv[2] == "busy"), lambda: "Worker 'probe' stopped!")
if sys.argv[2] == "unbound":  # the worker's teardown: the previous handler is back
    unbind()
print("ready", flush=True)
time.sleep(60)  # a shutdown that waits on a server which never answers
"""


@pytest.mark.parametrize(
    ("previous", "state", "ends"),
    [
        ("handler", "idle", 0),  # the bound ends it, saying so, the previous handler ran first
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
        said = probe.stdout.read().splitlines() if code is not None else [probe.stdout.readline().strip()]
        if previous == "handler":
            assert said[0] == "forwarded"
        assert ("Worker 'probe' stopped!" in said) == (code == 0), said
    finally:
        probe.kill()
        probe.wait()
