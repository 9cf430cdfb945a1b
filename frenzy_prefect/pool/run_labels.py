"""The labels a `frenzy` worker puts on the flow runs it takes: what every worker of the pool
(and a person in the UI) reads to know who serves a run, what it waits for and what it holds."""

from __future__ import annotations

import os
import socket

WORKER = "frenzy.worker"  # the worker's name
PROCESS = "frenzy.worker-process"  # HOST:PID of the worker process that took the run
WAITING_FOR = "frenzy.waiting-for"  # CLUSTER/GPU_TYPE while the run waits for GPUs, else ""
HOLDS = "frenzy.holds"  # the run's cluster, GPUs and predicted end (JSON), from when its GPUs were taken
LEASE = "frenzy.lease"  # the run's GPU reservation, RELEASED once its worker let it go
# The GPU limits (space-separated names) the run holds or is taking: set before they are taken,
# cleared once they are given back, so that a GPU a live run holds is never taken for leaked.
GPUS = "frenzy.gpus"
RELEASED = "released"
RECLAIMED_BY = "frenzy.reclaimed-by"  # the worker that reclaimed the run after its own was lost


def this_process() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"
