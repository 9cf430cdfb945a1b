"""What torchrun starts on every rank of a training job.

Rank 0 executes the job's Prefect flow run (``distributed-train``), which trains as rank 0 and
reports progress to Prefect; every other rank trains directly from the job in the environment.
Under resilience "recycle" each rank supervises its trainer, a child process started again from
this module (``supervisor.py``).
"""

from __future__ import annotations

import os
import runpy
import sys

from frenzy_prefect.spec.plan import JOB_ENV, TrainingJob
from frenzy_prefect.training.distributed import DistributedContext, PeerFailed
from frenzy_prefect.training.resilient.generations import EXCLUDED_EXIT, Excluded
from frenzy_prefect.training.resilient.liveness import INCARNATION_ENV
from frenzy_prefect.training.resilient.supervisor import report_event, report_result, supervise
from frenzy_prefect.training.trainer import train


def main() -> None:
    ctx, job = DistributedContext.from_env(), TrainingJob.model_validate_json(os.environ[JOB_ENV])
    if INCARNATION_ENV in os.environ:  # a trainer under its rank's supervisor (resilience "recycle")
        # (imported here: its planners import SciPy, which a plain run's ranks need not load at every start)
        from frenzy_prefect.training.resilient.trainer import train as train_through_failures

        try:
            report_result(train_through_failures(job, ctx, log=print, notify=report_event))
        except Excluded as exc:
            print(exc, file=sys.stderr)
            sys.exit(EXCLUDED_EXIT)
        return
    if ctx.rank == 0 and os.environ.get("PREFECT__FLOW_RUN_ID"):
        runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)
        return
    try:
        if job.request.resilience == "recycle":
            supervise(job, ctx, log=print, notify=lambda event, details: None)
        else:
            train(job, ctx, log=lambda _: None)
    except PeerFailed as exc:  # exit 0: rank 0 reports the failure to Prefect and exits non-zero
        cause = f" ({type(exc.__cause__).__name__}: {exc.__cause__})" if exc.__cause__ else ""
        print(f"{exc}{cause}", file=sys.stderr)


if __name__ == "__main__":
    main()
