"""Real training: torch.distributed over gloo in separate processes, data and checkpoints in S3."""

import json
import multiprocessing
import os
import sys

import pytest
import torch
import torch.distributed as dist

from frenzy_prefect.errors import StorageUnreachable
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.training.distributed import DistributedContext, PeerFailed, free_port, together
from frenzy_prefect.training.tensor_parallel import TensorParallel
from tests.support.training import _reference_losses, _replica0_losses

STALLED = "the object store holding s3://b/x.bin (endpoint http://127.0.0.1:9) did not answer within 47 s: ReadTimeoutError"


def _together_rank(rank: int, port: int, outcomes) -> None:
    """One of two gloo ranks: a round where all succeed, one where rank 1 fails, one where rank 0 does."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = DistributedContext(rank=rank, world_size=2)
    ctx.init_process_group()

    def failing_on(bad: int):
        def action() -> int:
            if rank == bad:
                raise StorageUnreachable(STALLED)
            return rank

        return action

    try:
        outcomes.put((rank, "ok", together(ctx, lambda: rank)))
        for bad in (1, 0):
            try:
                together(ctx, failing_on(bad))
            except (StorageUnreachable, PeerFailed) as exc:
                outcomes.put((rank, type(exc).__name__, str(exc)))
    finally:
        dist.destroy_process_group()


def test_a_rank_that_cannot_reach_storage_has_rank_0_report_why_and_the_others_stop_quietly():
    """torchrun stops every rank once one exits non-zero, so rank 0 must raise the cause (its run's
    state) and the others PeerFailed (they exit 0), whichever rank failed."""
    spawn = multiprocessing.get_context("spawn")
    outcomes, port = spawn.Queue(), free_port()
    ranks = [spawn.Process(target=_together_rank, args=(r, port, outcomes)) for r in (0, 1)]
    for p in ranks:
        p.start()
    # Read before joining: a process that put items on a queue exits only once they are flushed
    # to its pipe (multiprocessing's "joining processes that use queues").
    got = {outcomes.get(timeout=300) for _ in range(6)}
    for p in ranks:
        p.join(timeout=120)
    assert [p.exitcode for p in ranks] == [0, 0]
    assert got == {
        (0, "ok", 0),
        (1, "ok", 1),
        (0, "StorageUnreachable", f"on rank 1, {STALLED}"),  # rank 1's, with the rank named
        (1, "PeerFailed", "rank 1 stops: rank 0 reports the failure of rank(s) [1]"),
        (0, "StorageUnreachable", STALLED),  # its own
        (1, "PeerFailed", "rank 1 stops: rank 0 reports the failure of rank(s) [0]"),
    }


@pytest.mark.parametrize(
    "plan",
    [
        ParallelPlan(dp=2, micro_batch=2, zero=1),
        pytest.param(ParallelPlan(dp=2, pp=2, micro_batch=2, zero=1), marks=pytest.mark.pipeline),
        ParallelPlan(dp=2, tp=2, micro_batch=2, zero=2),
        ParallelPlan(dp=2, micro_batch=2, zero=3),
    ],
    ids=lambda p: p.label(),
)
def test_sharded_plans_train_the_same_model_as_plain_data_parallelism(plan):
    # The replicas see different micro-batches, so the second and third steps' losses agree only
    # if the gradients were averaged over replicas and every shard updated as DDP updates the
    # whole: ZeroRedundancyOptimizer's shards, DeepSpeed's partitions (over the dp group its
    # model-parallel unit names, beside tp) and FSDP2's gathered blocks change where tensors live,
    # never the arithmetic.
    expected = _reference_losses(ParallelPlan(dp=2, micro_batch=plan.micro_batch))
    assert _replica0_losses(plan) == pytest.approx(expected, abs=1e-5)


@pytest.mark.pipeline
@pytest.mark.parametrize(
    "plan", [ParallelPlan(pp=2, micro_batch=2, stage_layers=(3, 1)), ParallelPlan(pp=3, micro_batch=2, stage_layers=(1, 1, 2))], ids=str
)
def test_an_uneven_split_of_the_layers_over_the_stages_trains_the_same_model(plan):
    # The stages hold 3 and 1 (or 1, 1 and 2) of gpt-nano's 4 layers, the head on a stage of its
    # own size: the same whole model, drawn once and sliced, trains as on one rank.
    expected = _reference_losses(ParallelPlan(micro_batch=plan.micro_batch))
    assert _replica0_losses(plan) == pytest.approx(expected, abs=1e-5)


MASTER = {"precision": "bf16", "master_weights": True}


@pytest.mark.parametrize(
    ("plan", "tolerance"),
    [(ParallelPlan(dp=2, micro_batch=2, zero=1), 1e-5), (ParallelPlan(dp=2, micro_batch=2, zero=3), 2e-2)],
    ids=lambda p: p.label() if isinstance(p, ParallelPlan) else "",
)
def test_sharded_plans_with_master_weights_train_as_data_parallel_master_weights(plan, tolerance):
    """ZeRO-1 keeps and steps each replica's share of the fp32 masters; the owners broadcast the new
    bf16 weights, or the other replicas' next losses differ. FSDP2's mixed
    precision reduce-scatters each micro-batch's bf16 gradients in fp32 (the same sums, another
    order: bf16's tolerance)."""
    expected = _reference_losses(ParallelPlan(dp=2, micro_batch=2), **MASTER)
    assert _replica0_losses(plan, **MASTER) == pytest.approx(expected, abs=tolerance)


