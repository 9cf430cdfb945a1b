"""Rank 0 of a training run that torchrun may restart (``max_restarts``) keeps its flow run Running.

Rank 0 executes the run's flow run. When a rank dies, rank 0 sees it first as a failed collective
and then as torchrun's SIGTERM (torchrun stops every rank before it restarts them); either would
end the flow run, Failed or Crashed, although torchrun is about to start the ranks again and they
would resume from the last checkpoint. So while torchrun has restarts left, rank 0 leaves
without reporting a final state: the flow run stays Running, and the restarted rank 0 executes
it again. A SIGTERM of a run being cancelled still cancels it (``cancellation``)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from uuid import UUID

from prefect.logging.handlers import APILogHandler

from frenzy_prefect.flows.cancellation import being_cancelled


def restarts_left() -> int:
    """How many more times torchrun will restart the ranks (its environment says)."""
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) - int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


@contextmanager
def failures_restart_while_torchrun_can(flow_run_id: UUID, log: Callable[[str], None]) -> Iterator[None]:
    if restarts_left() <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return
    outer = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: object) -> None:
        if being_cancelled(flow_run_id) and callable(outer):
            outer(signum, frame)
        os._exit(128 + signum)  # torchrun restarts the ranks; the run stays Running

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except Exception as exc:
        log(f"rank 0 stops for torchrun to restart the ranks ({restarts_left()} restart(s) left): {type(exc).__name__}: {exc}")
        try:
            APILogHandler().flush()  # os._exit skips the handler's own flush at exit
        finally:
            os._exit(1)
    finally:
        signal.signal(signal.SIGTERM, outer)
