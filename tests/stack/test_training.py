"""Real training: torch.distributed over gloo in separate processes, data and checkpoints in S3."""

import json

import pytest

from frenzy_prefect.launch.local import is_running
from frenzy_prefect.profiling.dataset import profile_dataset
from frenzy_prefect.spec.plan import ParallelPlan, Placement
from frenzy_prefect.storage import exists, open_uri
from frenzy_prefect.training.checkpoint import load
from frenzy_prefect.training.distributed import DistributedContext
from frenzy_prefect.training.engine import Engine
from frenzy_prefect.training.manifest import latest, step_uri
from frenzy_prefect.training.trainer import train
from tests.support.stack import BUCKET
from tests.support.training import NANO, launch, make_job, unchecked


def test_two_ranks_on_two_nodes_train_and_checkpoint_to_s3(dataset):
    output = f"s3://{BUCKET}/runs/two-ranks"
    plan = ParallelPlan(dp=2, micro_batch=4)  # 2 accumulation steps per optimizer step
    placements = [Placement(node="n0", host="127.0.0.1", gpus=[0]), Placement(node="n1", host="127.0.0.1", gpus=[0])]
    job = make_job(profile_dataset(dataset, 64, NANO.vocab_size), output, plan, placements)
    code, _ = launch(job)
    assert code == 0

    with open_uri(job.metrics_uri, "r") as f:
        metrics = json.load(f)
    losses = metrics["losses"]
    assert len(losses) == 40 and metrics["world_size"] == 2 and metrics["backend"] == "gloo"
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses

    assert metrics["checkpoint"] == step_uri(job.checkpoint_uri, 40)
    uri, manifest = latest(job.checkpoint_uri)
    assert uri == metrics["checkpoint"] and manifest.step == 40 and manifest.model.name == "gpt-nano" and manifest.losses == losses
    engine = Engine(NANO, ParallelPlan(micro_batch=8), job.request.workload)
    load(engine, uri, manifest)  # strict: every tensor and optimizer state present, right shapes
    assert len(engine.optimizer.state) == len(list(engine.model.parameters()))


def test_a_failing_rank_stops_the_whole_job_and_writes_nothing(s3):
    output = f"s3://{BUCKET}/runs/failing"
    job = make_job(
        unchecked(f"s3://{BUCKET}/data/absent.txt"),
        output,
        ParallelPlan(dp=2, micro_batch=8),
        [Placement(node="n0", host="127.0.0.1", gpus=[0, 1])],
    )
    code, pids = launch(job)
    assert code != 0
    assert not any(is_running(p) for p in pids)
    assert not exists(job.metrics_uri) and not exists(job.checkpoint_uri)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_lone_rank_trains_with_full_recomputation(dataset, precision):
    output = f"s3://{BUCKET}/runs/lone-{precision}"
    job = make_job(
        profile_dataset(dataset, 64, NANO.vocab_size),
        output,
        ParallelPlan(micro_batch=8, recompute="full"),
        [Placement(node="n0", host="127.0.0.1", gpus=[0])],
        steps=15,
        precision=precision,
    )
    lines = []
    result = train(job, DistributedContext(), log=lines.append)
    assert result.losses[-1] < result.losses[0] - 0.5
    final = step_uri(job.checkpoint_uri, 15)
    assert lines[0].startswith("step 1/15 loss") and lines[-1].startswith(f"checkpoint of step 15 written to {final}")
    assert exists(f"{final}/manifest.json")
