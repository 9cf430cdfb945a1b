"""A training job on this rank: the engine's steps over the dataset, the loss logged, and a
checkpoint written to storage."""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.spec.plan import ParallelPlan, TrainingJob
from frenzy_prefect.spec.request import OptimizerSettings
from frenzy_prefect.spec.result import TrainingResult
from frenzy_prefect.storage import write_bytes
from frenzy_prefect.training.data import TokenWindows
from frenzy_prefect.training.distributed import DistributedContext, together
from frenzy_prefect.training.engine import Engine


def lr_factor(step: int, steps: int, settings: OptimizerSettings) -> float:
    """Linear warm-up, then constant or cosine decay to 10% of the peak rate."""
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    if settings.schedule == "constant":
        return 1.0
    progress = (step - settings.warmup_steps) / max(1, steps - settings.warmup_steps)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))


def check_checkpointable(plan: ParallelPlan) -> None:
    """The checkpoint is one file written by rank 0, so rank 0 must hold the whole model."""
    if plan.tp > 1 or plan.pp > 1 or plan.zero:
        raise FrenzyError(
            f"training writes a single-file checkpoint from rank 0, which needs tp=1, pp=1 and zero=0 (got {plan.label()}); "
            "other plans can be estimated and measured (`frenzy measure`) but not trained yet"
        )


def train(job: TrainingJob, ctx: DistributedContext, log: Callable[[str], None] = print) -> TrainingResult:
    """Run this rank's share of ``job``; every rank returns the same result, rank 0 writes it."""
    request, plan = job.request, job.allocation.plan
    if ctx.world_size != plan.gpus:
        raise RuntimeError(f"the plan needs {plan.gpus} ranks but this job has {ctx.world_size}")
    check_checkpointable(plan)
    started = time.perf_counter()
    ctx.init_process_group()
    try:
        engine = Engine(
            job.model,
            plan,
            precision=request.precision,
            optimizer=request.optimizer,
            accumulation=plan.accumulation(request.global_batch),
            attention=request.attention,
            master_weights=request.master_weights,
            seed=request.seed,
            rank=ctx.rank,
            device=ctx.device,
            lr_factor=lambda s: lr_factor(s, request.steps, request.optimizer),
        )
        # Every rank's reads and rank 0's checkpoint go through `together`: a rank that cannot
        # reach storage fails the run with its reason, reported by rank 0.
        data = together(ctx, lambda: TokenWindows(job.dataset, request.seq_len))
        losses = _run_steps(job, ctx, engine, data, started, log)
        data.close()

        elapsed = time.perf_counter() - started
        result = TrainingResult(
            steps=request.steps,
            losses=losses,
            checkpoint=job.checkpoint_uri,
            world_size=ctx.world_size,
            backend=ctx.backend,
            wall_s=elapsed,
            tokens_per_s=request.steps * request.global_batch * request.seq_len / elapsed,
        )
        # the other ranks wait for rank 0's write
        together(ctx, (lambda: _save(job, engine, result, log)) if ctx.rank == 0 else lambda: None)
        return result
    finally:
        dist.destroy_process_group()


def _run_steps(
    job: TrainingJob, ctx: DistributedContext, engine: Engine, data: TokenWindows, started: float, log: Callable[[str], None]
) -> list[float]:
    """The training steps; returns each step's loss averaged over the ranks, logging some."""
    request, plan, device = job.request, job.allocation.plan, ctx.device
    accumulation = plan.accumulation(request.global_batch)
    generator = torch.Generator().manual_seed(request.seed * 1_000_003 + ctx.rank)
    tokens_per_step = request.global_batch * request.seq_len

    def next_batches() -> list[tuple[torch.Tensor, ...]]:
        return [tuple(t.to(device) for t in data.batch(generator, plan.micro_batch)) for _ in range(accumulation)]

    losses: list[float] = []
    for step in range(1, request.steps + 1):
        batches = together(ctx, next_batches)
        step_loss = torch.tensor(engine.step(batches), device=device)
        if ctx.world_size > 1:
            dist.all_reduce(step_loss)
        losses.append(step_loss.item() / ctx.world_size)
        if step == 1 or step % request.log_every == 0 or step == request.steps:
            rate = step * tokens_per_step / (time.perf_counter() - started)
            log(f"step {step}/{request.steps} loss {losses[-1]:.4f} ({rate:,.0f} tokens/s over {ctx.world_size} ranks)")
    return losses


def _save(job: TrainingJob, engine: Engine, result: TrainingResult, log: Callable[[str], None]) -> None:
    """Rank 0's checkpoint, then metrics.json last: its presence means the checkpoint is complete."""
    buffer = io.BytesIO()
    torch.save(
        {
            "model": engine.state_dict(),  # fp32 (the masters, with master weights)
            "optimizer": engine.optimizer.state_dict(),
            "scheduler": engine.schedule.state_dict(),
            "step": job.request.steps,
            "model_spec": job.model.model_dump(),
            "request": job.request.model_dump(mode="json"),
        },
        buffer,
    )
    write_bytes(job.checkpoint_uri, buffer.getvalue())
    write_bytes(job.metrics_uri, result.model_dump_json(indent=2).encode())
    log(f"checkpoint written to {job.checkpoint_uri}")
