"""The local launcher: every command as a process (group) on this machine.

Each command starts in its own session, so one signal reaches the command and all its children
(torchrun's ranks). If any command fails, the others are stopped: a job lives or dies whole, and
the first failure is described in one line (ProcessGroup.failure: the rank, node, process and
signal or exit code, from the command's failure file when it leaves one; see failure.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.launch.command import Launch
from frenzy_prefect.launch.failure import FAILURE_FILE_ENV, describe, read_report
from frenzy_prefect.launch.remote import free_port

ACCOUNT_TIMEOUT_S = 5.0  # for a failed command's account of its failure (over SSH it follows the exit)


def is_local(host: str) -> bool:
    return host in {"127.0.0.1", "localhost", "::1", socket.gethostname(), socket.getfqdn()}


def is_running(pid: int, group: bool = True) -> bool:
    """Whether any process of the group ``pid`` leads (``group=False``: the process ``pid``) is
    still alive."""
    try:
        (os.killpg if group else os.kill)(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this: a stopped job is gone within ~7 s


async def stop_process_groups(pids: list[int], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM each group, SIGKILL whatever is left after ``grace_s``."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = asyncio.get_running_loop().time() + grace_s
    while any(is_running(p) for p in pids) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
    for pid in pids:
        _signal(pid, signal.SIGKILL)


async def spawn(argv: list[str], **kwargs) -> asyncio.subprocess.Process:
    """``argv`` in its own session (one signal reaches it and its children), guarded so that it
    dies with this process (see orphan_guard)."""
    guard = [sys.executable, "-m", "frenzy_prefect.launch.orphan_guard", str(os.getpid())]
    return await asyncio.create_subprocess_exec(*guard, *argv, start_new_session=True, **kwargs)


def host_and_pids(identifier: str) -> tuple[str, list[int]]:
    """The host and PIDs of a ProcessGroup.identifier."""
    host, _, pids = identifier.rpartition(":")
    return host, [int(p) for p in pids.split(",") if p]


Account = Callable[[], Awaitable[dict[str, object] | None]]  # what a process's command reported about its failure


class ProcessGroup:
    """The running commands of one job."""

    def __init__(
        self,
        processes: list[asyncio.subprocess.Process],
        launches: list[Launch],
        *,
        rendezvous_port: int | None = None,
        accounts: list[Account] | None = None,
        readers: list[asyncio.Future] | None = None,
        scratch: tempfile.TemporaryDirectory | None = None,
    ):
        self.processes = processes
        self.launches = launches[: len(processes)]  # a launcher may stop starting them early
        self.hosts = [l.host for l in self.launches]
        self.failed_host: str | None = None  # where the first failure happened
        self.failure: str | None = None  # the first failure in one line: which rank on which node, which signal or exit code
        self.failed_rank: int | None = None  # the rank that failed first, when its command said
        self.rendezvous_port = rendezvous_port  # the port given to the launches' port_env, picked on the first one's host
        self._accounts = accounts
        self.readers = readers or []  # tasks reading the processes' output, kept alive with them
        self._scratch = scratch

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    @property
    def identifier(self) -> str:
        """``HOST:PID,PID...`` (the PIDs are of processes on this machine, ssh clients included)."""
        return f"{socket.gethostname()}:{','.join(str(p) for p in self.pids)}"

    async def wait(self, grace_s: float = 10.0) -> int:
        """Wait for every command; on the first failure describe it (``failure``) and stop the
        rest. The first non-zero exit code, or 0. Cancelled, it sends every command SIGTERM."""
        pending = {asyncio.ensure_future(p.wait()): i for i, p in enumerate(self.processes)}
        first_failure = 0
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    i = pending.pop(fut)
                    code = fut.result()
                    if code != 0 and first_failure == 0:
                        first_failure, self.failed_host = code, self.hosts[i]
                        self.failure = await self._describe(i, code)
                        await stop_process_groups([self.processes[j].pid for j in pending.values()], grace_s)
        except asyncio.CancelledError:
            # The waiter is going away (a stopping worker cancels its runs): the commands stop now,
            # not when the parent-death signal reaches them at the worker's exit, competing with its
            # shutdown for the CPU until then. No grace to wait out here: torchrun stops its ranks.
            for j in pending.values():
                _signal(self.processes[j].pid, signal.SIGTERM)
            raise
        finally:
            if self._scratch is not None:
                self._scratch.cleanup()
        return first_failure

    async def _describe(self, i: int, code: int) -> str:
        report = None
        if self._accounts is not None:
            try:
                report = await asyncio.wait_for(self._accounts[i](), ACCOUNT_TIMEOUT_S)
            except TimeoutError:
                pass
        launch = self.launches[i]
        if report is not None and isinstance(report.get("rank"), int):
            self.failed_rank = report["rank"]
        return describe(launch.node or launch.host, report or {"pid": self.processes[i].pid, "exitcode": code})


async def start_local(launches: list[Launch], cwd: Path | None = None) -> ProcessGroup:
    remote = [l.host for l in launches if not is_local(l.host)]
    if remote:
        raise FrenzyError(
            f"the local launcher runs only on this machine, but the job is placed on {', '.join(sorted(set(remote)))}; "
            "declare those nodes with host 127.0.0.1 or use a launcher that reaches them"
        )
    threads = max(1, (os.cpu_count() or 1) // sum(l.processes for l in launches))
    port = free_port() if any(l.port_env for l in launches) else None  # every host is this one
    scratch = tempfile.TemporaryDirectory(prefix="frenzy-launch-")  # the commands' failure files
    failure_files = [str(Path(scratch.name) / f"failure-{i}.json") for i in range(len(launches))]
    processes: list[asyncio.subprocess.Process] = []
    try:
        for launch, failure_file in zip(launches, failure_files, strict=True):
            env = {"OMP_NUM_THREADS": str(threads), **launch.env, FAILURE_FILE_ENV: failure_file}
            if launch.port_env:
                env[launch.port_env] = str(port)
            processes.append(await spawn(launch.argv, env=env, cwd=cwd))
    except BaseException:
        await stop_process_groups([p.pid for p in processes])
        scratch.cleanup()
        raise

    def account(i: int) -> Account:
        async def read() -> dict[str, object] | None:
            return read_report(failure_files[i])

        return read

    return ProcessGroup(processes, launches, rendezvous_port=port, accounts=[account(i) for i in range(len(launches))], scratch=scratch)
