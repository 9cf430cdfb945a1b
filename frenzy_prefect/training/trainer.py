"""A training job on this rank: the engine's steps over the dataset, the loss logged, sharded
checkpoints written to storage every ``checkpoint_every`` steps, and a run resumed from its latest
complete checkpoint (``checkpoint.py``)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import asdict, dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist

from frenzy_prefect.spec.layout import check_resilience
from frenzy_prefect.spec.plan import TrainingJob
from frenzy_prefect.spec.request import OptimizerSettings, TrainingRequest
from frenzy_prefect.spec.result import SurvivedFailure, TrainingResult
from frenzy_prefect.storage import write_bytes
from frenzy_prefect.training import checkpoint
from frenzy_prefect.training.data import TokenWindows, replica_batches, step_batches, step_seed
from frenzy_prefect.training.distributed import DistributedContext, together
from frenzy_prefect.training.engine import Engine
from frenzy_prefect.training.resilient.generations import FINISHED, Generation, Position, await_admission, finished_result
from frenzy_prefect.training.resilient.liveness import Heartbeat, incarnation_from_env
from frenzy_prefect.training.resilient.steps import CHECKPOINT, Notify, RecycleSteps, share_from_live_replica

T = TypeVar("T")
StepRunner = Callable[[int, TokenWindows, "Progress"], float]  # (step, data, progress so far) -> the step's mean loss
Survive = Callable[[Callable[[], T], Position, Callable[[], T]], T]  # RecycleSteps.survive, or just run it

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
    survived: list[dict] = field(default_factory=list)  # failures and rejoins trained through (SurvivedFailure's fields)

    def agree(self, source: int) -> None:
        """Take the checkpoint schedule of group rank ``source`` (collective; after a failure
        interrupted a checkpoint that some survivors had completed, and re-agreed its interval)."""
        fields = [self.every, self.last_saved, self.final]
        dist.broadcast_object_list(fields, src=source)
        self.every, self.last_saved, self.final = fields

    @classmethod
    def start(cls, job: TrainingJob, resumed: checkpoint.Manifest | None) -> Progress:
        first = resumed.step + 1 if resumed else 1
        final = checkpoint.step_uri(job.checkpoint_uri, resumed.step) if resumed else None
        # By default the interval is measured at this attempt's first step, then at each checkpoint.
        return cls(first, list(resumed.losses) if resumed else [], job.request.checkpoint_every or 1, first - 1, final)


def train(job: TrainingJob, ctx: DistributedContext, log: Callable[[str], None] = print, notify: Notify | None = None) -> TrainingResult:
    """Run this rank's share of ``job``, from its latest complete checkpoint if it has one; every
    rank returns the same result, rank 0 writes it. ``notify(event, details)`` hears, from the
    process group's rank 0, of the run's start, every step, each checkpoint and its completion,
    and from every rank of failures survived (resilience "recycle")."""
    request, plan = job.request, job.allocation.plan
    if ctx.world_size != plan.gpus:
        raise RuntimeError(f"the plan needs {plan.gpus} ranks but this job has {ctx.world_size}")
    started, notify = time.perf_counter(), notify or (lambda event, details: None)
    if request.resilience == "recycle":
        return _train_through_failures(job, ctx, log, notify, started)
    ctx.init_process_group()
    try:
        engine = _engine(job, ctx)
        # Every rank's reads and writes go through `together`: a rank that cannot reach storage
        # fails the run with its reason, reported by rank 0.
        progress = Progress.start(job, together(ctx, lambda: _resume(job, engine, log)))
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
            timings = _run_steps(job, ctx, engine, data, progress, run_step, log, notify)
        return _result(job, ctx, progress, first, timings, started)
    finally:
        dist.destroy_process_group()


def _train_through_failures(
    job: TrainingJob, ctx: DistributedContext, log: Callable[[str], None], notify: Notify, started: float
) -> TrainingResult:
    """``train`` under ReCycle (``recycle_live``): a first incarnation starts with the job; a
    replacement (incarnation > 0) waits until the members admit it at a step's start and takes
    its stage's state from a live replica, and the steps' progress from the members."""
    check_resilience(job.allocation.plan, job.request.resilience, job.request.master_weights)
    store, incarnation = ctx.rendezvous(), incarnation_from_env()
    heartbeat = Heartbeat(ctx.rendezvous, (ctx.rank, incarnation))
    try:
        if incarnation == 0:
            ctx.init_process_group(store)
            generation = Generation(store, 0, list(range(ctx.world_size)), ctx.rank, dict.fromkeys(range(ctx.world_size), 0))
            engine = _engine(job, ctx)
            progress = Progress.start(job, together(ctx, lambda: _resume(job, engine, log)))
            data = together(ctx, lambda: TokenWindows(job.dataset, job.request.seq_len))
        else:
            data = TokenWindows(job.dataset, job.request.seq_len)  # (before joining: no collective the members are not in)
            admission = await_admission(store, (ctx.rank, incarnation))
            if admission is None:  # the job finished while this replacement waited
                return finished_result(store)
            generation, note = admission
            joined = time.perf_counter()
            engine = _engine(job, ctx, live=generation.members)
            share_from_live_replica(engine, [m for m in generation.members if m not in note["admitted"]], {ctx.rank})
            progress = Progress(**note["progress"])  # (its record ends before this rejoin: added below)
        steps = RecycleSteps(job, engine, generation, notify, log, progress.survived, progress.agree)
        steps.current = progress.next_step
        if incarnation > 0:
            steps.record("rejoined", note["admitted"], time.perf_counter() - joined)
            log(f"rank {ctx.rank} rejoined at step {progress.next_step}")
            notify("rejoined", {"ranks": note["admitted"], "step": progress.next_step})

        def run_step(step: int, data: TokenWindows, progress: Progress) -> float:
            def batches(replica: int) -> list:
                return [tuple(t.to(ctx.device) for t in b) for b in replica_batches(job, data, replica, step)]

            return steps.step(step, batches, lambda: asdict(progress))

        first = progress.next_step
        with closing(data):
            timings = _run_steps(job, ctx, engine, data, progress, run_step, log, notify, steps.survive)
        result = _result(job, ctx, progress, first, timings, started)
        if ctx.rank == steps.generation.members[0]:
            store.set(FINISHED, result.model_dump_json())  # replacements still waiting return it
        return result
    finally:
        heartbeat.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


def _engine(job: TrainingJob, ctx: DistributedContext, live: list[int] | None = None) -> Engine:
    request, plan = job.request, job.allocation.plan
    return Engine(
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
        live=live,
    )


def _result(job: TrainingJob, ctx: DistributedContext, progress: Progress, first: int, timings: dict, started: float) -> TrainingResult:
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
        step_s=timings["step"],
        checkpoint_s=timings["checkpoint"],
        failures=[_with_throughput(record, first, timings["step"], request) for record in progress.survived],
    )
    # metrics.json last: the other ranks wait for rank 0's write
    writes = dist.get_rank() == 0
    together(ctx, (lambda: write_bytes(job.metrics_uri, result.model_dump_json(indent=2).encode())) if writes else lambda: None)
    return result


def _with_throughput(record: dict, first: int, step_s: list[float], request: TrainingRequest) -> SurvivedFailure:
    """A survived failure, with tokens/s over up to 5 steps on each side of it that this rank timed."""
    at = record["step"] - first  # its index in step_s
    before = step_s[max(0, at - 5) : max(0, at)]
    after = step_s[at + 1 : at + 6] if record["kind"] == "failed" else step_s[at : at + 5]

    def rate(times: list[float]) -> float | None:
        return len(times) * request.global_batch * request.seq_len / sum(times) if times else None

    return SurvivedFailure(**record, tokens_per_s_before=rate(before), tokens_per_s_after=rate(after))


def _resume(job: TrainingJob, engine: Engine, log: Callable[[str], None]) -> checkpoint.Manifest | None:
    """Load this run's latest intact checkpoint into ``engine``; returns its manifest, or None.
    A newer one whose manifest is corrupt is named in the log and skipped."""
    found = checkpoint.latest(job.checkpoint_uri, warn=log)
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
    progress: Progress,
    run_step: StepRunner,
    log: Callable[[str], None],
    notify: Notify,
    survive: Survive = lambda action, position, skipped: action(),
) -> dict[str, list[float]]:
    """The steps from ``progress`` on, with periodic checkpoints, each step's loss (averaged over
    the ranks) and checkpoint kept in ``progress``; returns this rank's wall times of each step
    and each checkpoint. ``survive(action)`` runs a checkpoint (ReCycle: again, after a failure
    interrupts it)."""
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
                lambda: _checkpoint(job, ctx, engine, step, progress.losses, timings),  # noqa: B023 (called at once)
                (step, CHECKPOINT),
                lambda: (checkpoint.step_uri(job.checkpoint_uri, step), 0.0, None),  # noqa: B023 (written before a failure)
            )
            log(f"checkpoint of step {step} written to {final} in {save_s:.2f} s")
            if interval is not None and interval != progress.every:
                log(f"checkpointing every {interval} steps (a checkpoint takes {save_s:.2f} s)")
            progress.every, progress.last_saved, progress.final = interval or progress.every, step, final
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
    uri, save_s = together(ctx, lambda: checkpoint.save(engine, job.checkpoint_uri, step, losses, request.keep_checkpoints))
    if request.checkpoint_every is not None or step == request.steps:
        return uri, save_s, None
    step_s = statistics.mean(timings["step"][1:] or timings["step"])  # the steps after the first (which also warms up)
    return uri, save_s, _agreed_interval(ctx, save_s, step_s)


def _agreed_interval(ctx: DistributedContext, save_s: float, step_s: float) -> int:
    """checkpoint_interval of the slowest rank's times, the same on every rank."""
    times = torch.tensor([save_s, step_s], dtype=torch.float64, device=ctx.device)
    if dist.get_world_size() > 1:
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return checkpoint_interval(*times.tolist())
