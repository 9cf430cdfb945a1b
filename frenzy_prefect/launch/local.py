"""The local launcher: every command as a process (group) on this machine.

Each command starts in its own session, so one signal reaches the command and all its children
(torchrun's ranks). If any command fails, the others are stopped: a job lives or dies whole.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.launch.command import Launch
from frenzy_prefect.launch.remote import free_port


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


async def stop_process_groups(pids: list[int], grace_s: float) -> None:
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


class ProcessGroup:
    """The running commands of one job."""

    def __init__(
        self,
        processes: list[asyncio.subprocess.Process],
        hosts: list[str] | None = None,
        rendezvous_port: int | None = None,
        readers: list[asyncio.Future] | None = None,
    ):
        self.processes = processes
        self.hosts = hosts or ["127.0.0.1"] * len(processes)
        self.failed_host: str | None = None  # where the first failure happened
        self.rendezvous_port = rendezvous_port  # the port given to the launches' port_env, picked on the first one's host
        self.readers = readers or []  # tasks reading the processes' output, kept alive with them

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    @property
    def identifier(self) -> str:
        """``HOST:PID,PID...`` (the PIDs are of processes on this machine, ssh clients included)."""
        return f"{socket.gethostname()}:{','.join(str(p) for p in self.pids)}"

    async def wait(self, grace_s: float = 10.0) -> int:
        """Wait for every command; on the first failure stop the rest. The first non-zero exit code, or 0."""
        pending = {asyncio.ensure_future(p.wait()): (p, host) for p, host in zip(self.processes, self.hosts, strict=True)}
        first_failure = 0
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                _, host = pending.pop(fut)
                code = fut.result()
                if code != 0 and first_failure == 0:
                    first_failure, self.failed_host = code, host
                    await stop_process_groups([p.pid for p, _ in pending.values()], grace_s)
        return first_failure


async def start_local(launches: list[Launch], cwd: Path | None = None) -> ProcessGroup:
    remote = [l.host for l in launches if not is_local(l.host)]
    if remote:
        raise FrenzyError(
            f"the local launcher runs only on this machine, but the job is placed on {', '.join(sorted(set(remote)))}; "
            "declare those nodes with host 127.0.0.1 or use a launcher that reaches them"
        )
    threads = max(1, (os.cpu_count() or 1) // sum(l.processes for l in launches))
    port = free_port() if any(l.port_env for l in launches) else None  # every host is this one
    processes: list[asyncio.subprocess.Process] = []
    try:
        for launch in launches:
            env = {"OMP_NUM_THREADS": str(threads), **launch.env, **({launch.port_env: str(port)} if launch.port_env else {})}
            processes.append(await spawn(launch.argv, env=env, cwd=cwd))
    except BaseException:
        await stop_process_groups([p.pid for p in processes], grace_s=5)
        raise
    return ProcessGroup(processes, rendezvous_port=port)
