"""torchrun, plus an account of its first failed rank: ``python -m frenzy_prefect.launch.agent
ARGS`` is ``torchrun ARGS`` (torch.distributed.run, the same arguments, output and exit status);
when a rank fails, it also writes ``{"rank", "local_rank", "pid", "exitcode", "attempt"}`` of the
first failure torchrun observed (its "Root Cause", global rank; a negative exit code is the
signal that killed the rank; the attempt: how many times torchrun had restarted the ranks) to
the launcher's failure file (see failure.py). It writes it as soon as torchrun sees the failure,
before torchrun stops the other ranks (to end or to restart them all), so that rank 0, which the ranks'
environment points at the same file, can already say why it is being stopped (or, restarted,
why). A rank killed by SIGKILL leaves no error file of its own; the agent saw it die, and says
so here."""

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


def root_cause(failures: list) -> object:
    """The failure that stopped the ranks, of those torchrun's one poll found: the earliest rank
    killed by a signal, else the earliest. Its timestamps are whole seconds, and a rank whose
    peer was killed fails its next collective and exits with an error (rank 0 after waiting for
    this account: rank_deaths), so on a loaded host the consequence can share the poll and the
    second with its cause, or carry the earlier second in its error file; a signal is never a
    peer's consequence before torchrun itself stops the ranks."""
    return min(failures, key=lambda f: (f.exitcode >= 0, f.timestamp))


def _reporting_failures(context_class: type) -> None:
    """Have torchrun write its first failed rank's account before it stops the other ranks. The
    rank's process context stops them (``close``) the moment its poll sees a rank fail, inside
    the agent's monitoring: an account written once the agent sees the failure comes after rank
    0 got its SIGTERM, too late for rank 0 to read it."""
    close = context_class.close

    def report_then_close(context, *args, **kwargs):
        if context._failures:  # (else all ranks ended well, or torchrun itself is being stopped)
            failure = root_cause(list(context._failures.values()))
            env = context.envs[failure.local_rank]  # what the agent started the rank with
            write_report(
                {
                    "rank": int(env["RANK"]),
                    "local_rank": failure.local_rank,
                    "pid": failure.pid,
                    "exitcode": failure.exitcode,
                    "attempt": int(env["TORCHELASTIC_RESTART_COUNT"]),
                }
            )
        close(context, *args, **kwargs)

    context_class.close = report_then_close


def main() -> None:
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext  # torchrun's, for a script's ranks
    from torch.distributed.run import main as torchrun

    _reporting_failures(SubprocessContext)

    stop, store, watcher = threading.Event(), _heartbeats_store(), None
    if store is not None:
        from frenzy_prefect.training.resilient.liveness import watch_job_heartbeats

        watcher = threading.Thread(target=watch_job_heartbeats, args=(*store, stop), name="frenzy-heartbeats", daemon=True)
        watcher.start()
    try:
        torchrun()  # (a failed rank's account is written as torchrun sees it: _reporting_failures)
    finally:
        stop.set()
        if watcher is not None:  # not left inside a store call at exit, where it would abort the process
            watcher.join(timeout=5)


if __name__ == "__main__":
    main()
