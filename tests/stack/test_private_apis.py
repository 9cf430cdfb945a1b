"""The private torch and Prefect APIs the project uses (frenzy_prefect/torch_private.py and
prefect_private.py), each checked for the signature and behaviour relied on: after an upgrade that
changes one, its test fails naming the API and the range pyproject.toml vouches for. And the ranges
themselves: every lower bound is the version constraints.txt pins (the one CI runs), and the
packages whose private APIs are used stop before their next untested minor release."""

from __future__ import annotations

import subprocess
import sys

from tests.support.private_apis import relying_on

DOOMED_FLOW = """
import os, signal, sys, time
from prefect import flow
from frenzy_prefect.prefect_private import record_cancel_intent

@flow(name="sigterm-{name}")
def doomed():
    if {cancel}:
        record_cancel_intent()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)

doomed()
"""


def _state_after_sigterm(stack, cancel: bool) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    name = "cancel" if cancel else "crash"
    subprocess.run([sys.executable, "-c", DOOMED_FLOW.format(name=name, cancel=cancel)], env=stack.env, capture_output=True, timeout=120)
    with stack.client_settings(), get_client(sync_client=True) as client:
        (run,) = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[f"sigterm-{name}"])), limit=1)
    return run.state.type.value


def test_the_control_listeners_cancel_intent_turns_a_sigterm_into_cancelled(stack, prefect_api):
    """What flows/cancellation.py relies on: with the intent recorded, the flow engine reports a
    SIGTERM as Cancelled; without it, as Crashed."""
    with relying_on("prefect._internal.control_listener._set_intent('cancel'), read by the flow engine", "prefect"):
        assert _state_after_sigterm(stack, cancel=True) == "CANCELLED"
        assert _state_after_sigterm(stack, cancel=False) == "CRASHED"


def test_the_clients_http_session_reads_the_servers_settings(stack, prefect_api):
    import asyncio

    from prefect.client.orchestration import get_client

    async def settings() -> dict:
        from frenzy_prefect.prefect_private import server_settings

        async with get_client() as client:
            response = await server_settings(client)
            response.raise_for_status()
            return response.json()

    with relying_on("prefect.client.orchestration.PrefectClient._client.get('/admin/settings')", "prefect"):
        with stack.client_settings():
            found = asyncio.run(settings())
        assert isinstance(found["server"]["concurrency"]["lease_storage"], str)
