"""Helpers shared by the tests of training."""

import asyncio
import multiprocessing
import os
import sys

import torch
import torch.distributed as dist

from frenzy_prefect.launch.local import start_local
from frenzy_prefect.launch.torchrun import rank_launches
from frenzy_prefect.memory import estimate
from frenzy_prefect.profiling.model import PRESETS
from frenzy_prefect.spec.cluster import ClusterSpec
from frenzy_prefect.spec.dataset import DatasetInfo
from frenzy_prefect.spec.plan import Allocation, ParallelPlan, Placement, TrainingJob
from frenzy_prefect.spec.request import TrainingRequest
from frenzy_prefect.training.distributed import free_port

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
