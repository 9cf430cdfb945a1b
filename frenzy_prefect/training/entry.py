"""What torchrun starts on every rank of a training job.

Rank 0 executes the job's Prefect flow run (``distributed-train``), which trains as rank 0 and
reports progress to Prefect; every other rank trains directly from the job in the environment.
"""

from __future__ import annotations

import os
import runpy

from frenzy_prefect.spec.plan import JOB_ENV, TrainingJob
from frenzy_prefect.training.distributed import DistributedContext
from frenzy_prefect.training.trainer import train


def main() -> None:
    ctx = DistributedContext.from_env()
    if ctx.rank == 0 and os.environ.get("PREFECT__FLOW_RUN_ID"):
        runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)
        return
    train(TrainingJob.model_validate_json(os.environ[JOB_ENV]), ctx, log=lambda _: None)


if __name__ == "__main__":
    main()
