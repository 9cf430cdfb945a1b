"""Shared fixtures: one embedded stack per session (moto S3 server, Prefect server on SQLite,
a `frenzy` worker), each started only when a test needs it and stopped by PID at the end. Their
helpers are in tests/support/stack.py."""

from __future__ import annotations

import os

# Tests run against their own services, never endpoints the developer's shell points at.
for _var in ("AWS_ENDPOINT_URL", "PREFECT_API_URL", "AWS_PROFILE"):
    os.environ.pop(_var, None)
# The test servers log each request they answer 503 (SQLite's "database is locked"), which the
# clients retry: the crowd tests count them, and a failure's cause is in the server's log.
os.environ["PREFECT_SERVER_LOG_RETRYABLE_ERRORS"] = "true"

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

from frenzy_prefect.localstack import LocalStack  # noqa: E402
from tests.support.stack import BUCKET, sentences, set_up_pool, without_real_part  # noqa: E402


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with LocalStack(tmp_path_factory.mktemp("stack")) as s:
        yield s


@pytest.fixture(scope="session")
def s3(stack: LocalStack) -> str:
    """The moto S3 endpoint, with a bucket for the tests."""
    endpoint = stack.start_s3()
    from frenzy_prefect.storage import filesystem

    fs, _ = filesystem(f"s3://{BUCKET}")
    fs.mkdir(BUCKET)
    return endpoint


@pytest.fixture(scope="session")
def dataset(s3: str) -> str:
    from frenzy_prefect.storage import filesystem

    uri = f"s3://{BUCKET}/data/sentences.txt"
    fs, path = filesystem(uri)
    fs.pipe_file(path, sentences(64_000))
    return uri


@pytest.fixture(scope="session")
def prefect_api(stack: LocalStack) -> str:
    return stack.start_prefect()


@pytest.fixture(scope="session")
def worker_pool(stack: LocalStack, s3: str, prefect_api: str) -> str:
    """The session stack's pool, with one worker."""
    return set_up_pool(stack)


@pytest.fixture(scope="session")
def slurm():
    """A real Slurm cluster (tests/support/slurm_cluster.py: nodes n1, n2 with two a10 GPUs each, n3, n4
    with two h100, device cgroups), stopped by PID at the session's end; the test skips, saying
    why, where it cannot run (fails where scripts/test vouches for Slurm: without_real_part)."""
    from tests.support.slurm_cluster import missing, slurm_cluster

    if why := missing():
        without_real_part("slurm", why)
    with slurm_cluster() as cluster:
        yield cluster
