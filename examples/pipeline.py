"""A pipeline flow that trains as one of its steps: `train_llm` called as a subflow.

The pipeline checks its dataset, calls `train_llm` (which profiles, allocates and submits the
ranks to the `frenzy` pool's `distributed-train` deployment, then waits for them), and gates on
the report it returns. It runs wherever a flow runs: here in this process, or deployed to any
pool (on the `frenzy` pool itself it may leave out ``cluster``: the pool's `cluster` variable
applies). Against a running stack (PREFECT_API_URL, the S3 environment, a `frenzy` pool with
its deployments):

    python examples/pipeline.py s3://bucket/data.txt --cluster local-hetero [--steps 30] [--max-loss 5]

It prints the gate's result as one JSON line.
"""

from __future__ import annotations

import argparse
import json

from prefect import flow, task
from prefect.logging import get_run_logger

from frenzy_prefect.flows.training import TRAINING_DEPLOYMENT, train_llm
from frenzy_prefect.spec.request import TrainingRequest
from frenzy_prefect.spec.result import TrainingReport
from frenzy_prefect.storage import exists


@task
def check_dataset(uri: str) -> str:
    """The pipeline's own step before training (a real one would prepare the data)."""
    if not exists(uri):
        raise ValueError(f"dataset {uri} is missing: upload it before training")
    return uri


@task
def gate(report: TrainingReport, max_loss: float) -> dict[str, object]:
    """Accept the model only if training brought the loss under ``max_loss``."""
    accepted = report.loss_end <= max_loss
    get_run_logger().info(f"loss {report.loss_start:.3f} -> {report.loss_end:.3f}: {'accepted' if accepted else 'rejected'}")
    return {
        "accepted": accepted,
        "loss_end": report.loss_end,
        "checkpoint": report.result.checkpoint,
        "gpus": f"{report.allocation.plan.gpus} x {report.allocation.gpu_type}",
        "training_flow_run": report.training_flow_run,
    }


@flow(name="nightly-training")
def nightly_training(
    dataset: str,
    cluster: str | None = None,
    steps: int = 30,
    max_loss: float = 5.0,
    training_deployment: str = TRAINING_DEPLOYMENT,
) -> dict[str, object]:
    request = TrainingRequest(model="gpt-nano", dataset=check_dataset(dataset), global_batch=32, seq_len=64, steps=steps, precision="fp32")
    report = train_llm(request, cluster=cluster, training_deployment=training_deployment)  # a subflow of this run
    return gate(report, max_loss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", help="s3:// (or any fsspec) URI of a text or token file")
    parser.add_argument("--cluster", default=None, help="FrenzyCluster block; default: FRENZY_CLUSTER (set on a frenzy pool)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max-loss", type=float, default=5.0)
    parser.add_argument("--training-deployment", default=TRAINING_DEPLOYMENT)
    args = parser.parse_args()
    print(json.dumps(nightly_training(args.dataset, args.cluster, args.steps, args.max_loss, args.training_deployment)))


if __name__ == "__main__":
    main()
