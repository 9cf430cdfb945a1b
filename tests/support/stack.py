"""The embedded stack's helpers: names the tests share (the bucket, the pool, the example cluster),
processes of their own (a moto server to freeze), and what a user sets up by hand (a pool, deployments)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from frenzy_prefect.localstack import LocalStack  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


EXAMPLE_CLUSTER = ROOT / "blocks" / "local-hetero.yaml"


BUCKET = "frenzy-tests"


POOL = "frenzy"  # the pool flows/prefect.yaml deploys to (FRENZY_POOL)


POOL_CLUSTER = "local-hetero"  # the test pool's `cluster` variable: train-llm's cluster when a run names none


WORKER_LIMIT = 5  # runs a test worker holds at once (waiting ones included): a crowd of 8 spills over to a second worker


def without_real_part(part: str, why: str) -> None:
    """A test cannot have ``part`` (postgresql, chromium, sshd): it skips saying ``why``, unless
    scripts/test found or installed that part here (FRENZY_REAL_PARTS, scripts/system-packages),
    where it fails: a real part the suite vouches for never skips silently."""
    if part in os.environ.get("FRENZY_REAL_PARTS", "").split():
        pytest.fail(f"{part} should be usable here (scripts/test found or installed it), but {why}")
    pytest.skip(f"{why} (scripts/test installs it where it can: root and apt-get)")


@contextmanager
def moto_server(log: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """An S3 endpoint of the caller's own (a moto server), for tests that freeze one: the
    session's endpoint serves every other test and is never stopped. Yields (endpoint, process)."""
    from frenzy_prefect.training.distributed import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"
    with open(log, "wb") as out:
        argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", endpoint.rsplit(":", 1)[1]]
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{endpoint}/moto-api/").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, f"moto server not ready:\n{log.read_text()[-2000:]}"
            time.sleep(0.3)
        yield endpoint, proc
    finally:
        proc.send_signal(signal.SIGCONT)  # a frozen process does not act on SIGTERM
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def frozen(proc: subprocess.Popen[bytes]) -> Iterator[None]:
    """The process stopped (SIGSTOP) as a hung endpoint is: its kernel still accepts connections
    and bytes, nothing answers."""
    proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGCONT)


def sentences(n_bytes: int, seed: int = 0) -> bytes:
    """Text with structure a small model learns quickly: a few hundred words, simple sentences."""
    rng = random.Random(seed)
    subjects = ["the cluster", "a worker", "the scheduler", "each node", "the model", "every rank"]
    verbs = ["trains", "allocates", "places", "checkpoints", "measures", "predicts"]
    objects = ["the batch", "two gpus", "the memory", "a plan", "the loss", "its stage"]
    out = []
    while sum(len(s) for s in out) < n_bytes:
        out.append(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}.\n")
    return "".join(out).encode()


def create_pool(stack: LocalStack, pool: str, cluster: str, **variables: object) -> None:
    """`prefect work-pool create POOL --type frenzy --base-job-template FILE`: the worker type's
    default template, its `cluster` variable (and any of ``variables``) defaulting as given."""
    template = json.loads(stack.run_cli("prefect", "work-pool", "get-default-base-job-template", "--type", "frenzy"))
    for name, default in {"cluster": cluster, **variables}.items():
        template["variables"]["properties"][name]["default"] = default
    path = stack.home / f"{pool}-template.json"
    path.write_text(json.dumps(template))
    stack.run_cli("prefect", "work-pool", "create", pool, "--type", "frenzy", "--base-job-template", str(path))


def deploy_all(stack: LocalStack, pool: str = POOL, name: str = "frenzy") -> None:
    """`prefect deploy --all` of flows/prefect.yaml, its names from the environment."""
    stack.env.update(FRENZY_POOL=pool, FRENZY_DEPLOYMENT=name)
    stack.run_cli("prefect", "--no-prompt", "deploy", "--all", "--prefect-file", str(ROOT / "flows" / "prefect.yaml"))


def set_up_pool(stack: LocalStack, workers: tuple[str, ...] = ("frenzy-worker",), limit: int = WORKER_LIMIT) -> str:
    """What a user sets up by hand (docs/cluster.md): the example cluster block
    (`frenzy cluster save`), a `frenzy` pool on it (`frenzy cluster use`) with worker processes,
    and the deployments of flows/prefect.yaml (`prefect deploy --all`); each worker holds at
    most ``limit`` runs at once."""
    stack.run_cli("frenzy_prefect.cli", "cluster", "save", str(EXAMPLE_CLUSTER))
    stack.run_cli("frenzy_prefect.cli", "cluster", "use", POOL_CLUSTER, "--pool", POOL)
    for name in workers:
        stack.start_worker(POOL, name=name, limit=limit)
    deploy_all(stack)
    return POOL


def all_logs(client, run_id) -> list:
    """Every log record of flow run ``run_id``, oldest first: the API answers at most 200 per call
    (PREFECT_API_DEFAULT_LIMIT), and a run of many steps logs more."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    about, logs = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), []
    while page := client.read_logs(about, limit=200, offset=len(logs), sort=LogSort.TIMESTAMP_ASC):
        logs += page
    return logs
