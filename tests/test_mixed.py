"""One job across GPU types (issue 31), on live ranks: a plan that splits the work unevenly, as
it would between a fast and a slow GPU type, trains the same model as the even plan of the same
GPUs on the same global batch. On CPU the two "types" are two local nodes; what differs is how
much of the work each takes: a pipeline stage's layers (``stage_layers``), or a data-parallel
replica's micro-batches (``replica_micro_batches``, each replica's mean loss weighed by its share
of the batch so that the update averages every sample once)."""

from __future__ import annotations

import json

import pytest

from frenzy_prefect.profiling.dataset import profile_dataset
from frenzy_prefect.spec.plan import ParallelPlan, Placement
from frenzy_prefect.storage import open_uri
from frenzy_prefect.training.manifest import latest

from .conftest import BUCKET
from .test_training import NANO, launch, make_job

pytestmark = pytest.mark.mixed

FAST, SLOW = Placement(node="fast", host="127.0.0.1", gpus=[0]), Placement(node="slow", host="127.0.0.1", gpus=[0])


def losses_of(dataset: str, name: str, plan: ParallelPlan, placements: list[Placement]) -> list[float]:
    job = make_job(profile_dataset(dataset, 64, NANO.vocab_size), f"s3://{BUCKET}/runs/mixed-{name}", plan, placements, steps=20)
    assert launch(job)[0] == 0, plan.label()
    with open_uri(job.metrics_uri, "r") as f:
        losses = json.load(f)["losses"]
    assert latest(job.checkpoint_uri)[1].plan == plan  # the manifest names the uneven plan it was written by
    return losses


@pytest.mark.parametrize(
    ("uneven", "even", "placements"),
    [
        (ParallelPlan(dp=2, micro_batch=2, replica_micro_batches=(6, 2)), ParallelPlan(dp=2, micro_batch=2), [FAST, SLOW]),
        (ParallelPlan(pp=2, micro_batch=2, stage_layers=(3, 1)), ParallelPlan(pp=2, micro_batch=2), [FAST, SLOW]),
    ],
    ids=["replicas 6:2", "stages 3:1"],
)
def test_an_uneven_plan_over_two_nodes_trains_the_even_plans_model_step_for_step(dataset, uneven, even, placements):
    assert losses_of(dataset, f"{uneven.label()}", uneven, placements) == pytest.approx(
        losses_of(dataset, f"{even.label()}", even, placements), rel=1e-5
    )
