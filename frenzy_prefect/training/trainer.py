"""A training job on this rank: the engine's steps over the dataset, the loss logged, sharded
checkpoints written to storage every ``checkpoint_every`` steps, and a run resumed from its latest
committed checkpoint (``checkpoint.py``), once this attempt has claimed the run (``fence.py``).

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
from functools import partial
from typing import TypeVar

import torch
import torch.distributed as dist

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.spec.plan import TrainingJob
from frenzy_prefect.spec.request import OptimizerSettings, TrainingRequest
from frenzy_prefect.spec.result import RankPeak, SurvivedFailure, TrainingResult
from frenzy_prefect.storage import Deadline, stall_bound_s, write_bytes
from frenzy_prefect.training import checkpoint, fence, manifest
from frenzy_prefect.training.data import TokenWindows, step_batches, step_seed
from frenzy_prefect.training.distributed import DistributedContext, PeerFailed, together
from frenzy_prefect.training.engine import Engine
from frenzy_prefect.training.fence import Fence, Fenced, FenceWatch, Superseded

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
    generation: int = 1  # of the run's attempts: the one training (fence.py)

    @classmethod
    def start(cls, job: TrainingJob, resumed: manifest.Manifest | None, generation: int) -> Progress:
        first = resumed.step + 1 if resumed else 1
        final = manifest.step_uri(job.checkpoint_uri, resumed.step, resumed.generation) if resumed else None
        # By default the interval is measured at this attempt's first step, then at each checkpoint.
        every = job.request.checkpoint_every or 1
        losses, save_s = (list(resumed.losses), resumed.save_s) if resumed else ([], None)
        return cls(first, losses, every, first - 1, final, save_s, generation=generation)


def train(job: TrainingJob, ctx: DistributedContext, log: Callable[[str], None] = print, notify: Notify | None = None) -> TrainingResult:
    """Run this rank's share of ``job``, from its latest complete checkpoint if it has one; every
    rank returns the same result, rank 0 writes it. ``notify(event, details)`` hears, from the
    process group's rank 0, of the run's start, every step, each checkpoint and its completion."""
    request, plan = job.request, job.allocation.plan
    if request.resilience == "recycle":
        raise FrenzyError("resilience 'recycle' trains under each rank's supervisor (training.resilient), not this trainer")
    check_world(job, ctx)
    started, notify, poll_s = time.perf_counter(), notify or (lambda event, details: None), fence.poll_s()
    ctx.init_process_group()
    watch = None
    try:
        engine = build_engine(job, ctx)
        loss_ranks = ctx.world_size // plan.pp  # the last stage's ranks report the loss

        def run_step(step: int, data: TokenWindows, progress: Progress) -> float:
            batches = together(ctx, lambda: [tuple(t.to(ctx.device) for t in b) for b in step_batches(job, data, ctx.rank, step)])
            torch.manual_seed(step_seed(request.seed, step))  # dropout: a resumed step draws what an uninterrupted one would
            step_loss = torch.tensor(engine.step(batches), device=ctx.device)
            if ctx.world_size > 1:
                dist.all_reduce(step_loss)
            return step_loss.item() / loss_ranks

        # Every rank's reads and writes go through `together`: a rank that cannot reach storage
        # fails the run with its reason, reported by rank 0. The run is claimed once its data reads.
        with closing(together(ctx, lambda: TokenWindows(job.dataset, request.seq_len))) as data:
            held = claim(job, ctx)
            watch = FenceWatch(held, poll_s) if ctx.rank == 0 else None
            progress = Progress.start(job, together(ctx, lambda: resume(job, engine, log, held)), held.generation)
            first = progress.next_step
            check = partial(stop_if_fenced, ctx, held, watch)
            timings = run_steps(job, ctx, held, lambda: engine, data, progress, run_step, log, notify, check=check)
        return write_result(job, ctx, progress, first, timings, started)
    finally:
        if watch is not None:
            watch.stop()
        dist.destroy_process_group()


def claim(job: TrainingJob, ctx: DistributedContext) -> Fence:
    """This attempt's claim of the run (``fence.claim``, by rank 0), the same on every rank;
    Superseded on every rank if a newer attempt holds the run."""

    def on_rank0() -> Fence | str | None:
        if ctx.rank != 0:
            return None
        deadline = Deadline(manifest.head_uri(job.checkpoint_uri), stall_bound_s(), "claiming the run's checkpoints")
        try:
            return deadline.run(lambda: fence.claim(job.checkpoint_uri, fence.attempt_key()))
        except Superseded as exc:
            return str(exc)

    held = [together(ctx, on_rank0)]
    if ctx.world_size > 1:
        dist.broadcast_object_list(held, src=0)
    if isinstance(held[0], str):
        raise Superseded(held[0] if ctx.rank == 0 else f"rank {ctx.rank} does not start: {held[0]}")
    return held[0]


def stop_if_fenced(ctx: DistributedContext, held: Fence, watch: FenceWatch | None, step: int) -> None:
    """Fenced on every rank, after step ``step``, once rank 0's watch has seen a newer
    generation claim the run (one small all-reduce: every rank calls this after each step)."""
    seen = torch.tensor([watch is not None and watch.holder is not None], dtype=torch.int32, device=ctx.device)
    if ctx.world_size > 1:
        dist.all_reduce(seen)
    if seen.item():
        raise Fenced(held.stopped(step, watch.holder) if watch is not None else f"rank {ctx.rank} stops: a newer generation holds the run")


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


def resume(job: TrainingJob, engine: Engine, log: Callable[[str], None], held: Fence | None = None) -> manifest.Manifest | None:
    """Load this run's newest intact committed checkpoint into ``engine``: of those ``held``
    resumes from (its claim's), else of those the head names now; returns its manifest, or None.
    A newer one that is not intact is named in the log, skipped, and left out of the next commit."""
    uris = held.uris() if held is not None else manifest.committed_checkpoints(job.checkpoint_uri)
    found = next(manifest.intact(job.checkpoint_uri, uris, warn=log), None)
    for uri in uris[: uris.index(found[0])] if found else uris:  # (named in the log)
        if held is not None:
            held.skip(uri)
    if found is None and uris:
        log(f"no intact checkpoint left among the {len(uris)} committed under {job.checkpoint_uri}: training starts from step 1")
    if found is not None:
        uri, resumed = found
        checkpoint.load(engine, uri, resumed)
        log(f"resumed from {uri} (step {resumed.step}, written by plan {resumed.plan.label()})")
    if held is not None and held.generation > 1:
        where = f"resuming from step {found[1].step}" if found else "starting from step 1"
        log(f"generation {held.generation} takes the run over from generation {held.generation - 1}: {where}")
    return found[1] if found else None


def run_steps(
    job: TrainingJob,
    ctx: DistributedContext,
    held: Fence,
    engine: Callable[[], Engine],
    data: TokenWindows,
    progress: Progress,
    run_step: StepRunner,
    log: Callable[[str], None],
    notify: Notify,
    survive: Survive = lambda action, step, skipped: action(),
    check: Callable[[int], None] = lambda step: None,
) -> dict[str, list[float]]:
    """The steps from ``progress`` on, with periodic checkpoints (committed under ``held``), each
    step's loss (averaged over the ranks) and checkpoint kept in ``progress``; returns this
    rank's wall times of each step and each checkpoint. ``engine()``: the engine of the moment
    (the resilient trainer's changes when it re-plans). ``survive(action, step, skipped)`` runs a
    checkpoint (the resilient trainer: again, after a failure interrupts it). ``check(step)``
    after each step, before anything of it is told: raises to stop (the plain trainer's, once
    a newer generation holds the run)."""
    request = job.request
    tokens_per_step = request.global_batch * request.seq_len
    timings: dict[str, list[float]] = {"step": [], "checkpoint": []}
    reports = dist.get_rank() == 0  # (notify: rank 0 speaks for the run)
    # Each event follows a decision of the storage for this generation, and says when it was made (ISO: JSON for ReCycle's trainers).
    of_generation = {"generation": progress.generation}
    if reports:
        started = {"step": progress.next_step, "steps": request.steps, "ranks": ctx.world_size, "plan": job.allocation.plan.label()}
        notify("started", started | of_generation | {"resumed_from": progress.next_step - 1, "decided_at": held.claimed_at.isoformat()})
    tag = f"; generation {progress.generation}" if progress.generation > 1 else ""
    trained_s = 0.0  # the steps' own time, checkpoints excluded
    for step in range(progress.next_step, request.steps + 1):
        began = time.perf_counter()
        loss = run_step(step, data, progress)
        check(step)
        progress.losses.append(loss)
        progress.next_step = step + 1
        timings["step"].append(time.perf_counter() - began)
        trained_s += timings["step"][-1]
        if len(timings["step"]) == 1 or step % request.log_every == 0 or step == request.steps:
            rate = len(timings["step"]) * tokens_per_step / trained_s
            log(f"step {step}/{request.steps} loss {loss:.4f} ({rate:,.0f} tokens/s over {dist.get_world_size()} ranks{tag})")
        if reports:
            notify("step", {"step": step, "steps": request.steps, "loss": progress.losses[-1]})
        if step - progress.last_saved >= progress.every or step == request.steps:
            final, save_s, interval = survive(
                lambda: _checkpoint(job, ctx, held, engine(), step, progress.losses, timings),  # noqa: B023 (called at once)
                step,
                lambda: (manifest.step_uri(job.checkpoint_uri, step, held.generation), 0.0, None),  # noqa: B023 (written before a failure)
            )
            log(f"checkpoint of step {step} written to {final} in {save_s:.2f} s")
            if interval is not None and interval != progress.every:
                log(f"checkpointing every {interval} steps (a checkpoint takes {save_s:.2f} s)")
            progress.every, progress.last_saved, progress.final = interval or progress.every, step, final
            progress.save_s = save_s or progress.save_s  # (0: taken from a survivor that wrote it)
            timings["checkpoint"].append(save_s)
            if reports:
                decided = held.decided_at.isoformat() if held.decided_at else None  # (None: this rank committed none)
                notify("checkpointed", {"step": step, "checkpoint": final, "seconds": save_s} | of_generation | {"decided_at": decided})
    return timings


def _checkpoint(
    job: TrainingJob, ctx: DistributedContext, held: Fence, engine: Engine, step: int, losses: list[float], timings: dict[str, list[float]]
) -> tuple[str, float, int | None]:
    """Write step ``step``'s checkpoint; returns its URI, the time it took and, unless the request
    sets the interval, the interval agreed from that time and the steps' (None after the last step)."""
    request = job.request
    uri, save_s = write_checkpoint(job, ctx, held, engine, step, losses)
    if request.checkpoint_every is not None or step == request.steps:
        return uri, save_s, None
    step_s = statistics.mean(timings["step"][1:] or timings["step"])  # the steps after the first (which also warms up)
    return uri, save_s, _agreed_interval(ctx, save_s, step_s)


def write_checkpoint(
    job: TrainingJob, ctx: DistributedContext, held: Fence, engine: Engine, step: int, losses: list[float]
) -> tuple[str, float]:
    """Every rank writes its part of step ``step``'s checkpoint (``checkpoint.save``, through
    ``together``); returns its URI and the seconds it took. Fenced on every rank when its commit
    was refused."""
    try:
        return together(ctx, lambda: checkpoint.save(engine, held, step, losses, job.request.keep_checkpoints))
    except PeerFailed as exc:
        if (fenced := fence.fenced_in(exc)) is not None:
            raise fenced from None
        raise


def _agreed_interval(ctx: DistributedContext, save_s: float, step_s: float) -> int:
    """checkpoint_interval of the slowest rank's times, the same on every rank."""
    times = torch.tensor([save_s, step_s], dtype=torch.float64, device=ctx.device)
    if dist.get_world_size() > 1:
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return checkpoint_interval(*times.tolist())
