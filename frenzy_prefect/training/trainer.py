"""Data-parallel training of the project's GPT with torch.distributed, checkpointing to storage."""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from frenzy_prefect.spec.plan import TrainingJob
from frenzy_prefect.spec.request import OptimizerSettings
from frenzy_prefect.spec.result import TrainingResult
from frenzy_prefect.storage import write_bytes
from frenzy_prefect.training.data import TokenWindows
from frenzy_prefect.training.distributed import DistributedContext
from frenzy_prefect.training.gpt import GPT

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_optimizer(model: torch.nn.Module, settings: OptimizerSettings) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if settings.name == "sgd":
        return torch.optim.SGD(params, lr=settings.lr, momentum=settings.momentum, weight_decay=settings.weight_decay)
    cls = torch.optim.AdamW if settings.name == "adamw" else torch.optim.Adam
    return cls(params, lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay)


def lr_factor(step: int, steps: int, settings: OptimizerSettings) -> float:
    """Linear warm-up, then constant or cosine decay to 10% of the peak rate."""
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    if settings.schedule == "constant":
        return 1.0
    progress = (step - settings.warmup_steps) / max(1, steps - settings.warmup_steps)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))


def train(job: TrainingJob, ctx: DistributedContext, log: Callable[[str], None] = print) -> TrainingResult:
    """Run this rank's share of ``job``; every rank returns the same result, rank 0 writes it."""
    request, plan = job.request, job.allocation.plan
    if ctx.world_size != plan.gpus:
        raise RuntimeError(f"the plan needs {plan.gpus} ranks but this job has {ctx.world_size}")
    started = time.perf_counter()
    ctx.init_process_group()
    try:
        device = ctx.device
        torch.manual_seed(request.seed)  # identical initial weights on every rank
        model = GPT(job.model, recompute=plan.recompute).to(device)
        net = model
        if ctx.world_size > 1:
            net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
        optimizer = make_optimizer(model, request.optimizer)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, request.steps, request.optimizer))
        amp_dtype = AUTOCAST_DTYPES.get(request.precision)
        scaler = torch.amp.GradScaler(device.type, enabled=request.precision == "fp16")
        data = TokenWindows(job.dataset, request.seq_len)
        generator = torch.Generator().manual_seed(request.seed * 1_000_003 + ctx.rank)
        accumulation = plan.accumulation(request.global_batch)
        tokens_per_step = request.global_batch * request.seq_len

        losses: list[float] = []
        for step in range(1, request.steps + 1):
            step_loss = torch.zeros((), device=device)
            for micro in range(accumulation):
                x, y = (t.to(device) for t in data.batch(generator, plan.micro_batch))
                sync = micro == accumulation - 1 or ctx.world_size == 1
                with nullcontext() if sync else net.no_sync():
                    with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                        loss = net(x, y) / accumulation
                    scaler.scale(loss).backward()
                step_loss += loss.detach()
            if request.optimizer.grad_clip > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), request.optimizer.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
            if ctx.world_size > 1:
                dist.all_reduce(step_loss)
            losses.append(step_loss.item() / ctx.world_size)
            if step == 1 or step % request.log_every == 0 or step == request.steps:
                rate = step * tokens_per_step / (time.perf_counter() - started)
                log(f"step {step}/{request.steps} loss {losses[-1]:.4f} ({rate:,.0f} tokens/s over {ctx.world_size} ranks)")
        data.close()

        elapsed = time.perf_counter() - started
        result = TrainingResult(
            steps=request.steps,
            losses=losses,
            checkpoint=job.checkpoint_uri,
            world_size=ctx.world_size,
            backend=ctx.backend,
            wall_s=elapsed,
            tokens_per_s=request.steps * tokens_per_step / elapsed,
        )
        if ctx.rank == 0:
            buffer = io.BytesIO()
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": schedule.state_dict(),
                    "step": request.steps,
                    "model_spec": job.model.model_dump(),
                    "request": request.model_dump(mode="json"),
                },
                buffer,
            )
            write_bytes(job.checkpoint_uri, buffer.getvalue())
            # metrics.json last: its presence means the checkpoint is complete.
            write_bytes(job.metrics_uri, result.model_dump_json(indent=2).encode())
            log(f"checkpoint written to {job.checkpoint_uri}")
        if ctx.world_size > 1:
            dist.barrier()
        return result
    finally:
        dist.destroy_process_group()
