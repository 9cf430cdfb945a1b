"""Calls to the Prefect server that outlast its transient faults.

A server restarting, a database busy ("database is locked": 503), a proxy timing out: none of
these is a reason for a run to fail. Prefect's client already retries some of them for about a
minute; what it gives up on is retried here with backoff, up to a patience the caller chooses.
Anything else (a 4xx, a bug) is raised at once: retrying cannot fix it."""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import anyio
import httpx
from prefect.exceptions import PrefectHTTPStatusError
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

T = TypeVar("T")

TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
SUBMIT_PATIENCE_S = 300.0  # a run's own bookkeeping may wait this long for the server
_BACKOFF_S = (1.0, 2.0, 4.0, 8.0)  # then every max_backoff_s, each with +-25% jitter

logger = logging.getLogger("frenzy_prefect.pool.server_calls")


def is_transient(exc: BaseException) -> bool:
    """A fault of the server or the network, not of the request."""
    if isinstance(exc, PrefectHTTPStatusError):
        return exc.response.status_code in TRANSIENT_STATUS
    return isinstance(exc, (httpx.TransportError, OSError))


async def patiently(call: Callable[[], Awaitable[T]], what: str, patience_s: float = SUBMIT_PATIENCE_S, max_backoff_s: float = 8.0) -> T:
    """``call()``, retried on transient faults with backoff for up to ``patience_s``; then the
    last fault is raised."""
    deadline = time.monotonic() + patience_s
    for attempt in itertools.count():
        try:
            return await call()
        except Exception as exc:
            delay = min(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)], max_backoff_s) * random.uniform(0.75, 1.25)
            if not is_transient(exc) or time.monotonic() + delay > deadline:
                raise
            logger.warning("%s: the Prefect server did not answer (%s); retrying in %.0f s", what, _describe(exc), delay)
            await anyio.sleep(delay)


@contextmanager
def without_client_retries() -> Iterator[None]:
    """Prefect's client backs off up to 32 s between its own retries; a caller that must reach
    the server the moment it is back (a lease renewal) retries itself, more often."""
    with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 0}):
        yield


def _describe(exc: BaseException) -> str:
    if isinstance(exc, PrefectHTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    return type(exc).__name__
