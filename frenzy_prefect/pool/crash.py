"""A crashed training run's state says what failed (which rank, on which node, how)."""

from __future__ import annotations

import time
from uuid import UUID

import anyio
from prefect.client.orchestration import PrefectClient
from prefect.states import Crashed

SETTLE_POLL_S = 0.5


async def crash_naming_the_cause(
    client: PrefectClient, flow_run_id: UUID, message: str, *, replaces_failure: bool, settle_s: float = 0.0
) -> None:
    """Mark the flow run Crashed with ``message``, once its processes have all ended.

    Rank 0 executes the flow run itself; when another rank dies, torchrun stops rank 0 with
    SIGTERM and rank 0 reports the run Crashed, saying only that it was aborted by a termination
    signal; or, when its collective notices the dead peer first, Failed with the transport's
    error (gloo's "connection closed by peer"). The Crashed message is replaced, and so is a
    Failed one when ``replaces_failure`` (what ``message`` says came first: another rank than 0
    died first, or the worker itself stopped every rank); forced, since Prefect refuses Crashed
    over a final state. A run that completed or was cancelled is left as it is, and so is one
    that failed when rank 0 failed first: its own exception says why, and one that rank 0 already
    marked Crashed with this message (flows.rank_deaths).

    ``settle_s``: for that long the message is kept, replacing a rank's late report again, for
    launchers whose job can end before its ranks have (Slurm gives up on a failed node's
    processes, which may still report their SIGTERM afterwards)."""
    settled = time.monotonic() + settle_s
    while True:
        state = (await client.read_flow_run(flow_run_id)).state
        named = state is not None and state.is_crashed() and state.message == message
        if not named and (state is None or not state.is_final() or state.is_crashed() or (state.is_failed() and replaces_failure)):
            await client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)
        if time.monotonic() >= settled:
            return
        await anyio.sleep(SETTLE_POLL_S)
