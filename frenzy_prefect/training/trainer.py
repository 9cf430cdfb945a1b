"""A training job on this rank: the engine's steps over the dataset, the loss logged, sharded
checkpoints written to storage every ``checkpoint_every`` steps, and a run resumed from its latest
complete checkpoint (``checkpoint.py``).

``train`` is the plain trainer (resilience "restart": a rank's failure fails the run, or torchrun
restarts every rank from the last checkpoint). The resilient trainer (resilience "recycle",
``resilient/trainer.py``) runs the same steps (``run_steps``) through failures; what both share
lives here, once: the engine a job builds, its resume, the step loop with its checkpoints, the result.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.spec.plan import TrainingJob
from frenzy_prefect.spec.request import OptimizerSettings, TrainingRequest
from frenzy_prefect.spec.result import RankPeak, SurvivedFailure, TrainingResult
from frenzy_prefect.storage import write_bytes
from frenzy_prefect.training import checkpoint, manifest
from frenzy_prefect.training.data import TokenWindows, step_batches, step_seed
from frenzy_prefect.training.distributed import DistributedContext, together
from frenzy_prefect.training.engine import Engine

T = TypeVar("T")
Notify = Callable[[str, dict], None]  # (event name, details): rank 0 turns them into Prefect events
StepRunner = Callable[[int, TokenWindows, "Progress"], float]  # (step, data, progress so far) -> the step's mean loss
# Runs step n's checkpoint (the action), or (the resilient trainer, after a failure interrupted
# it) runs it again, or takes what another survivor completed (the last callable).
Survive = Callable[[Callable[[], T], int, Callable[[], T]], T]

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


@dataclass
class Progress:
    """Where a run's steps stand: all that a rank joining them needs (ReCycle's replacements)."""

    next_step: int
    losses: list[float]  # of the steps before next_step
    every: int  # steps between checkpoints
    last_saved: int  # the last checkpoint's step, or the step before this attempt's first
    final: str | None = None  # the last checkpoint's URI
    save_s: float | None = None  # how long the last checkpoint took to write
    survived: list[dict] = field(default_factory=list)  # failures and rejoins trained through (SurvivedFailure's fields)

    @classmethod
    def start(cls, job: TrainingJob, resumed: manifest.Manifest | None) -> Progress:
        first = resumed.step + 1 if resumed else 1
        final = manifest.step_uri(job.checkpoint_uri, resumed.step) if resumed else None
        # By default the interval is measured at this attempt's first step, then at each checkpoint.
        every = job.request.checkpoint_every or 1
        return cls(first, list(resumed.losses) if resumed else [], every, first - 1, final, resumed.save_s if resumed else None)


def train(job: TrainingJob, ctx: DistributedContext, log: Callable[[str], None] = print, notify: Notify | None = None) -> TrainingResult:
    """Run this rank's share of ``job``, from its latest complete checkpoint if it has one; every
    rank returns the same result, rank 0 writes it. ``notify(event, details)`` hears, from the
    process group's rank 0, of the run's start, every step, each checkpoint and its completion."""
    request, plan = job.request, job.allocation.plan
    if request.resilience == "recycle":
        raise FrenzyError("resilience 'recycle' trains under each rank's supervisor (training.resilient), not this trainer")
    check_world(job, ctx)
    started, notify = time.perf_counter(), notify or (lambda event, details: None)
    ctx.init_process_group()
    try:
        engine = build_engine(job, ctx)
        # Every rank's reads and writes go through `together`: a rank that cannot reach storage
        # fails the run with its reason, reported by rank 0.
        progress = Progress.start(job, together(ctx, lambda: resume(job, engine, log)))
        loss_ranks = ctx.world_size // plan.pp  # the last stage's ranks report the loss

        def run_step(step: int, data: TokenWindows, progress: Progress) -> float:
            batches = together(ctx, lambda: [tuple(t.to(ctx.device) for t in b) for b in step_batches(job, data, ctx.rank, step)])
            torch.manual_seed(step_seed(request.seed, step))  # dropout: a resumed step draws what an uninterrupted one would
            step_loss = torch.tensor(engine.step(batches), device=ctx.device)
            if ctx.world_size > 1:
                dist.all_reduce(step_loss)
            return step_loss.item() / loss_ranks

        first = progress.next_step
        with closing(together(ctx, lambda: TokenWindows(job.dataset, request.seq_len))) as data:
            timings = run_steps(job, ctx, lambda: engine, data, progress, run_step, log, notify)
        return write_result(job, ctx, progress, first, timings, started)
    finally:
        dist.destroy_process_group()


def check_world(job: TrainingJob, ctx: DistributedContext) -> None:
    if ctx.world_size != job.allocation.plan.gpus:
        raise RuntimeError(f"the plan needs {job.allocation.plan.gpus} ranks but this job has {ctx.world_size}")


def build_engine(job: TrainingJob, ctx: DistributedContext, live: list[int] | None = None) -> Engine:
    """This rank's engine for the job (``live``: the ranks in the process group, when not all are)."""
    request, plan = job.request, job.allocation.plan
    return Engine(
        job.model,
        plan,
        request.workload,
        seed=request.seed,
        rank=ctx.rank,
        device=ctx.device,
        lr_factor=lambda s: lr_factor(s, request.steps, request.optimizer),
        live=live,
    )


