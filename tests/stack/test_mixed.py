"""One job across GPU types (issue 31), on live ranks: a plan that splits the work unevenly, as
it would between a fast and a slow GPU type, trains the same model as the even plan of the same
GPUs on the same global batch. On CPU the two "types" are two local nodes; what differs is how
much of the work each takes: a pipeline stage's layers (``stage_layers``), or a data-parallel
replica's micro-batches (``replica_micro_batches``, each replica's mean loss weighed by its share
of the batch so that the update averages every sample once)."""

from __future__ import annotations

import json
import time

import pytest

from frenzy_prefect.profiling.dataset import profile_dataset
from frenzy_prefect.spec.plan import ParallelPlan, Placement
from frenzy_prefect.storage import open_uri
from frenzy_prefect.training.manifest import latest
from tests.support.stack import BUCKET
from tests.support.training import NANO, launch, make_job

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


# Two GPU types small enough that gpt-nano (fp32, global batch 32 x 64 tokens) fits neither
# type's one GPU under any plan (the smallest single-GPU peak is 16.4 MiB) but fits a pipeline
# across them (3 layers on FAST, 1 on SLOW: 13.9 and 6.6 MiB); no runtime around the tensors and
# no margin, so that the fit is the tensors' alone.
TWO_TYPES = {
    "name": "tiny-two-types",
    "gpu_types": {
        name: {"name": name, "memory_bytes": 14 * 2**20, "half_tflops": tf, "fp32_tflops": tf, "link_gbps": 10, "runtime_overhead_bytes": 0}
        for name, tf in (("FAST", 30), ("SLOW", 10))
    },
    "memory_margin": {"fraction": 0, "floor_bytes": 0},
    "nodes": [
        {"name": "fast-node", "host": "127.0.0.1", "gpu_type": "FAST", "gpu_count": 1},
        {"name": "slow-node", "host": "127.0.0.1", "gpu_type": "SLOW", "gpu_count": 1},
    ],
}


def test_a_request_no_single_type_holds_is_allocated_across_types_and_trained_through_the_pool(stack, worker_pool, dataset, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.deployments import run_deployment

    from frenzy_prefect.flows.training import default_output
    from frenzy_prefect.spec.result import TrainingReport
    from tests.support.runs import GOOD, wait_final

    path = tmp_path / "tiny-two-types.json"
    path.write_text(json.dumps(TWO_TYPES))
    stack.run_cli("frenzy_prefect.cli", "cluster", "save", str(path))
    with stack.client_settings():
        request = GOOD | {"dataset": dataset}
        run_id = run_deployment("train-llm/frenzy", parameters={"request": request, "cluster": "tiny-two-types"}, timeout=0).id
        run = wait_final(run_id)
        with get_client(sync_client=True) as client:
            for _ in range(30):  # the flow's last lines reach the server a moment after its final state
                logs = [log.message for log in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))]
                if any(m.startswith("Not recorded in ") for m in logs):
                    break
                time.sleep(1)
    assert run.state.is_completed(), run.state.message
    with open_uri(f"{default_output(dataset, run.name)}/report.json", "r") as f:
        report = TrainingReport.model_validate_json(f.read())
    a = report.allocation
    assert a.gpu_type == "FAST+SLOW" and a.plan.stage_types == ("FAST", "SLOW") and a.plan.stage_layers == (3, 1)
    assert [p.node for p in a.placements] == ["fast-node", "slow-node"]  # rank order: the first stage on the faster type
    assert a.fits and [w.gpu_type for w in a.workers] == ["FAST", "SLOW"]
    assert report.result.world_size == 2 and report.loss_end < report.loss_start - 1.0
    assert any(m.startswith("Across GPU types: ") and "no GPU type in cluster 'tiny-two-types'" in m for m in logs), logs
    assert any(m.startswith("Not recorded in ") and "across GPU types" in m for m in logs)
