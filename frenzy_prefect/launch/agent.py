"""torchrun, plus an account of its first failed rank: ``python -m frenzy_prefect.launch.agent
ARGS`` is ``torchrun ARGS`` (torch.distributed.run, the same arguments, output and exit status);
when a rank fails, it also writes ``{"rank", "local_rank", "pid", "exitcode"}`` of the first
failure torchrun observed (its "Root Cause", global rank; a negative exit code is the signal
that killed the rank) to the launcher's failure file (see failure.py). A rank killed by SIGKILL
leaves no error file of its own; the agent saw it die, and says so here."""

from __future__ import annotations

import json
import os
import sys
import threading

from frenzy_prefect.launch.failure import write_report
from frenzy_prefect.launch.torchrun import MASTER_PORT_ENV
from frenzy_prefect.spec.plan import JOB_ENV


def _heartbeats_store() -> tuple[str, int] | None:
    """The first node's agent hosts the job's store; under resilience "recycle" it also watches
    the ranks' heartbeats there (``training.liveness``): the store's address, or None."""
    resilience = json.loads(os.environ.get(JOB_ENV, "{}")).get("request", {}).get("resilience")
    if "--node-rank=0" not in sys.argv or resilience != "recycle":
        return None
    host = next(a.removeprefix("--master-addr=") for a in sys.argv if a.startswith("--master-addr="))
    return host, int(os.environ[MASTER_PORT_ENV])


def main() -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    stop, store, watcher = threading.Event(), _heartbeats_store(), None
    if store is not None:
        from frenzy_prefect.training.resilient.liveness import watch_job_heartbeats

        watcher = threading.Thread(target=watch_job_heartbeats, args=(*store, stop), name="frenzy-heartbeats", daemon=True)
        watcher.start()
    try:
        torchrun()
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        write_report({"rank": rank, "local_rank": failure.local_rank, "pid": failure.pid, "exitcode": failure.exitcode})
        raise
    finally:
        stop.set()
        if watcher is not None:  # not left inside a store call at exit, where it would abort the process
            watcher.join(timeout=5)


if __name__ == "__main__":
    main()
