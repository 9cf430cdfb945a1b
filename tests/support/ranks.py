"""Finding a run's rank processes on this host: by torchrun agent and rank, or a ReCycle trainer by rank and incarnation."""

from __future__ import annotations

import time
from pathlib import Path

import psutil

from frenzy_prefect.training.resilient.liveness import INCARNATION_ENV


def is_trainer(proc: psutil.Process, rank: int, incarnation: int) -> bool:
    """``proc`` is the trainer process (under its supervisor) of ``rank``'s ``incarnation``."""
    try:
        env, argv = proc.environ(), " ".join(proc.cmdline())
        return env.get("RANK") == str(rank) and env.get(INCARNATION_ENV) == str(incarnation) and "training.entry" in argv
    except psutil.Error:
        return False


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
