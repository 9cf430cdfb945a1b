"""A rank's supervisor under ReCycle: the process torchrun starts runs the rank's trainer as a child,
so that the trainer's death is not the rank's.

torchrun stops every rank when one of its processes dies; here its process is the supervisor,
which survives its trainer. When the trainer is killed (a signal: SIGKILL, the OOM killer, a
crash), the supervisor records the death in the job's store at once (``liveness``; the survivors
re-route around it) and starts a replacement trainer, which rejoins the job at an iteration
boundary; after ``max_replacements`` it stops replacing and the others train on without it. A
trainer that exits with an error (a bad dataset, a bug) is not replaced: the supervisor raises
it, and torchrun ends the job. A trainer the store declares dead (its heartbeat stood still) is
killed, so that what the survivors believe is true and its connections close.

The trainer reports on its standard output: log lines, ``frenzy-event {json}`` lines (failures
survived, for Prefect events) and a last ``frenzy-result {json}`` line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from frenzy_prefect.spec.plan import TrainingJob
from frenzy_prefect.spec.result import TrainingResult
from frenzy_prefect.training.distributed import DistributedContext
from frenzy_prefect.training.fence import Fenced
from frenzy_prefect.training.resilient.generations import EXCLUDED_EXIT, finished_result
from frenzy_prefect.training.resilient.liveness import HEARTBEAT_S, INCARNATION_ENV, Log, mark_dead

RESULT, EVENT, FENCED = "frenzy-result ", "frenzy-event ", "frenzy-fenced "


def report_event(event: str, details: dict) -> None:
    """The trainer's side: an event line for its supervisor."""
    print(EVENT + json.dumps({"event": event, "details": details}), flush=True)


def report_result(result: TrainingResult) -> None:
    print(RESULT + result.model_dump_json(), flush=True)


def supervise(job: TrainingJob, ctx: DistributedContext, log: Callable[[str], None], notify: Callable[[str, dict], None]) -> TrainingResult:
    """Run this rank's trainer, replaced when it is killed; returns the training's result."""
    store = ctx.rendezvous()
    for incarnation in range(job.request.max_replacements + 1):
        code, result = _run_trainer(incarnation, ctx, log, notify)
        if result is not None:
            return result
        if code >= 0 and code != EXCLUDED_EXIT:
            raise RuntimeError(f"rank {ctx.rank}'s trainer failed with exit code {code} (its error is in the log above)")
        mark_dead(store, (ctx.rank, incarnation))
        cause = "was left out by the survivors (it reported in too late)" if code == EXCLUDED_EXIT else f"was killed by signal {-code}"
        notify("rank-failed", {"ranks": [ctx.rank], "cause": f"its trainer {cause}"})
        if incarnation < job.request.max_replacements:
            most = job.request.max_replacements
            log(f"rank {ctx.rank}'s trainer {cause}; starting replacement {incarnation + 1} of {most}")
    log(f"rank {ctx.rank} used its {job.request.max_replacements} replacements; the others train on without it")
    return _wait_for_the_end(store)


def _run_trainer(incarnation: int, ctx: DistributedContext, log, notify) -> tuple[int, TrainingResult | None]:
    guard = [sys.executable, "-m", "frenzy_prefect.launch.orphan_guard", str(os.getpid())]  # it dies with this process
    trainer = subprocess.Popen(
        [*guard, sys.executable, "-m", "frenzy_prefect.training.entry"],
        env={**os.environ, INCARNATION_ENV: str(incarnation)},
        stdout=subprocess.PIPE,
        text=True,
    )
    stop = threading.Event()
    fence = threading.Thread(target=_kill_when_declared_dead, args=(ctx.rendezvous(), (ctx.rank, incarnation), trainer, stop), daemon=True)
    fence.start()
    result, fenced = None, None
    for line in trainer.stdout:
        if line.startswith(RESULT):
            result = TrainingResult.model_validate_json(line.removeprefix(RESULT))
        elif line.startswith(FENCED):  # a newer generation holds the run (training.fence): this rank stops
            fenced = line.removeprefix(FENCED).rstrip("\n")
        elif line.startswith(EVENT):
            message = json.loads(line.removeprefix(EVENT))
            notify(message["event"], message["details"])
        else:
            log(line.rstrip("\n"))
    code = trainer.wait()
    stop.set()
    # Joined, not left as a daemon: a daemon thread caught inside a store call when the
    # interpreter exits is ended by pthread_exit in C++ code, and the process aborts (SIGABRT).
    fence.join()
    if fenced is not None:
        raise Fenced(fenced)
    return code, result if code == 0 else None


def _kill_when_declared_dead(store, incarnation, trainer: subprocess.Popen, stop: threading.Event) -> None:
    deaths = Log(store, "dead")  # (its own connection: the main thread's may be waiting)
    while not stop.wait(HEARTBEAT_S):
        if incarnation in deaths.new():
            trainer.kill()
            return


def _wait_for_the_end(store) -> TrainingResult:
    while (result := finished_result(store)) is None:
        time.sleep(1.0)
    return result
