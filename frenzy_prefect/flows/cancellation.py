"""A flow run that its worker cancels (a training run's rank 0, a train-llm run) reports itself
Cancelled, not Crashed.

The worker stops a cancelled run's ranks with SIGTERM (through torchrun), a train-llm run's process likewise. Prefect's flow engine
turns a SIGTERM into Crashed unless its runner told it beforehand, over a loopback channel the
`frenzy` worker does not have, that the signal means cancellation. So rank 0 asks the server:
if its run is being cancelled when the signal arrives, it records the same intent the runner
would have sent (Prefect 3.9's control listener: ``prefect_private``), and the engine reports Cancelling, then
Cancelled. Any other SIGTERM still reads as a crash; with the server away, rank 0 leaves at once
(brief_reports)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from uuid import UUID

from prefect.client.schemas.objects import StateType

from frenzy_prefect.flows.brief_reports import brief_client, leave_now, server_is_away
from frenzy_prefect.prefect_private import record_cancel_intent


def being_cancelled(flow_run_id: UUID) -> bool:
    """Whether the run is being cancelled (False when the server cannot say: a crash is the honest report)."""
    return cancel_state(flow_run_id) is True


def cancel_state(flow_run_id: UUID) -> bool | None:
    """Whether the run is being cancelled, asked briefly (brief_reports); None when the server
    does not answer, False when it answers with an error."""
    try:
        with brief_client() as client:
            state = client.read_flow_run(flow_run_id).state
    except Exception as exc:
        return None if server_is_away(exc) else False
    return state is not None and state.type in (StateType.CANCELLING, StateType.CANCELLED)


@contextmanager
def sigterm_cancels_when_cancelling(flow_run_id: UUID) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread
        return
    engine_handler = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: object) -> None:
        cancelling = cancel_state(flow_run_id)
        if cancelling is None:
            leave_now(128 + signum)  # no report of the engine's could get through either
        if cancelling:
            record_cancel_intent()
        if callable(engine_handler):
            engine_handler(signum, frame)
        else:
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, engine_handler)
