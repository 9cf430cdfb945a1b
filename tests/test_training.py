"""Real training: torch.distributed over gloo in separate processes, data and checkpoints in S3."""

import asyncio
import json
import math
import multiprocessing
import os
import sys

import pytest
import torch
import torch.distributed as dist

from frenzy_prefect.errors import FrenzyError, StorageUnreachable
from frenzy_prefect.launch.local import is_running, start_local
from frenzy_prefect.launch.torchrun import rank_launches
from frenzy_prefect.memory import estimate
from frenzy_prefect.profiling.dataset import profile_dataset
from frenzy_prefect.profiling.model import PRESETS
from frenzy_prefect.spec.cluster import ClusterSpec
from frenzy_prefect.spec.dataset import DatasetInfo
from frenzy_prefect.spec.layout import check_engine_plan
from frenzy_prefect.spec.plan import Allocation, ParallelPlan, Placement, TrainingJob
from frenzy_prefect.spec.request import TrainingRequest
from frenzy_prefect.spec.workload import Workload
from frenzy_prefect.storage import exists, open_uri
from frenzy_prefect.training.checkpoint import load
from frenzy_prefect.training.decoder import Decoder, shard_state
from frenzy_prefect.training.distributed import DistributedContext, PeerFailed, free_port, together
from frenzy_prefect.training.engine import Engine
from frenzy_prefect.training.layers import positions
from frenzy_prefect.training.manifest import latest, step_uri
from frenzy_prefect.training.tensor_parallel import TensorParallel
from frenzy_prefect.training.trainer import train

from .conftest import BUCKET

NANO = PRESETS["gpt-nano"]


def unchecked(uri: str, tokens: int = 10_000) -> DatasetInfo:
    """A dataset as profiling would have described it, without looking (it may have gone since)."""
    return DatasetInfo(uri=uri, format="bytes", tokens=tokens, size_bytes=tokens)


def make_job(dataset: DatasetInfo, output: str, plan: ParallelPlan, placements: list[Placement], **request: object) -> TrainingJob:
    req = TrainingRequest(
        **(
            {
                "model": "gpt-nano",
                "dataset": dataset.uri,
                "global_batch": 16,
                "seq_len": 64,
                "steps": 40,
                "precision": "fp32",
                "output": output,
                "log_every": 10,
            }
            | request
        )
    )
    memory = estimate(NANO, plan, req.workload)
    allocation = Allocation(gpu_type="A10", plan=plan, memory=memory, gpu_memory_bytes=24 * 2**30, step_time_s=1.0, placements=placements)
    nodes = [{"name": p.node, "host": p.host, "gpu_type": "A10", "gpu_count": max(p.gpus) + 1} for p in placements]
    return TrainingJob(request=req, model=NANO, dataset=dataset, allocation=allocation, cluster=ClusterSpec(nodes=nodes), output=output)


def launch(job: TrainingJob) -> tuple[int, list[int]]:
    async def run():
        group = await start_local(rank_launches(job, python=sys.executable, env=dict(os.environ)))
        return await group.wait(), group.pids

    return asyncio.run(run())


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


def _losses_of(rank: int, world: int, port: int, plan: ParallelPlan, out, knobs: dict) -> None:
    """One rank of ``plan``: three optimizer steps, each replica on its own micro-batches;
    ``knobs``: the workload's settings (precision, master_weights) over fp32, and the engine's (backward)."""
    from frenzy_prefect.spec.workload import Workload
    from frenzy_prefect.training.engine import Engine

    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)  # as torchrun sets it (DeepSpeed reads it)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    engine_knobs = {k: v for k, v in knobs.items() if k not in Workload.model_fields}
    work_knobs = {"precision": "fp32"} | {k: v for k, v in knobs.items() if k in Workload.model_fields}
    work = Workload(global_batch=2 * plan.dp * plan.micro_batch, seq_len=32, optimizer={"lr": 3e-3}, **work_knobs)
    engine = Engine(NANO, plan, work, rank=rank, **engine_knobs)
    stage, replica, tp_rank = plan.coordinates(rank)
    data = torch.Generator().manual_seed(7 + replica)
    losses = []
    for _ in range(3):
        ids = [torch.randint(0, NANO.vocab_size, (plan.micro_batch, 33), generator=data) for _ in range(2)]
        losses.append(engine.step([(x[:, :-1], x[:, 1:]) for x in ids]))
    if stage == plan.pp - 1 and replica == 0 and tp_rank == 0:
        out.put(losses)
    dist.destroy_process_group()


def _replica0_losses(plan: ParallelPlan, **knobs) -> list[float]:
    ctx = multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    ranks = [ctx.Process(target=_losses_of, args=(r, plan.gpus, port, plan, out, knobs)) for r in range(plan.gpus)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=300)
    assert [p.exitcode for p in ranks] == [0] * plan.gpus, plan.label()
    return out.get(timeout=5)


_REFERENCES: dict[str, list[float]] = {}


