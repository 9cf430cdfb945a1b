"""Rank 0 of a training run names the rank whose death stopped or restarted it.

When a rank dies, torchrun's agent writes which one, how and in which attempt to its failure
file before it stops the other ranks (launch.agent), and the ranks' environment names that
file. So rank 0, executing the run's flow run, already knows the cause when torchrun's SIGTERM
reaches it (when its collective fails first, it waits a moment for that account): the run's
first Crashed state names the rank, its node and the signal or exit code (what the worker also
writes, once every process has ended), instead of Prefect's "aborted by a termination signal"
or the collective's error. When torchrun restarts the ranks instead (``max_restarts``), the restarted
rank 0 logs which rank died and the step it resumes from."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from uuid import UUID

from prefect.logging.handlers import APILogHandler
from prefect.states import Crashed

from frenzy_prefect.flows.brief_reports import brief_client, leave_now, server_is_away
from frenzy_prefect.launch.failure import describe, failure_in_attempt
from frenzy_prefect.spec.plan import TrainingJob

Notify = Callable[[str, dict], None]
# How long a rank 0 whose training failed waits for its agent's account of another rank's death:
# torchrun's agent looks at its ranks every 0.1 s (--monitor-interval) and writes the account at
# once; slack for loaded cores. A failure of rank 0's own is reported that much later.
PEER_DEATH_NOTICE_S = 2.0


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def _death_in(attempt: int, job: TrainingJob) -> tuple[int, str] | None:
    """(the rank, the cause in one line) of the rank that died first in ``attempt``, or None."""
    report = failure_in_attempt(attempt)
    if report is None or not isinstance(report.get("rank"), int):
        return None
    node = job.allocation.placements[int(os.environ.get("GROUP_RANK", 0))].node  # this agent's, where it saw the rank die
    return report["rank"], describe(node, report)


def _report_crashed(flow_run_id: UUID, message: str, exit_code: int) -> bool:
    """Whether the run was marked Crashed with ``message``; the server away, this process ends."""
    try:
        with brief_client() as client:
            client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)
    except Exception as exc:
        if server_is_away(exc):
            leave_now(exit_code)
        return False  # the engine reports the crash, and the worker names it
    return True


def _crash_if_a_peer_died(flow_run_id: UUID, job: TrainingJob, exit_code: int) -> None:
    """If another rank died in this attempt: the run marked Crashed naming it, and this process
    ended (the engine must not report the crash again; nor can it, the server away); else nothing."""
    death = _death_in(_attempt(), job)
    if death is not None and death[0] != int(os.environ.get("RANK", 0)) and _report_crashed(flow_run_id, death[1], exit_code):
        try:
            APILogHandler().flush()  # what rank 0 logged so far: os._exit skips the flush at exit
        finally:
            os._exit(exit_code)


@contextmanager
def crashed_naming_a_dead_rank(flow_run_id: UUID, job: TrainingJob) -> Iterator[None]:
    """While inside: another rank's death in this attempt marks the run Crashed naming it, and
    ends this process. Rank 0 learns of it either way: torchrun's SIGTERM (its agent wrote the
    account first), or, often first, a failed collective; then it waits PEER_DEATH_NOTICE_S for
    the account (or the SIGTERM) before the exception goes on as rank 0's own failure. Any other
    SIGTERM goes to the handler before."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread
        return
    outer = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: object) -> None:
        _crash_if_a_peer_died(flow_run_id, job, 128 + signum)
        if callable(outer):
            outer(signum, frame)
        else:
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except Exception:
        deadline = time.monotonic() + PEER_DEATH_NOTICE_S
        while time.monotonic() < deadline:  # (the handler stays installed meanwhile)
            _crash_if_a_peer_died(flow_run_id, job, 1)
            time.sleep(0.05)
        raise
    finally:
        signal.signal(signal.SIGTERM, outer)


def noting_a_restart(notify: Notify, job: TrainingJob, log: Callable[[str], None]) -> Notify:
    """``notify``, and once a restarted attempt has started, the log line "rank N died,
    restarting from step S" (S: the step of the checkpoint it resumed from, 0 for none)."""
    death = _death_in(_attempt() - 1, job) if _attempt() > 0 else None

    def notify_and_note(what: str, details: dict) -> None:
        if what == "started" and death is not None:
            log(f"rank {death[0]} died, restarting from step {details['step'] - 1}")
        notify(what, details)

    return notify_and_note
