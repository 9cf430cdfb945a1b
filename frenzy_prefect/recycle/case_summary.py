"""One failure case planned and summarised (what `frenzy recycle plan` prints): per
stage the live workers, micro-batches each and bubble share; the iteration time and throughput
relative to the same planner's schedule without failures, one iteration alone and back to back;
the planner's time."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from frenzy_prefect.pipeline.in_flight import schedule_peaks
from frenzy_prefect.pipeline.schedule import Schedule
from frenzy_prefect.pipeline.timeline import run_timeline, steady_state_period_s
from frenzy_prefect.recycle.failures import key_from_stages
from frenzy_prefect.recycle.fault_free import costs_from_fault_free_step
from frenzy_prefect.recycle.planners import fault_free_plan, planner
from frenzy_prefect.spec.gpu import GpuType, MemoryMargin
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.workload import Workload


@dataclass(frozen=True)
class WorkerMemory:
    """What to predict workers' peaks for: a model and workload, micro-batches of ``micro_batch``
    sequences (ZeRO 0, tp 1, no recomputation: what ReCycle runs), on ``gpu`` (None: the tensors alone)."""

    model: ModelSpec
    work: Workload
    micro_batch: int
    gpu: GpuType | None

    def peaks(self, dp: int, pp: int, schedule: Schedule) -> dict[tuple[int, int], int]:
        return schedule_peaks(self.model, ParallelPlan(dp=dp, pp=pp, micro_batch=self.micro_batch), self.work, schedule, self.gpu)

    @property
    def usable_bytes(self) -> int | None:
        """What a worker's peak may reach on ``gpu``: its memory less the default margin (None without a GPU)."""
        return None if self.gpu is None else self.gpu.memory_bytes - MemoryMargin().bytes_for(self.gpu.memory_bytes)

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "micro_batch": self.micro_batch,
            "seq_len": self.work.seq_len,
            "precision": self.work.precision,
            "gpu": self.gpu.name if self.gpu else None,
            "gpu_memory_bytes": self.gpu.memory_bytes if self.gpu else None,
            "usable_bytes": self.usable_bytes,
        }


def plan_case(
    dp: int,
    pp: int,
    microbatches: int,
    failed_stages: Iterable[int],
    *,
    planner_name: str = "heuristic",
    step_s: float = 1.0,
    memory_bound: int | None = None,
    actions: bool = False,
    memory: WorkerMemory | None = None,
) -> dict[str, Any]:
    """Plan the case where workers of ``failed_stages`` (0-based, one entry per failed worker) are
    gone, with F:B:W costs such that the schedule without failures (under the memory bound) lasts
    ``step_s`` seconds; both throughputs are relative to the planner's schedule without failures.
    The result is the `recycle plan --json` schema; with ``actions``, also every worker's action
    list; with ``memory``, every live worker's predicted peak (``in_flight.schedule_peaks``)."""
    run = planner(planner_name)
    costs = costs_from_fault_free_step(step_s, dp, pp, microbatches, memory_bound=memory_bound)
    key = key_from_stages(dp, pp, failed_stages)
    result = run(dp, pp, microbatches, key, costs, memory_bound)
    baseline = result if not any(result.key) else fault_free_plan(planner_name, dp, pp, microbatches, costs, memory_bound)
    timeline = run_timeline(result.schedule, costs)
    period = steady_state_period_s(result.schedule, costs)
    fault_free_period = steady_state_period_s(baseline.schedule, costs)
    peaks = memory.peaks(dp, pp, result.schedule) if memory else None
    stages = []
    for s in range(pp):
        live = result.schedule.live(s)
        stages.append(
            {
                "stage": s,
                "live_workers": len(live),
                "microbatches_per_worker": [result.schedule.compute_counts((p, s)) for p in live],
                "bubble_fraction": sum(timeline.bubble_fraction((p, s)) for p in live) / len(live),
            }
            | ({"peak_bytes_per_worker": [peaks[p, s] for p in live]} if peaks else {})
            | ({"fits_per_worker": [peaks[p, s] <= memory.usable_bytes for p in live]} if peaks and memory.usable_bytes else {})
        )
    out = {
        "dp": dp,
        "pp": pp,
        "microbatches": microbatches,
        "failures_per_stage": list(key),
        "planner": result.planner,
        "status": result.status,
        "mip_gap": result.mip_gap,
        "iteration_s": result.iteration_s,
        "fault_free_s": result.fault_free_s,
        "relative_throughput": result.relative_throughput,
        "planner_wall_s": result.planner_wall_s,
        "memory_bound": memory_bound,
        "steady_state_period_s": period,
        "steady_state_relative_throughput": fault_free_period / period,
        "stages": stages,
    }
    if memory:
        out["memory"] = memory.describe()
    if actions:
        out["actions"] = {f"{p},{s}": result.schedule.render((p, s)) for p, s in sorted(result.schedule.programs)}
    return out