def write_result(
    job: TrainingJob, ctx: DistributedContext, progress: Progress, first: int, timings: dict, started: float
) -> TrainingResult:
    """The run's result after its steps from ``first`` on (``timings``: this rank's), which the
    process group's rank 0 writes to metrics.json."""
    request = job.request
    elapsed = time.perf_counter() - started
    result = TrainingResult(
        steps=request.steps,
        losses=progress.losses,
        checkpoint=progress.final,
        world_size=ctx.world_size,
        backend=ctx.backend,
        wall_s=elapsed,
        tokens_per_s=(request.steps - first + 1) * request.global_batch * request.seq_len / elapsed,
        first_step=first,
        step_s=timings["step"],
        checkpoint_s=timings["checkpoint"],
        failures=[_with_throughput(record, first, timings["step"], request) for record in progress.survived],
        rank_peaks=rank_peaks(ctx),
    )
    # metrics.json last: the other ranks wait for rank 0's write
    writes = dist.get_rank() == 0
    together(ctx, (lambda: write_bytes(job.metrics_uri, result.model_dump_json(indent=2).encode())) if writes else lambda: None)
    return result


def rank_peaks(ctx: DistributedContext) -> list[RankPeak]:
    """Every rank's peak as its GPU's caching allocator counted it (the run's calibration store
    learns from them); on CPU, none: MemTracker would slow every step it watched."""
    if ctx.device.type != "cuda":
        return []
    free, total = torch.cuda.mem_get_info(ctx.device)
    reserved = torch.cuda.max_memory_reserved(ctx.device)
    mine = RankPeak(
        rank=ctx.rank,
        allocated_bytes=torch.cuda.max_memory_allocated(ctx.device),
        reserved_bytes=reserved,
        outside_allocator_bytes=max(0, total - free - torch.cuda.memory_reserved(ctx.device)),
    )
    peaks: list[RankPeak | None] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, mine)
    return sorted((p for p in peaks if p is not None), key=lambda p: p.rank)


def _with_throughput(record: dict, first: int, step_s: list[float], request: TrainingRequest) -> SurvivedFailure:
    """A survived failure, with tokens/s over up to 5 steps on each side of it that this rank timed."""
    at = record["step"] - first  # its index in step_s
    before = step_s[max(0, at - 5) : max(0, at)]
    after = step_s[at + 1 : at + 6] if record["kind"] == "failed" else step_s[at : at + 5]

    def rate(times: list[float]) -> float | None:
        return len(times) * request.global_batch * request.seq_len / sum(times) if times else None

    return SurvivedFailure(**record, tokens_per_s_before=rate(before), tokens_per_s_after=rate(after))


def resume(job: TrainingJob, engine: Engine, log: Callable[[str], None]) -> manifest.Manifest | None:
    """Load this run's latest intact checkpoint into ``engine``; returns its manifest, or None.
    A newer one whose manifest is corrupt is named in the log and skipped."""
    found = manifest.latest(job.checkpoint_uri, warn=log)
    if found is None:
        return None
    uri, resumed = found
    checkpoint.load(engine, uri, resumed)
    log(f"resumed from {uri} (step {resumed.step}, written by plan {resumed.plan.label()})")
    return resumed