def _reference_losses(plan: ParallelPlan, **knobs) -> list[float]:
    """_replica0_losses of a reference plan (plain data parallelism, one rank), trained once per
    session: the same deterministic run is the reference of several tests here and in test_pipeline."""
    key = plan.model_dump_json() + repr(sorted(knobs.items()))
    if key not in _REFERENCES:
        _REFERENCES[key] = _replica0_losses(plan, **knobs)
    return _REFERENCES[key]


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


@pytest.mark.parametrize("name", ["gpt-nano", "llama-nano"])
def test_master_weights_train_as_fp32_weights_under_autocast(name):
    """bf16 weights with fp32 masters and main gradients follow fp32 weights under bf16 autocast
    within bf16's rounding; the weights are bf16, the optimizer's masters and their gradients fp32."""
    spec = PRESETS[name]
    ids = torch.randint(0, spec.vocab_size, (2, 65), generator=torch.Generator().manual_seed(1))
    batches = [(ids[:, :-1], ids[:, 1:])] * 2
    runs = {}
    for master in (False, True):
        work = Workload(global_batch=4, seq_len=64, precision="bf16", optimizer={"lr": 3e-3}, master_weights=master)
        engine = Engine(spec, ParallelPlan(micro_batch=2), work)
        runs[master] = [engine.step(batches) for _ in range(4)]
    assert runs[True] == pytest.approx(runs[False], abs=2e-2)
    assert runs[True][-1] < runs[True][0] - 0.5
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert {(m.dtype, m.grad.dtype) for m in engine.optimizer.param_groups[0]["params"]} == {(torch.float32, torch.float32)}
    assert {t.dtype for t in engine.state_dict().values()} == {torch.float32}


def test_master_weights_need_half_precision_and_no_deepspeed():
    with pytest.raises(ValueError, match="set precision bf16 or fp16"):
        Workload(global_batch=1, seq_len=16, precision="fp32", master_weights=True)
    with pytest.raises(FrenzyError, match="set precision bf16 or fp16"):
        check_engine_plan(NANO, ParallelPlan(), "fp32", master_weights=True)
    with pytest.raises(FrenzyError, match="ZeRO-2 keeps fp32 weights"):
        check_engine_plan(NANO, ParallelPlan(dp=2, zero=2), "bf16", master_weights=True)


class _NoComm(TensorParallel):
    """A tensor-parallel rank without its group: the partial sums a row-parallel layer would all-reduce."""

    def enter(self, x):
        return x

    def leave(self, x):
        return x


@pytest.mark.parametrize("name", ["gpt-nano", "llama-nano"])
def test_tensor_parallel_shards_sum_to_the_whole_models_attention_and_mlp(name):
    """shard_state slices [q | k | v] (k and v kv_heads wide) and SwiGLU's [gate | up] per part:
    the two ranks' partial outputs add up to the unsplit layer's."""
    spec = PRESETS[name].model_copy(update={"qkv_bias": True, "out_bias": True, "mlp_bias": True})
    torch.manual_seed(0)
    full = Decoder(spec).eval()
    x = torch.randn(2, 16, spec.hidden)
    shared = positions(spec, "flash", 16, x.device)
    block = full.blocks[1]
    parts = []
    for rank in range(2):
        tp = _NoComm(rank=rank, size=2)
        shard = Decoder(spec, tp=tp).eval()
        shard.load_state_dict(shard_state(full.state_dict(), spec, tp, 0, (spec.layers,)))
        parts.append((shard.blocks[1].attn(x, shared), shard.blocks[1].mlp(x)))
    torch.testing.assert_close(parts[0][0] + parts[1][0], block.attn(x, shared))
    torch.testing.assert_close(parts[0][1] + parts[1][1], block.mlp(x))


@pytest.mark.parametrize(
    ("name", "attention", "precision", "recompute"),
    [("llama-nano", "flash", "bf16", "none"), ("llama-nano", "eager", "fp32", "selective"), ("gpt-nano", "eager", "bf16", "full")],
)
def test_the_engine_trains_llama_blocks_and_both_attentions_with_dropout(name, attention, precision, recompute):
    spec = PRESETS[name].model_copy(update={"attention_dropout": 0.1, "hidden_dropout": 0.1})
    work = Workload(global_batch=4, seq_len=32, precision=precision, optimizer={"lr": 3e-3, "schedule": "constant"}, attention=attention)
    engine = Engine(spec, ParallelPlan(micro_batch=4, recompute=recompute), work)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 16, (4, 33), generator=generator)  # a small alphabet, learnable in a few steps
    losses = [engine.step([(ids[:, :-1], ids[:, 1:])]) for _ in range(8)]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("name", ["gpt-nano", "llama-nano"])
def test_eager_attention_computes_what_the_fused_one_does(name):
    torch.manual_seed(0)
    flash = Decoder(PRESETS[name]).eval()
    eager = Decoder(PRESETS[name], attention="eager").eval()
    eager.load_state_dict(flash.state_dict())
    ids = torch.randint(0, 256, (2, 24))
    torch.testing.assert_close(eager(ids), flash(ids), atol=1e-5, rtol=1e-4)


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
