"""The `frenzy` worker type: registered through the entry point, typed job template, launches;
a rank that dies is named with its node, PID and signal."""

import asyncio
import os
import signal
import sys

import pytest

from frenzy_prefect.launch.local import ProcessGroup, is_running, start_local
from frenzy_prefect.launch.torchrun import rank_launches
from frenzy_prefect.profiling.dataset import profile_dataset
from frenzy_prefect.spec.plan import ParallelPlan, Placement
from tests.support.ranks import rank_pid
from tests.support.stack import BUCKET
from tests.support.training import NANO, make_job


@pytest.mark.faults
def test_a_rank_killed_with_sigkill_is_named_with_its_node_and_signal(dataset):
    """A real two-rank job (one torchrun agent, gloo); rank 1 is killed with -9 mid-training. The
    group's one-line failure names the rank, its node, its PID and the signal (torchrun's own
    account of which rank died, through the failure file), and every process is gone."""
    job = make_job(
        profile_dataset(dataset, 64, NANO.vocab_size),
        f"s3://{BUCKET}/runs/rank-killed",
        ParallelPlan(dp=2, micro_batch=4),
        [Placement(node="n0", host="127.0.0.1", gpus=[0, 1])],
        steps=100_000,
    )

    async def scenario() -> tuple[int, int, ProcessGroup]:
        group = await start_local(rank_launches(job, python=sys.executable, env=dict(os.environ)))
        victim = await asyncio.to_thread(rank_pid, group.pids[0], 1)
        os.kill(victim, signal.SIGKILL)
        return await group.wait(), victim, group

    code, victim, group = asyncio.run(scenario())
    assert code != 0 and not any(is_running(p) for p in group.pids)
    assert group.failure == f"rank 1 on n0 (pid {victim}) was killed by SIGKILL" and group.failed_rank == 1
