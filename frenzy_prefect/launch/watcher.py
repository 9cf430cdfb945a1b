"""A launcher that watches a job a cluster manager runs (Slurm, Kubernetes): one local process,
started and guarded like any launched command (orphan_guard: it dies with the worker, cancelling
the job on its way), whose stdout is the job's story for the flow run's log and whose failure
file names the job's first failure."""

from __future__ import annotations

import asyncio
import re
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from frenzy_prefect.launch.command import Launch
from frenzy_prefect.launch.failure import FAILURE_FILE_ENV, read_report
from frenzy_prefect.launch.local import ProcessGroup, spawn, stop_process_groups

# Prefect's console format for a run's own records: rank 0 already sent these to the run's log.
ALREADY_LOGGED = re.compile(r"^\d\d:\d\d:\d\d\.\d+ \| \w+\s*\| (Flow|Task) run '")


async def start_watcher(launch: Launch, on_line: Callable[[str], Awaitable[None]], cwd: Path | None = None) -> ProcessGroup:
    """Start the watcher; each line it prints goes to ``on_line`` (the flow run's log)."""
    scratch = tempfile.TemporaryDirectory(prefix="frenzy-watcher-")
    failure = str(Path(scratch.name) / "failure.json")
    env = {**launch.env, FAILURE_FILE_ENV: failure}
    try:
        proc = await spawn(launch.argv, env=env, cwd=cwd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    except BaseException:
        scratch.cleanup()
        raise

    async def forward() -> None:
        assert proc.stdout is not None
        async for line in proc.stdout:
            await on_line(line.decode(errors="replace").rstrip("\n"))

    async def account() -> dict[str, object] | None:
        await reader
        return read_report(failure)

    reader = asyncio.ensure_future(forward())
    try:
        return ProcessGroup([proc], [launch], accounts=[account], readers=[reader], scratch=scratch)
    except BaseException:
        await stop_process_groups([proc.pid])
        raise
