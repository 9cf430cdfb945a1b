"""torchrun, plus an account of its first failed rank: ``python -m frenzy_prefect.launch.agent
ARGS`` is ``torchrun ARGS`` (torch.distributed.run, the same arguments, output and exit status);
when a rank fails, it also writes ``{"rank", "local_rank", "pid", "exitcode"}`` of the first
failure torchrun observed (its "Root Cause", global rank; a negative exit code is the signal
that killed the rank) to the launcher's failure file (see failure.py). A rank killed by SIGKILL
leaves no error file of its own; the agent saw it die, and says so here."""

from __future__ import annotations

from frenzy_prefect.launch.failure import write_report


def main() -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun()
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        write_report({"rank": rank, "local_rank": failure.local_rank, "pid": failure.pid, "exitcode": failure.exitcode})
        raise


if __name__ == "__main__":
    main()
