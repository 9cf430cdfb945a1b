"""Whether a ReCycle schedule fits the run's GPUs: every live worker's predicted peak under it
(``pipeline.in_flight.schedule_peaks``, on the allocation's GPU type) within the memory the
allocator fitted the plan to, less its margin. The live runtime checks each schedule it switches
to. The allocator fits a recycle plan for ``recycle_failures`` failed workers in a stage
(``analytic.recycle_estimate``); past that, the planner's schedule may need more than a
survivor's GPU holds, and running it would fail mid-step out of memory.

ReCycle's planner defers W's as far as it can, so its schedules hold every micro-batch in flight
whether or not that buys time. A schedule that does not fit is planned again under an in-flight
bound (at most k micro-batches between F and W per worker), the loosest that fits: on gpt-nano,
dp 2 x pp 2 with 4 micro-batches, bounds down to 2 cost the re-routed schedule no time and cut its
largest peak by half. Only when not even one micro-batch in flight fits do the survivors restart
from the last checkpoint instead, saying why."""

from __future__ import annotations

from collections.abc import Iterable

from frenzy_prefect.pipeline.in_flight import in_flight_peak, schedule_peaks
from frenzy_prefect.pipeline.schedule import Schedule
from frenzy_prefect.pipeline.workers import Worker
from frenzy_prefect.recycle.cache import PlanCache
from frenzy_prefect.recycle.failures import RecycleInputError
from frenzy_prefect.spec.gpu import GpuType
from frenzy_prefect.spec.plan import TrainingJob
from frenzy_prefect.units import gib


class ScheduleWouldNotFit(RecycleInputError):
    """Re-routing around these failures needs more memory than a survivor's GPU holds for the run:
    only a restart from a checkpoint (every rank back, the fault-free schedule) can go on."""


def run_gpu(job: TrainingJob) -> GpuType:
    """The GPU type the run was allocated."""
    return next(job.cluster.gpu_of(n) for n in job.cluster.nodes if n.gpu_type == job.allocation.gpu_type)


def overflow(job: TrainingJob, schedule: Schedule) -> str | None:
    """What ``schedule`` would need beyond the run's GPU memory, naming the worker and both
    figures; None when it fits."""
    allocation, gpu = job.allocation, run_gpu(job)
    budget = allocation.gpu_memory_bytes - allocation.margin_bytes
    peaks = schedule_peaks(job.model, allocation.plan, job.request.workload, schedule, gpu)
    (pipeline, stage), peak = max(peaks.items(), key=lambda item: item[1])
    if peak <= budget:
        return None
    return (
        f"ReCycle's schedule for the live workers would need {gib(peak)} GiB on the worker of pipeline {pipeline}, stage "
        f"{stage}, more than the {gib(budget)} GiB its {allocation.gpu_type} holds for the run (memory less margin)"
    )


def fitting_schedule(job: TrainingJob, cache: PlanCache, failed: Iterable[Worker]) -> tuple[Schedule, int | None]:
    """The schedule the live workers run around ``failed`` and its in-flight bound (None: the
    cache's own plan fits). Peaks fall as the bound tightens, so the loosest fitting one is found
    by bisection, a few plans of one key; ScheduleWouldNotFit when a bound of 1 does not fit."""
    failed = frozenset(failed)

    def schedule(in_flight: int | None) -> Schedule:
        found = cache.lookup(failed, in_flight)  # NeedsCheckpointRestart when a stage has no replica left
        return found.plan.schedule.relabelled(found.pipeline_maps)

    unbounded = schedule(None)
    short = overflow(job, unbounded)
    if short is None:
        return unbounded, None
    best: tuple[Schedule, int] | None = None
    low, high = 1, max(in_flight_peak(unbounded, w) for w in unbounded.programs) - 1
    while low <= high:  # when no bound fits, the last one tried is 1
        middle = (low + high) // 2
        candidate = schedule(middle)
        if (why := overflow(job, candidate)) is None:
            best, low = (candidate, middle), middle + 1
        else:
            short, high = why, middle - 1
    if best is None:
        raise ScheduleWouldNotFit(f"{short}, even with one micro-batch in flight per worker: restarting from the last checkpoint")
    return best
