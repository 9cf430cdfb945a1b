"""The pipeline executor: fault-free schedules from one builder, executed on real gloo ranks, give
what plain data parallelism gives; B then W give a plain backward's gradients; a worker can run
another pipeline's micro-batches (ReCycle's re-routing) and the update is unchanged."""

import multiprocessing

import pytest
import torch
import torch.distributed as dist

from frenzy_prefect.pipeline.builder import BACKWARDS, assemble, one_f_one_b_order
from frenzy_prefect.pipeline.schedule import Schedule
from frenzy_prefect.pipeline.validate import validate
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.training.distributed import free_port
from tests.support.training import NANO, _reference_losses, _replica0_losses

pytestmark = pytest.mark.pipeline


@pytest.mark.parametrize(
    ("plan", "reference"),
    [
        (ParallelPlan(pp=2, micro_batch=2), ParallelPlan(micro_batch=2)),
        (ParallelPlan(dp=2, pp=2, micro_batch=2), ParallelPlan(dp=2, micro_batch=2)),
    ],
    ids=["pp2", "dp2-pp2"],
)
@pytest.mark.parametrize("backward", BACKWARDS)
def test_executed_schedules_train_as_plain_data_parallelism(plan, reference, backward):
    # Step after step: the second and third losses agree only if every stage's weight
    # gradients, summed over the micro-batches and averaged over the replicas, are dp-only's.
    assert _replica0_losses(plan, backward=backward) == pytest.approx(_reference_losses(reference), abs=1e-5)


def rerouted_schedule(microbatches: int) -> Schedule:
    """dp=2 pp=2 with stage 1 of pipeline 1 failed: pipeline 0's stage-1 worker runs both
    pipelines' micro-batches, interleaved (1F1B, B and W fused)."""
    orders = {(p, 0): one_f_one_b_order([(p, j) for j in range(microbatches)], 1) for p in range(2)} | {
        (0, 1): one_f_one_b_order([(q, j) for j in range(microbatches) for q in range(2)], 0)
    }
    return assemble(2, 2, microbatches, frozenset({(1, 1)}), orders)


def _weights_after_steps(rank: int, world: int, port: int, plan: ParallelPlan, rerouted: bool, out) -> None:
    """Three optimizer steps of ``plan``, each replica's micro-batches drawn as ``_losses_of`` draws
    them; every rank reports its weights."""
    from frenzy_prefect.spec.workload import Workload
    from frenzy_prefect.training.engine import Engine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    work = Workload(global_batch=2 * plan.dp * plan.micro_batch, seq_len=32, precision="fp32", optimizer={"lr": 3e-3})
    engine = Engine(NANO, plan, work, rank=rank)
    _, replica, _ = plan.coordinates(rank)
    schedule = rerouted_schedule(2) if rerouted else None
    data = [torch.Generator().manual_seed(7 + q) for q in range(plan.dp)]
    for _ in range(3):
        ids = [[torch.randint(0, NANO.vocab_size, (plan.micro_batch, 33), generator=g) for _ in range(2)] for g in data]
        batches = [[(x[:, :-1], x[:, 1:]) for x in own] for own in ids]
        engine.step(batches[replica], schedule=schedule, source=lambda q, j, b=batches: b[q][j])
    out.put((rank, {name: t.numpy() for name, t in engine.state_dict().items()}))  # numpy: pickled whole, not shared
    dist.destroy_process_group()


def _all_weights(plan: ParallelPlan, rerouted: bool) -> dict:
    ctx = multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    ranks = [ctx.Process(target=_weights_after_steps, args=(r, plan.gpus, port, plan, rerouted, out)) for r in range(plan.gpus)]
    for p in ranks:
        p.start()
    weights = dict(out.get(timeout=300) for _ in ranks)
    for p in ranks:
        p.join(timeout=60)
    assert [p.exitcode for p in ranks] == [0] * plan.gpus
    return weights


def test_a_worker_running_another_pipelines_micro_batches_leaves_the_update_unchanged():
    """Stage 1 of pipeline 1 runs nothing (as if failed; its rank still joins the reduction and
    steps); pipeline 0's stage-1 worker runs pipeline 1's micro-batches too, fed by ``source``, with
    transfers between pipelines. Every rank's weights after three steps are the fault-free ones."""
    validate(rerouted_schedule(2))
    plan = ParallelPlan(dp=2, pp=2, micro_batch=2)
    expected, got = _all_weights(plan, rerouted=False), _all_weights(plan, rerouted=True)
    for rank, weights in expected.items():
        for name, tensor in weights.items():
            torch.testing.assert_close(
                torch.from_numpy(got[rank][name]), torch.from_numpy(tensor), atol=1e-5, rtol=1e-5, msg=f"rank {rank} {name}"
            )
