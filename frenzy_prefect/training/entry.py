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
from collections.abc import Callable

from frenzy_prefect.spec.plan import JOB_ENV, TrainingJob
from frenzy_prefect.training.distributed import DistributedContext, PeerFailed
from frenzy_prefect.training.fence import Fenced, fenced_in
from frenzy_prefect.training.resilient.generations import EXCLUDED_EXIT, Excluded
from frenzy_prefect.training.resilient.liveness import INCARNATION_ENV
from frenzy_prefect.training.resilient.supervisor import FENCED, report_event, report_result, supervise
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
        except Exception as exc:
            if (fenced := fenced_in(exc)) is None:
                raise
            print(FENCED + str(fenced), flush=True)  # its supervisor raises it (exit 0: nothing more to do)
        return
    if ctx.rank == 0 and os.environ.get("PREFECT__FLOW_RUN_ID"):
        runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)
        return
    if job.purpose == "check":  # a node's check (`frenzy cluster check`): this rank's part, rank 0 gathering
        from frenzy_prefect.training.node_check import check_ranks

        check_ranks(job, ctx)
        return
    train_quietly(job, ctx, log=lambda _: None)


def train_quietly(job: TrainingJob, ctx: DistributedContext, log: Callable[[str], None]) -> None:
    """Train as a rank that reports nothing to Prefect. It ends quietly (exit 0), saying why on
    stderr, when it stops for another rank's failure (rank 0 reports it to Prefect and exits
    non-zero) or because a newer generation of the run's attempts holds the run (fence.py):
    exiting non-zero would let torchrun restart the ranks."""
    try:
        if job.request.resilience == "recycle":
            supervise(job, ctx, log=print, notify=lambda event, details: None)
        else:
            train(job, ctx, log=log)
    except (PeerFailed, Fenced) as exc:
        cause = f" ({type(exc.__cause__).__name__}: {exc.__cause__})" if exc.__cause__ else ""
        print(f"{exc}{cause}", file=sys.stderr)


if __name__ == "__main__":
    main()
