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
TRACEBACK = "Traceback (most recent call last):"
CHAINED = ("The above exception was the direct cause of the following exception:", "During handling of the above exception")
RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s?")  # torch prefixes its ranks' error output so
BANNER = re.compile(r"^={20,}$")  # torchrun's ChildFailedError report opens and closes with one
FIELD = re.compile(r"^\s+(rank|exitcode|traceback)\s*:\s*(.*)$")
GLOO_FAREWELL = re.compile(r"\s*GLHF!.*$")  # the end of gloo's closed-connection error: no cause in it
MODULE_PATH = re.compile(r"^(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_]\w*(?::|$))")


class CondensedOutput:
    """A node's output as its run's log shows it: each Python traceback as the one line naming
    its exception, torchrun's ChildFailedError report as one line naming the rank that failed
    first, each pointing at the full output, and gloo's "GLHF!" sign-off cut from its error.
    Lines come one at a time, as read (a traceback may span reads); each rank's (torch's
    ``[rankN]:`` prefix) are followed on their own, since the ranks' output interleaves."""

    def __init__(self, full_output: str) -> None:
        self.full_output = full_output
        self._states: dict[str, str] = {}  # prefix -> text, frames (in a traceback), after (its exception said), banner
        self._root: dict[str, str] = {}  # torchrun's report: the root cause's fields

    def feed(self, line: str) -> list[str]:
        """What to log of ``line``: itself, its condensed traceback once it ends, or nothing."""
        prefix = found[0] if (found := RANK_PREFIX.match(line)) else ""
        text = GLOO_FAREWELL.sub("", line[len(prefix) :])
        state = self._states.get(prefix, "text")
        if state == "frames" and (not text.strip() or text[0].isspace()):
            return []
        if state == "frames":
            return [prefix + said for said in self._exception(prefix, text)]
        if state == "banner":
            return self._banner(text)
        if state == "after" and (not text.strip() or text.startswith(CHAINED)):
            return []
        self._states[prefix] = "frames" if text.startswith(TRACEBACK) else "banner" if BANNER.match(text) else "text"
        if self._states[prefix] == "banner":
            self._root = {}
        return [prefix + text] if self._states[prefix] == "text" else []

    def _exception(self, prefix: str, text: str) -> list[str]:
        self._states[prefix] = "after"
        if re.search(r"ChildFailedError:\s*$", text):
            return []  # torchrun's report follows, in a banner
        return [f"{MODULE_PATH.sub('', text.strip())} (traceback in {self.full_output})"]

    def _banner(self, text: str) -> list[str]:
        if text.startswith("Root Cause"):
            self._root = {"found": "yes"}
        elif self._root and (found := FIELD.match(text)):
            self._root[found[1]] = found[2].strip()
        if not BANNER.match(text):
            return []
        self._states[""] = "after"
        rank, code, trace = (self._root.get(k, "?") for k in ("rank", "exitcode", "traceback"))
        why = trace if trace.startswith("Signal") else f"exitcode {code}"
        return [f"torchrun: rank {rank} failed first: {why} (full report in {self.full_output})"]


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
