"""The private Prefect APIs the shell relies on, in one place (the core's side is
``torch_private``). Each is reached only through this module and checked by
tests/unit/test_private_apis.py for the behaviour used here, so that a Prefect upgrade that changes one
fails there by name, with the range pyproject.toml vouches for (it stops before Prefect's next
minor release for that reason).

- The control listener's intent (``prefect._internal.control_listener``): the flow engine reads
  it when a SIGTERM arrives to tell a cancellation from a crash; a runner sets it over a loopback
  channel the `frenzy` worker does not have, so rank 0 sets it itself (flows/cancellation.py).
- The client's HTTP session (``PrefectClient._client``): the server's settings route
  (``/admin/settings``), which the client has no method for, tells where leases are kept.
"""

from __future__ import annotations

import httpx
from prefect._internal import control_listener
from prefect.client.orchestration import PrefectClient


def record_cancel_intent() -> None:
    """Tell the flow engine that the SIGTERM it is about to see means cancellation (what Prefect's
    runner tells it before it sends the signal)."""
    control_listener._set_intent("cancel")


async def server_settings(client: PrefectClient) -> httpx.Response:
    """The server's ``GET /admin/settings`` (not on Prefect Cloud, which answers 404)."""
    return await client._client.get("/admin/settings")
