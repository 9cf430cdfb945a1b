"""The fast tier (`scripts/test --fast`): tests here start no process, server, rank, agent,
cluster or browser. A guard holds them to it: a test that starts a process, or asks for a
fixture of the embedded stack, fails naming the tier and where such a test belongs."""

from __future__ import annotations

import _posixsubprocess
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

# The session fixtures of tests/conftest.py that start a server (or need one that does).
STACK_FIXTURES = {"stack", "s3", "dataset", "prefect_api", "worker_pool", "slurm"}
WHERE = (
    "tests/ranks (local processes: ranks, agents, the CLI as a process), tests/stack (servers) or tests/clusters (SSH, Slurm, Kubernetes)"
)
# Every way a Python process starts another: subprocess (its fork_exec, or posix_spawn), multiprocessing
# and torch.multiprocessing (fork, or fork_exec for spawn and forkserver), os.system and friends.
SPAWNS = [
    (os, "fork"),
    (os, "forkpty"),
    (os, "posix_spawn"),
    (os, "posix_spawnp"),
    (os, "system"),
    (subprocess, "_fork_exec"),
    (_posixsubprocess, "fork_exec"),
]


class StartsAProcess(RuntimeError):
    """A fast-tier test started a process."""


@contextmanager
def no_processes(test: str) -> Iterator[None]:
    def refuse(how: str):
        def refused(*_args, **_kwargs):
            raise StartsAProcess(
                f"{test} is in the fast tier (tests/unit), which starts no process, but it started one ({how}): move it to {WHERE}"
            )

        return refused

    saved = [(module, name, getattr(module, name)) for module, name in SPAWNS if hasattr(module, name)]
    for module, name, _ in saved:
        setattr(module, name, refuse(f"{module.__name__}.{name}"))
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    if wanted := sorted(STACK_FIXTURES & set(getattr(item, "fixturenames", ()))):
        pytest.fail(
            f"{item.nodeid} is in the fast tier (tests/unit), starting no server, asks for {', '.join(wanted)}: move it to {WHERE}",
            pytrace=False,
        )
    with no_processes(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with no_processes(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    with no_processes(item.nodeid):
        return (yield)
