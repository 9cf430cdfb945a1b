"""What rank 0 tells the Prefect server while it is being stopped: briefly, or not at all.

Torchrun stops a rank with SIGTERM and kills it with SIGKILL 30 s later (stopping every rank
after another's death, or itself signalled when its worker died). Rank 0's handlers then ask the
server whether the run is being cancelled and report the run's crash; through the flow run's own
client each call retries a refused connection five times, 2 to 32 s apart, and the engine's own
crash report after them does the same: with the server away, rank 0 outlived torchrun's 30 s and
was killed. So these calls go through a client of their own, without retries and with a short
timeout, and when the server does not answer rank 0 leaves at once: nothing it would report can
get through, and the worker names the run's end from its ranks' exit once the server is back (or,
if the worker is gone too, the worker that reclaims the run)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import httpx
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

BRIEF_TIMEOUT_S = 3.0


@contextmanager
def brief_client() -> Iterator[SyncPrefectClient]:
    """A client of its own (not the flow run's), with no retries and a BRIEF_TIMEOUT_S timeout."""
    with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 0}):
        with get_client(sync_client=True, httpx_settings={"timeout": BRIEF_TIMEOUT_S}) as client:
            yield client


def server_is_away(exc: BaseException) -> bool:
    """Whether ``exc`` says the server did not answer (refused, unreachable, timed out), rather
    than answered with an error."""
    return isinstance(exc, httpx.TransportError)


def leave_now(exit_code: int) -> NoReturn:
    """End this process at once, saying why on stderr (the node's log): the server is away."""
    who = f"rank {os.environ['RANK']}" if "RANK" in os.environ else "the flow run's process"
    said = f"{who}: the Prefect server does not answer; exit {exit_code} without a report (the worker reports the run)\n"
    os.write(2, said.encode())
    os._exit(exit_code)
