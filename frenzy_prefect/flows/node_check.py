"""The `node-check` flow: rank 0 of one node's smoke check (`frenzy cluster check`), and the job
that pins the check to its node.

A check is a training job in all but its work: the `frenzy` worker queues it, takes the node's
GPUs, starts a torchrun agent through the pool's launcher (local, ssh, slurm or kubernetes) and
releases the GPUs, as for any run. Its ranks look at their GPUs and run one all-reduce instead of
training (training/node_check.py); rank 0, this flow run, reports every rank's account as the
`node-check` artifact and the node's verdict as its final state's message."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.context import FlowRunContext
from prefect.logging import get_run_logger
from prefect.states import Completed, Failed, State

from frenzy_prefect.allocator.step_time import predict_step
from frenzy_prefect.flows.cancellation import sigterm_cancels_when_cancelling
from frenzy_prefect.flows.rank_deaths import crashed_naming_a_dead_rank
from frenzy_prefect.memory import estimate
from frenzy_prefect.profiling.model import PRESETS
from frenzy_prefect.spec.cluster import ClusterSpec, Node
from frenzy_prefect.spec.dataset import DatasetInfo
from frenzy_prefect.spec.plan import Allocation, ParallelPlan, Placement, TrainingJob
from frenzy_prefect.spec.request import TrainingRequest

ARTIFACT_KEY = "node-check"  # every rank's account (training.node_check.RankCheck), one row each
CHECK_MODEL = "gpt-nano"  # what the job names (its ranks build no model): the smallest preset


def check_job(cluster: ClusterSpec, node: Node) -> TrainingJob:
    """The check of ``node``: one rank per GPU of it, pinned to it (the pool's queue places it
    there and nowhere else), fp32 (every GPU type runs it), one step of the smallest preset
    predicted, nothing read or written."""
    model, gpu = PRESETS[CHECK_MODEL], cluster.gpu_of(node)
    request = TrainingRequest(model=CHECK_MODEL, dataset="-", global_batch=node.gpu_count, seq_len=64, steps=1, precision="fp32")
    plan = ParallelPlan(dp=node.gpu_count)
    allocation = Allocation(
        gpu_type=node.gpu_type,
        plan=plan,
        memory=estimate(model, plan, request.workload, gpu=gpu),
        gpu_memory_bytes=gpu.memory_bytes,
        margin_bytes=cluster.memory_margin.bytes_for(gpu.memory_bytes),
        step_time_s=predict_step(model, plan, request.workload, gpu=gpu).seconds,
        placements=[Placement(node=node.name, host=node.host, gpus=list(range(node.gpu_count)))],
    )
    return TrainingJob(
        request=request,
        model=model,
        dataset=DatasetInfo(uri="-", format="bytes", tokens=1, size_bytes=1),  # (read by no rank)
        allocation=allocation,
        cluster=cluster,
        output="-",
        run=f"node-check-{node.name}",
        purpose="check",
        pinned=True,
    )


@flow(name="node-check")
def node_check(job: TrainingJob, allow_cpu: bool = False) -> State:
    """Rank 0 of the smoke check of the node ``job`` is pinned to (`frenzy cluster check`): every
    rank's host, CUDA devices and free memory, a GiB written on each GPU, a timed all-reduce;
    Completed or Failed with the verdict in a line. ``allow_cpu``: ranks that see no CUDA device
    pass (a cluster of emulated GPUs, as blocks/local-hetero.yaml)."""
    # (imported here: torch is the ranks', not every process's that loads the flows)
    from frenzy_prefect.training.distributed import DistributedContext
    from frenzy_prefect.training.node_check import check_ranks, verdict

    run_id, node = FlowRunContext.get().flow_run.id, job.allocation.placements[0].node
    with sigterm_cancels_when_cancelling(run_id), crashed_naming_a_dead_rank(run_id, job):
        ranks, reduced = check_ranks(job, DistributedContext.from_env())
    passed, message = verdict(job, ranks, reduced, allow_cpu)
    create_table_artifact(
        key=ARTIFACT_KEY, table=[r.model_dump(mode="json") for r in ranks], description=f"Node {node}: {'passed' if passed else 'FAILED'}"
    )
    get_run_logger().info(f"node {node} {'passed' if passed else 'failed'} its check: {message}")
    return Completed(message=message) if passed else Failed(message=message)
