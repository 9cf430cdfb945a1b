"""Measured peak memory: a plan executed by the training engine on real ranks, each rank's
tensor storage tracked by torch's MemTracker over three optimizer steps (from the second on, the
steady state: optimizer states exist, gradient buffers persist, ZeRO-3 keeps its gathered weights).

``measure`` starts one process per GPU of the plan with torchrun; each rank writes its peak, by
category, to a file the caller collects. On CUDA the allocator's own peaks are recorded too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.pipeline.costs import StageCosts
from frenzy_prefect.pipeline.schedule import Schedule
from frenzy_prefect.spec.layout import check_engine_plan
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import MemoryBreakdown, ParallelPlan
from frenzy_prefect.spec.workload import Workload
from frenzy_prefect.torch_private import MemRefType, StepTracker
from frenzy_prefect.training.distributed import DistributedContext

STEPS = 3
CATEGORIES = {
    MemRefType.PARAM: "params",
    MemRefType.BUFFER: "params",
    MemRefType.GRAD: "grads",
    MemRefType.OPT: "optimizer",
    MemRefType.ACT: "activations",
    MemRefType.TEMP: "other",
    MemRefType.OTH: "other",
}


class Measurement(BaseModel):
    """What one measurement runs: the model, the plan and the workload."""

    model_config = ConfigDict(frozen=True)

    model: ModelSpec
    plan: ParallelPlan
    work: Workload
    recycle_failed: tuple[tuple[NonNegativeInt, NonNegativeInt], ...] | None = Field(
        default=None,
        description="Run ReCycle's schedule (the live runtime's) around these failed (pipeline, stage) workers; () fault-free.",
    )


class RankMemory(BaseModel):
    rank: NonNegativeInt
    stage: NonNegativeInt
    breakdown: MemoryBreakdown = Field(description="Tensor storage at the peak, by category (MemTracker).")
    cuda_max_allocated: NonNegativeInt | None = None
    cuda_max_reserved: NonNegativeInt | None = None
    cuda_outside_torch: NonNegativeInt | None = Field(
        default=None, description="Device memory in use that torch's allocator does not hold: CUDA context, library workspaces."
    )

    @property
    def device_peak(self) -> int | None:
        """What the GPU had to hold at the peak: the allocator's reserved peak plus the rest."""
        if self.cuda_max_reserved is None:
            return None
        return self.cuda_max_reserved + (self.cuda_outside_torch or 0)


def peak_breakdown(tracker: StepTracker, device: torch.device) -> MemoryBreakdown:
    snapshot = tracker.get_tracker_snapshot("peak").get(device, {})
    parts = dict.fromkeys(("params", "grads", "optimizer", "activations", "other"), 0)
    for reftype, field in CATEGORIES.items():
        parts[field] += snapshot.get(reftype, 0)
    return MemoryBreakdown(**parts)


def measure_rank(measurement: Measurement, ctx: DistributedContext) -> RankMemory:
    """Run this rank's share of ``measurement`` for STEPS optimizer steps under the tracker."""
    from frenzy_prefect.training.engine import Engine

    model, plan, work = measurement.model, measurement.plan, measurement.work
    accumulation = plan.replica_accumulation(work.global_batch)[plan.coordinates(ctx.rank)[1]]
    device = ctx.device
    tracker = StepTracker()
    generator = torch.Generator().manual_seed(ctx.rank)
    with tracker:  # from before DeepSpeed's initialize, which allocates its flat buffers
        engine = Engine(model, plan, work, rank=ctx.rank, device=device)
        tracker.track_modules(engine.model)
        tracker.track_external(engine.optimizer, *([engine.optimizer.optim] if hasattr(engine.optimizer, "optim") else []))
        tracker.categorise((master for _, master in engine.masters), MemRefType.OPT)  # fp32 master weights: optimizer state
        if engine.main_grads:
            tracker.categorise((p.main_grad for p in engine.model.parameters()), MemRefType.GRAD)  # fp32 main gradients
        tracker.restart_peak()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if measurement.recycle_failed is None:
            for _ in range(STEPS):
                batches = []
                for _ in range(accumulation):
                    ids = torch.randint(0, model.vocab_size, (plan.micro_batch, work.seq_len + 1), generator=generator).to(device)
                    batches.append((ids[:, :-1], ids[:, 1:]))
                engine.step(batches)
        else:
            _recycle_steps(measurement, engine, ctx)
    stage, _, _ = plan.coordinates(ctx.rank)
    result = RankMemory(rank=ctx.rank, stage=stage, breakdown=peak_breakdown(tracker, device))
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        result.cuda_max_allocated = torch.cuda.max_memory_allocated(device)
        result.cuda_max_reserved = torch.cuda.max_memory_reserved(device)
        result.cuda_outside_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    return result