def _vocab_parallel_rank(rank: int, port: int, out) -> None:
    """One of two tensor-parallel ranks: its vocabulary slice of the logits, the loss over the
    slices, and the gradient of its slice; the embedding of its rows, summed over the ranks."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    tp = TensorParallel(rank=rank, size=2, group=dist.new_group([0, 1]))
    generator = torch.Generator().manual_seed(0)
    logits = 5 * torch.randn(24, 10, generator=generator)  # the whole vocabulary, alike on both ranks
    targets = torch.randint(0, 10, (24,), generator=generator)
    table = torch.randn(10, 6, generator=generator)
    ids = torch.randint(0, 10, (3, 8), generator=generator)
    part = logits[:, tp.split(10)].clone().requires_grad_()
    loss = tp.cross_entropy(part, targets)
    loss.backward()
    rows = table[tp.split(10)].clone().requires_grad_()
    embedded = tp.embed(ids, rows)
    embedded.pow(2).sum().backward()
    # numpy: pickled whole, not shared through a file descriptor that dies with this process
    out.put((rank, loss.item(), part.grad.numpy(), embedded.detach().numpy(), rows.grad.numpy()))
    dist.destroy_process_group()


def test_the_vocab_parallel_loss_and_embedding_compute_what_the_whole_vocabulary_does():
    """Two gloo ranks, each with half of the vocabulary: the loss, each slice's gradient and the
    embeddings equal the unsplit cross-entropy's and embedding's."""
    ctx = multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    ranks = [ctx.Process(target=_vocab_parallel_rank, args=(r, port, out)) for r in range(2)]
    for p in ranks:
        p.start()
    results = sorted(out.get(timeout=120) for _ in ranks)
    for p in ranks:
        p.join(timeout=60)
    assert [p.exitcode for p in ranks] == [0, 0]
    generator = torch.Generator().manual_seed(0)
    logits = (5 * torch.randn(24, 10, generator=generator)).requires_grad_()
    targets = torch.randint(0, 10, (24,), generator=generator)
    table = torch.randn(10, 6, generator=generator).requires_grad_()
    ids = torch.randint(0, 10, (3, 8), generator=generator)
    loss = torch.nn.functional.cross_entropy(logits, targets)
    loss.backward()
    embedded = torch.nn.functional.embedding(ids, table)
    embedded.pow(2).sum().backward()
    for rank, value, grad, out_embedded, rows_grad in results:
        assert value == pytest.approx(loss.item(), rel=1e-6)
        torch.testing.assert_close(torch.from_numpy(grad), logits.grad[:, rank * 5 : (rank + 1) * 5])
        torch.testing.assert_close(torch.from_numpy(out_embedded), embedded.detach())
        torch.testing.assert_close(torch.from_numpy(rows_grad), table.grad[rank * 5 : (rank + 1) * 5])


@pytest.mark.parametrize(
    "plan",
    [ParallelPlan(tp=2, micro_batch=2), pytest.param(ParallelPlan(tp=2, pp=2, micro_batch=2), marks=pytest.mark.pipeline)],
    ids=lambda p: p.label(),
)
def test_vocab_parallel_plans_train_the_same_model_as_one_rank(plan):
    # The embedding, head, logits and loss split over the vocabulary (the tied head a slice of the
    # embedding, on another stage with pp=2), clipped by the whole model's gradient norm: the
    # same losses as the unsplit model, step after step.
    expected = _reference_losses(ParallelPlan(micro_batch=2))
    assert _replica0_losses(plan) == pytest.approx(expected, abs=1e-5)


def _loaded_after(imports: str, watched: tuple[str, ...]) -> list[str]:
    """Which of ``watched`` a fresh interpreter has loaded after ``imports``."""
    import subprocess

    check = f"import sys, {imports}; print(sorted(m for m in {watched!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1].replace("'", '"'))


def test_a_plain_runs_ranks_start_without_dynamo_scipy_or_deepspeed():
    """What every rank of a plain run imports at each start (rank 0 the flow, the others the
    entry): torch._dynamo (which pipelining and MemTracker pull in), SciPy (ReCycle's planners) and
    DeepSpeed (ZeRO-2) only where a plan uses them, about 2 s of each process's start otherwise."""
    imports = "frenzy_prefect.training.entry, frenzy_prefect.flows.training"
    assert _loaded_after(imports, ("torch._dynamo", "scipy", "deepspeed")) == []
    # and each incarnation of a ReCycle trainer (its live plans come from the heuristic planner)
    assert _loaded_after("frenzy_prefect.training.resilient.trainer", ("torch._dynamo", "scipy")) == []


def test_the_flows_that_do_not_train_start_without_torch():
    """train-llm, prepare-dataset and watch-datasets runs load the flows' modules, not torch:
    torch and the trainer are imported by rank 0's distributed-train alone."""
    assert _loaded_after("frenzy_prefect.flows", ("torch",)) == []