def run_steps(
    job: TrainingJob,
    ctx: DistributedContext,
    engine: Callable[[], Engine],
    data: TokenWindows,
    progress: Progress,
    run_step: StepRunner,
    log: Callable[[str], None],
    notify: Notify,
    survive: Survive = lambda action, step, skipped: action(),
) -> dict[str, list[float]]:
    """The steps from ``progress`` on, with periodic checkpoints, each step's loss (averaged over
    the ranks) and checkpoint kept in ``progress``; returns this rank's wall times of each step
    and each checkpoint. ``engine()``: the engine of the moment (the resilient trainer's changes
    when it re-plans). ``survive(action, step, skipped)`` runs a checkpoint (the resilient
    trainer: again, after a failure interrupts it)."""
    request = job.request
    tokens_per_step = request.global_batch * request.seq_len
    timings: dict[str, list[float]] = {"step": [], "checkpoint": []}
    reports = dist.get_rank() == 0  # (notify: rank 0 speaks for the run)
    if reports:
        notify(
            "started", {"step": progress.next_step, "steps": request.steps, "ranks": ctx.world_size, "plan": job.allocation.plan.label()}
        )
    trained_s = 0.0  # the steps' own time, checkpoints excluded
    for step in range(progress.next_step, request.steps + 1):
        began = time.perf_counter()
        progress.losses.append(run_step(step, data, progress))
        progress.next_step = step + 1
        timings["step"].append(time.perf_counter() - began)
        trained_s += timings["step"][-1]
        if len(timings["step"]) == 1 or step % request.log_every == 0 or step == request.steps:
            rate = len(timings["step"]) * tokens_per_step / trained_s
            log(f"step {step}/{request.steps} loss {progress.losses[-1]:.4f} ({rate:,.0f} tokens/s over {dist.get_world_size()} ranks)")
        if reports:
            notify("step", {"step": step, "steps": request.steps, "loss": progress.losses[-1]})
        if step - progress.last_saved >= progress.every or step == request.steps:
            final, save_s, interval = survive(
                lambda: _checkpoint(job, ctx, engine(), step, progress.losses, timings),  # noqa: B023 (called at once)
                step,
                lambda: (manifest.step_uri(job.checkpoint_uri, step), 0.0, None),  # noqa: B023 (written before a failure)
            )
            log(f"checkpoint of step {step} written to {final} in {save_s:.2f} s")
            if interval is not None and interval != progress.every:
                log(f"checkpointing every {interval} steps (a checkpoint takes {save_s:.2f} s)")
            progress.every, progress.last_saved, progress.final = interval or progress.every, step, final
            progress.save_s = save_s or progress.save_s  # (0: taken from a survivor that wrote it)
            timings["checkpoint"].append(save_s)
            if reports:
                notify("checkpointed", {"step": step, "checkpoint": final, "seconds": save_s})
    return timings


def _checkpoint(
    job: TrainingJob, ctx: DistributedContext, engine: Engine, step: int, losses: list[float], timings: dict[str, list[float]]
) -> tuple[str, float, int | None]:
    """Write step ``step``'s checkpoint; returns its URI, the time it took and, unless the request
    sets the interval, the interval agreed from that time and the steps' (None after the last step)."""
    request = job.request
    uri, save_s = write_checkpoint(job, ctx, engine, step, losses)
    if request.checkpoint_every is not None or step == request.steps:
        return uri, save_s, None
    step_s = statistics.mean(timings["step"][1:] or timings["step"])  # the steps after the first (which also warms up)
    return uri, save_s, _agreed_interval(ctx, save_s, step_s)


def write_checkpoint(job: TrainingJob, ctx: DistributedContext, engine: Engine, step: int, losses: list[float]) -> tuple[str, float]:
    """Every rank writes its part of step ``step``'s checkpoint (``checkpoint.save``, through
    ``together``); returns its URI and the seconds it took."""
    return together(ctx, lambda: checkpoint.save(engine, job.checkpoint_uri, step, losses, job.request.keep_checkpoints))


def _agreed_interval(ctx: DistributedContext, save_s: float, step_s: float) -> int:
    """checkpoint_interval of the slowest rank's times, the same on every rank."""
    times = torch.tensor([save_s, step_s], dtype=torch.float64, device=ctx.device)
    if dist.get_world_size() > 1:
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return checkpoint_interval(*times.tolist())
