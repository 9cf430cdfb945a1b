"""How a launched command ended, in one line a person can act on: which rank, on which node,
which process, killed by which signal or exited with which code.

A command that knows more than its exit status (the torchrun agent: which of its ranks failed
first) writes it as JSON to the file named by FAILURE_FILE_ENV, which the launcher sets; the
launcher reads it once the command has exited (over SSH the remote end reads it and sends it
back). Standard library only: the remote end imports this on the nodes.
"""

from __future__ import annotations

import json
import os
import signal

FAILURE_FILE_ENV = "FRENZY_FAILURE_FILE"


def write_report(report: dict[str, object]) -> None:
    """Leave ``report`` where the launcher looks (nothing if it set no file)."""
    path = os.environ.get(FAILURE_FILE_ENV)
    if path:
        with open(f"{path}.part", "w") as f:
            json.dump(report, f)
        os.replace(f"{path}.part", path)  # whole or absent: a rank may read it at any moment


def read_report(path: str) -> dict[str, object] | None:
    """What the command left in its failure file, or None."""
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def failure_in_attempt(attempt: int) -> dict[str, object] | None:
    """What this process's torchrun agent reported of the rank that failed in ``attempt`` (0: the
    ranks' first start; torchrun's restarts count on), or None. Ranks read it too: their agent's
    environment, and so theirs, names its failure file."""
    path = os.environ.get(FAILURE_FILE_ENV)
    report = read_report(path) if path else None
    return report if report is not None and report.get("attempt") == attempt else None


def ended(code: int) -> str:
    """``was killed by SIGKILL`` for a negative exit status (Python's way of saying a signal), else ``exited with code N``."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def describe(where: str, report: dict[str, object]) -> str:
    """E.g. ``rank 1 on a10-node (pid 4242) was killed by SIGKILL``. ``report``: ``exitcode`` and
    ``pid``, with ``rank`` when a rank failed, or ``command`` naming what ended instead; ``node``
    where it says better than ``where`` which node failed, ``ended`` when how it ended is not an
    exit code (a Slurm job's state)."""
    where = str(report.get("node") or where)
    if "ended" in report:
        return f"{report.get('command') or 'the command'} on {where} {report['ended']}"
    who = f"rank {report['rank']}" if "rank" in report else str(report.get("command") or "the command")
    return f"{who} on {where} (pid {report.get('pid', '?')}) {ended(int(report['exitcode']))}"  # type: ignore[arg-type]