def _recycle_steps(measurement: Measurement, engine, ctx: DistributedContext) -> None:
    """STEPS steps of ReCycle's schedule around the failed workers. Every rank draws any
    pipeline's micro-batch alike (seeded by step, pipeline and index), its own up front and the
    others' it runs (a failed peer's) when first asked for, each kept to the step's end, as the
    live runtime's reader keeps them."""
    model, plan, work = measurement.model, measurement.plan, measurement.work
    accumulation = plan.replica_accumulation(work.global_batch)[plan.coordinates(ctx.rank)[1]]
    schedule = recycle_schedule(plan, accumulation, measurement.recycle_failed or ())
    _, replica, _ = plan.coordinates(ctx.rank)
    for step in range(STEPS):
        drawn: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

        def micro_batch(pipeline: int, index: int, step: int = step, drawn: dict = drawn) -> tuple[torch.Tensor, torch.Tensor]:
            if (pipeline, index) not in drawn:
                seeded = torch.Generator().manual_seed(step * 1_000_003 + pipeline * 1_009 + index)
                ids = torch.randint(0, model.vocab_size, (plan.micro_batch, work.seq_len + 1), generator=seeded).to(ctx.device)
                drawn[pipeline, index] = (ids[:, :-1], ids[:, 1:])
            return drawn[pipeline, index]

        engine.step([micro_batch(replica, j) for j in range(accumulation)], schedule=schedule, source=micro_batch)


def recycle_schedule(plan: ParallelPlan, micro_batches: int, failed: Iterable[tuple[int, int]]) -> Schedule:
    """The schedule ReCycle's live runtime runs around ``failed`` workers (its planner, uniform costs)."""
    from frenzy_prefect.recycle.cache import PlanCache

    found = PlanCache(plan.dp, plan.pp, micro_batches, StageCosts.uniform(plan.pp), plan_on_demand=True).lookup(failed)
    return found.plan.schedule.relabelled(found.pipeline_maps)


def measure(measurement: Measurement, timeout_s: float = 600) -> list[RankMemory]:
    """Execute ``measurement`` on plan.gpus local processes; every rank's measured peak, by rank."""
    plan, work = measurement.plan, measurement.work
    check_engine_plan(measurement.model, plan, work.precision, work.master_weights)
    plan.accumulation(work.global_batch)
    if torch.cuda.is_available() and plan.gpus > torch.cuda.device_count():
        raise FrenzyError(f"the plan needs {plan.gpus} GPUs and this machine has {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="frenzy-measure-") as out:
        (Path(out) / "work.json").write_text(measurement.model_dump_json())
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={plan.gpus}",
            "-m",
            "frenzy_prefect.training.measure",
            out,
        ]
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
        results = sorted(Path(out).glob("rank-*.json"))
        if done.returncode != 0 or len(results) != plan.gpus:
            tail = "\n".join(done.stderr.strip().splitlines()[-15:])
            raise FrenzyError(f"measuring {plan.label()} failed (exit {done.returncode}):\n{tail}")
        return sorted((RankMemory.model_validate_json(f.read_text()) for f in results), key=lambda r: r.rank)


def main() -> None:
    out = Path(sys.argv[1])
    measurement = Measurement.model_validate_json((out / "work.json").read_text())
    ctx = DistributedContext.from_env()
    ctx.init_process_group()
    try:
        result = measure_rank(measurement, ctx)
        torch.distributed.barrier()  # no rank closes its connections while a peer still uses them
    finally:
        torch.distributed.destroy_process_group()
    (out / f"rank-{ctx.rank:05d}.json").write_text(result.model_dump_json())


if __name__ == "__main__":
    main()
