"""The pipeline executor: fault-free schedules from one builder, executed on real gloo ranks, give
what plain data parallelism gives; B then W give a plain backward's gradients; a worker can run
another pipeline's micro-batches (ReCycle's re-routing) and the update is unchanged."""

import pytest

from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.result import TrainingResult
from tests.support.training import NANO

pytestmark = pytest.mark.pipeline


def test_a_training_job_on_dp_pp_tp_reaches_the_data_parallel_jobs_losses(dataset):
    """The trainer end to end (torchrun ranks, the S3 dataset, checkpoints): each step's global
    batch is a function of (seed, step), so a dp=2 x pp=2 x tp=2 job and a dp=2 job see the same
    data, and their losses agree to fp32 summation order."""
    from frenzy_prefect.profiling.dataset import profile_dataset
    from frenzy_prefect.spec.plan import Placement
    from frenzy_prefect.storage import open_uri
    from tests.support.stack import BUCKET
    from tests.support.training import launch, make_job

    info = profile_dataset(dataset, 64, NANO.vocab_size)
    losses = []
    for plan in (ParallelPlan(dp=2, micro_batch=4), ParallelPlan(dp=2, pp=2, tp=2, micro_batch=4)):
        one_node = [Placement(node="n0", host="127.0.0.1", gpus=list(range(plan.gpus)))]
        job = make_job(info, f"s3://{BUCKET}/runs/trainer-{plan.gpus}", plan, one_node, steps=3)
        assert launch(job)[0] == 0, plan.label()
        with open_uri(job.metrics_uri, "r") as f:
            losses.append(TrainingResult.model_validate_json(f.read()).losses)
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
