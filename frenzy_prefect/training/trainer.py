"""A training job on this rank: the engine's steps over the dataset, the loss logged, sharded
checkpoints written to storage every ``checkpoint_every`` steps, and a run resumed from its latest
complete checkpoint (``checkpoint.py``)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from frenzy_prefect.spec.plan import TrainingJob
from frenzy_prefect.spec.request import OptimizerSettings
from frenzy_prefect.spec.result import TrainingResult
from frenzy_prefect.storage import write_bytes
from frenzy_prefect.training import checkpoint
from frenzy_prefect.training.data import TokenWindows
from frenzy_prefect.training.distributed import DistributedContext, together
from frenzy_prefect.training.engine import Engine

CHECKPOINT_SHARE = 0.05  # of training time that periodic checkpoints may take, by default


def lr_factor(step: int, steps: int, settings: OptimizerSettings) -> float:
    """Linear warm-up, then constant or cosine decay to 10% of the peak rate."""
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    if settings.schedule == "constant":
        return 1.0
    progress = (step - settings.warmup_steps) / max(1, steps - settings.warmup_steps)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))


def checkpoint_interval(save_s: float, step_s: float) -> int:
    """Steps between checkpoints that keep their cost within CHECKPOINT_SHARE of training time."""
    return max(1, math.ceil(save_s / (CHECKPOINT_SHARE * step_s)))


def step_seed(seed: int, step: int) -> int:
    return seed * 1_000_003 + step


def step_batches(job: TrainingJob, data: TokenWindows, rank: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of optimizer step ``step``. The step's global batch is a function
    of (seed, step) alone, and replica r takes its r-th share of it in order: any plan (dp,
    micro-batch) trains on the same sequences at the same step, and a resumed run (on this plan or
    another) on what the uninterrupted one would have."""
    request, plan = job.request, job.allocation.plan
    _, replica, _ = plan.coordinates(rank)
    starts = data.starts(torch.Generator().manual_seed(step_seed(request.seed, step)), request.global_batch)
    share = request.global_batch // plan.dp
    mine = starts[replica * share : (replica + 1) * share]
    return [data.windows(mine[i : i + plan.micro_batch]) for i in range(0, share, plan.micro_batch)]


def train(job: TrainingJob, ctx: DistributedContext, log: Callable[[str], None] = print) -> TrainingResult:
    """Run this rank's share of ``job``, from its latest complete checkpoint if it has one; every
    rank returns the same result, rank 0 writes it."""
    request, plan = job.request, job.allocation.plan
    if ctx.world_size != plan.gpus:
        raise RuntimeError(f"the plan needs {plan.gpus} ranks but this job has {ctx.world_size}")
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
        # Every rank's reads and writes go through `together`: a rank that cannot reach storage
        # fails the run with its reason, reported by rank 0.
        resumed = together(ctx, lambda: _resume(job, engine, log))
        data = together(ctx, lambda: TokenWindows(job.dataset, request.seq_len))
        losses, final, timings = _run_steps(job, ctx, engine, data, resumed, log)
        data.close()

        elapsed = time.perf_counter() - started
        trained = request.steps - (resumed.step if resumed else 0)
        result = TrainingResult(
            steps=request.steps,
            losses=losses,
            checkpoint=final,
            world_size=ctx.world_size,
            backend=ctx.backend,
            wall_s=elapsed,
            tokens_per_s=trained * request.global_batch * request.seq_len / elapsed,
            step_s=timings["step"],
            checkpoint_s=timings["checkpoint"],
        )
        # metrics.json last: the other ranks wait for rank 0's write
        together(ctx, (lambda: write_bytes(job.metrics_uri, result.model_dump_json(indent=2).encode())) if ctx.rank == 0 else lambda: None)
        return result
    finally:
        dist.destroy_process_group()


def _resume(job: TrainingJob, engine: Engine, log: Callable[[str], None]) -> checkpoint.Manifest | None:
    """Load this run's latest complete checkpoint into ``engine``; returns its manifest, or None."""
    found = checkpoint.latest(job.checkpoint_uri)
    if found is None:
        return None
    uri, manifest = found
    checkpoint.load(engine, uri, manifest)
    log(f"resumed from {uri} (step {manifest.step}, written by plan {manifest.plan.label()})")
    return manifest


def _run_steps(
    job: TrainingJob,
    ctx: DistributedContext,
    engine: Engine,
    data: TokenWindows,
    resumed: checkpoint.Manifest | None,
    log: Callable[[str], None],
) -> tuple[list[float], str, dict[str, list[float]]]:
    """The training steps, with periodic checkpoints; returns each step's loss averaged over the
    ranks (those so far, when resumed), the final checkpoint's URI, and this rank's wall times of
    each step and each checkpoint."""
    request, plan, device = job.request, job.allocation.plan, ctx.device
    losses = list(resumed.losses) if resumed else []
    first = resumed.step + 1 if resumed else 1
    every = request.checkpoint_every or 1  # by default: measured at this attempt's first step, then at each checkpoint
    last_saved, final = first - 1, checkpoint.step_uri(job.checkpoint_uri, first - 1) if resumed else None
    tokens_per_step = request.global_batch * request.seq_len
    loss_ranks = ctx.world_size // plan.pp  # the last stage's ranks report the loss
    timings: dict[str, list[float]] = {"step": [], "checkpoint": []}
    for step in range(first, request.steps + 1):
        began = time.perf_counter()
        batches = together(ctx, lambda: [tuple(t.to(device) for t in b) for b in step_batches(job, data, ctx.rank, step)])  # noqa: B023
        torch.manual_seed(step_seed(request.seed, step))  # dropout: a resumed step draws what an uninterrupted one would
        step_loss = torch.tensor(engine.step(batches), device=device)
        if ctx.world_size > 1:
            dist.all_reduce(step_loss)
        losses.append(step_loss.item() / loss_ranks)
        timings["step"].append(time.perf_counter() - began)
        if step == first or step % request.log_every == 0 or step == request.steps:
            rate = len(timings["step"]) * tokens_per_step / sum(timings["step"])  # training only, not checkpoints
            log(f"step {step}/{request.steps} loss {losses[-1]:.4f} ({rate:,.0f} tokens/s over {ctx.world_size} ranks)")
        if step - last_saved >= every or step == request.steps:
            final, save_s = together(
                ctx,
                lambda: checkpoint.save(engine, job.checkpoint_uri, step, losses, request.keep_checkpoints),  # noqa: B023 (called at once)
            )
            log(f"checkpoint of step {step} written to {final} in {save_s:.2f} s")
            timings["checkpoint"].append(save_s)
            if request.checkpoint_every is None and step < request.steps:
                # The steps after the first (which also warms up), once there are some.
                step_s = statistics.mean(timings["step"][1:] or timings["step"])
                interval = _agreed_interval(ctx, save_s, step_s)
                if interval != every:
                    log(f"checkpointing every {interval} steps (a checkpoint takes {save_s:.2f} s, a step {step_s:.2f} s)")
                every = interval
            last_saved = step
    return losses, final, timings


def _agreed_interval(ctx: DistributedContext, save_s: float, step_s: float) -> int:
    """checkpoint_interval of the slowest rank's times, the same on every rank."""
    times = torch.tensor([save_s, step_s], dtype=torch.float64, device=ctx.device)
    if ctx.world_size > 1:
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return checkpoint_interval(*times.tolist())
