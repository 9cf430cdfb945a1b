"""The Prefect server a command writes to (blocks, pools, deployments) or reads from.

With PREFECT_API_URL unset, Prefect's default profile starts a temporary server for the one
command (its ephemeral mode: 10-20 s, on a SQLite file under PREFECT_HOME). What a command
saved there reaches no worker and no team's server, and it would still print success. So the
commands that talk to a server name it, and refuse, in one line, to run against that temporary
one."""

from __future__ import annotations

from frenzy_prefect.errors import FrenzyError

START_ONE = (
    "start one where the workers and nodes reach it (`prefect server start --host 0.0.0.0`) and "
    "`prefect config set PREFECT_API_URL=http://HOST:4200/api` (docs/cluster.md, step 1)"
)


def prefect_server(what: str) -> str:
    """The API URL of the Prefect server this process talks to; a FrenzyError saying how to set
    one when there is none, ``what`` naming what would have gone to a temporary server."""
    from prefect.context import get_settings_context
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    profile = get_settings_context().profile.name
    if settings.api.url:
        _check_answers(str(settings.api.url))
        return str(settings.api.url)
    if not settings.server.ephemeral.enabled:
        raise FrenzyError(f"PREFECT_API_URL is not set (profile {profile!r}): there is no Prefect server for {what}: {START_ONE}")
    database = settings.server.database.connection_url.get_secret_value() if settings.server.database.connection_url else ""
    where = database.split(":///", 1)[-1] if database.startswith("sqlite") else f"{settings.home}'s database"
    raise FrenzyError(
        f"PREFECT_API_URL is not set (profile {profile!r}), so Prefect would start a temporary server for this command alone "
        f"and {what} would land in {where}, which no worker reads: {START_ONE}"
    )


def _check_answers(url: str) -> None:
    """One health request, unretried: a server that is not there is said at once, not after the
    client's minute of retries and a traceback."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    with temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0}), get_client(sync_client=True, httpx_settings={"timeout": 10.0}) as client:
        failure = client.api_healthcheck()
    if failure is not None:
        cause = " ".join(str(failure).split()) or type(failure).__name__
        raise FrenzyError(
            f"the Prefect server at {url} (PREFECT_API_URL) does not answer ({cause}): start it there "
            "(`prefect server start --host 0.0.0.0`) or set PREFECT_API_URL to the one that runs"
        )
