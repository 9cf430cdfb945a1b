"""The resilient trainer (resilience "recycle"): the plain trainer's steps (``training.trainer``:
the same engine, resume, step loop, checkpoints and result), each run through failures by
``RecycleSteps`` (``steps.py``) on a process group that outlives a dead member (``generations.py``).

A first incarnation starts with the job; a replacement (incarnation > 0, started by its rank's
supervisor, ``supervisor.py``) waits until the members admit it at a step's start, takes its
stage's state from a live replica (``peer_state.py``) and the steps' progress from the members.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import asdict
from datetime import UTC, datetime

import torch.distributed as dist

from frenzy_prefect.spec.layout import check_resilience
from frenzy_prefect.spec.plan import TrainingJob
from frenzy_prefect.spec.result import TrainingResult
from frenzy_prefect.training.data import TokenWindows, replica_batches
from frenzy_prefect.training.distributed import DistributedContext, together
from frenzy_prefect.training.engine import Engine
from frenzy_prefect.training.fence import Fence
from frenzy_prefect.training.resilient.generations import FINISHED, Generation, await_admission, finished_result
from frenzy_prefect.training.resilient.liveness import Heartbeat, incarnation_from_env
from frenzy_prefect.training.resilient.steps import CHECKPOINT, RecycleSteps, share_from_live_replica
from frenzy_prefect.training.trainer import (
    Notify,
    Progress,
    build_engine,
    check_world,
    claim,
    resume,
    run_steps,
    write_checkpoint,
    write_result,
)


def train(job: TrainingJob, ctx: DistributedContext, log: Callable[[str], None] = print, notify: Notify | None = None) -> TrainingResult:
    """Run this rank's share of ``job`` through failures and rejoins; every rank returns the same
    result. ``notify`` hears what the plain trainer's does, and from every rank of the failures
    survived and the rejoins."""
    check_resilience(job.allocation.plan, job.request.resilience, job.request.master_weights)
    check_world(job, ctx)
    started, notify = time.perf_counter(), notify or (lambda event, details: None)
    store, incarnation = ctx.rendezvous(), incarnation_from_env()
    heartbeat = Heartbeat(ctx.rendezvous, (ctx.rank, incarnation))
    try:
        if incarnation == 0:
            held, engine, generation, progress, data = _start(job, ctx, store, log)
        else:
            data = TokenWindows(job.dataset, job.request.seq_len)  # (before joining: no collective the members are not in)
            admission = await_admission(store, (ctx.rank, incarnation))
            if admission is None:  # the job finished while this replacement waited
                return finished_result(store)
            generation, note = admission
            joined = time.perf_counter()
            engine, progress = _join(job, ctx, generation, note, log)
            held = Fence(job.checkpoint_uri, progress.generation, datetime.now(UTC))  # (the members claimed the run)

        def build(job: TrainingJob, rank: int, live: list[int]) -> Engine:
            return build_engine(job, ctx.model_copy(update={"rank": rank}), live)

        def save(step: int) -> None:
            """Step ``step``'s checkpoint, written by the members unless it is (a re-plan resumes from it)."""
            if progress.final is not None and progress.last_saved == step:
                return
            uri, save_s = write_checkpoint(job, ctx, held, steps.engine, step, progress.losses)
            progress.last_saved, progress.final, progress.save_s = step, uri, save_s
            log(f"checkpoint of step {step} written to {uri} in {save_s:.2f} s")

        steps = RecycleSteps(job, engine, generation, notify, log, progress, lambda source: agree(progress, source), build, save)
        steps.current = progress.next_step
        if incarnation > 0:
            steps.record("rejoined", note["admitted"], time.perf_counter() - joined)
            log(f"rank {ctx.rank} rejoined at step {progress.next_step}")
            notify("rejoined", {"ranks": note["admitted"], "step": progress.next_step})

        def run_step(step: int, data: TokenWindows, progress: Progress) -> float:
            def batches(replica: int) -> list:
                return [tuple(t.to(ctx.device) for t in b) for b in replica_batches(steps.job, data, replica, step)]

            return steps.step(step, batches, lambda: asdict(progress))

        def survive(action, step, skipped):
            return steps.survive(action, (step, CHECKPOINT), skipped)

        first = progress.next_step
        with closing(data):
            timings = run_steps(job, ctx, held, lambda: steps.engine, data, progress, run_step, log, notify, survive)
        if timings["step"]:
            each, share = steps.commit_s / len(timings["step"]), steps.commit_s / sum(timings["step"])
            log(f"rank {ctx.rank}: commit points took {1000 * each:.1f} ms a step ({share:.1%} of the steps)")
        result = write_result(job, ctx, progress, first, timings, started)
        if ctx.rank == steps.generation.members[0]:
            store.set(FINISHED, result.model_dump_json())  # replacements still waiting return it
        return result
    finally:
        heartbeat.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


def _start(job: TrainingJob, ctx: DistributedContext, store, log: Callable[[str], None]):
    """The first incarnation: the run claimed (``trainer.claim``), the whole world's process
    group, engine, resumed progress and data."""
    ctx.init_process_group(store)
    generation = Generation(store, 0, list(range(ctx.world_size)), ctx.rank, dict.fromkeys(range(ctx.world_size), 0))
    engine = build_engine(job, ctx)
    data = together(ctx, lambda: TokenWindows(job.dataset, job.request.seq_len))
    held = claim(job, ctx)  # (once its data reads)
    progress = Progress.start(job, together(ctx, lambda: resume(job, engine, log, held)), held.generation)
    return held, engine, generation, progress, data


def _join(job: TrainingJob, ctx: DistributedContext, generation: Generation, note: dict, log: Callable[[str], None]):
    """A replacement admitted into ``generation`` (``note``: what the members told it): its engine,
    with its stage's state from a live replica, or (the members had re-planned, and now resume
    the run's own plan) from the checkpoint they wrote, and the members' progress (whose record
    ends before this rejoin: the caller adds it)."""
    engine = build_engine(job, ctx, live=generation.members)
    if note["reload"]:
        resume(job, engine, log)
    else:
        share_from_live_replica(engine, [m for m in generation.members if m not in note["admitted"]], {ctx.rank})
    return engine, Progress(**note["progress"])


def agree(progress: Progress, source: int) -> None:
    """Take the checkpoint schedule of group rank ``source`` (collective; after a failure
    interrupted a checkpoint that some survivors had completed, and re-agreed its interval)."""
    fields = [progress.every, progress.last_saved, progress.final]
    dist.broadcast_object_list(fields, src=source)
    progress.every, progress.last_saved, progress.final = fields
