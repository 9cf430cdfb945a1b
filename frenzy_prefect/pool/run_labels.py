"""The labels a `frenzy` worker puts on the flow runs it takes: what every worker of the pool
(and a person in the UI) reads to know who serves a run, what it waits for and what it holds."""

from __future__ import annotations

import os
import socket

WORKER = "frenzy.worker"  # the worker's name
PROCESS = "frenzy.worker-process"  # HOST:PID of the worker process that took the run
WAITING_FOR = "frenzy.waiting-for"  # CLUSTER/GPU_TYPE while the run waits for GPUs, else ""
LEASE = "frenzy.lease"  # the run's GPU reservation, RELEASED once its worker let it go
RELEASED = "released"
RECLAIMED_BY = "frenzy.reclaimed-by"  # the worker that reclaimed the run after its own was lost


def this_process() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"
