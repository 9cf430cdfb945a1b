"""Whether a ReCycle schedule fits the run's GPUs: every live worker's predicted peak under it
(``pipeline.in_flight.schedule_peaks``, on the allocation's GPU type) within the memory the
allocator fitted the plan to, less its margin. The live runtime checks each schedule it switches
to. The allocator fits a recycle plan for ``recycle_failures`` failed workers in a stage
(``analytic.recycle_estimate``); past that, re-routing may need more than a survivor's GPU holds,
and running it would fail mid-step out of memory: the survivors restart from the last checkpoint
instead, saying why."""

from __future__ import annotations

from frenzy_prefect.pipeline.in_flight import schedule_peaks
from frenzy_prefect.pipeline.schedule import Schedule
from frenzy_prefect.recycle.failures import RecycleInputError
from frenzy_prefect.spec.plan import TrainingJob
from frenzy_prefect.units import gib


class ScheduleWouldNotFit(RecycleInputError):
    """Re-routing around these failures needs more memory than a survivor's GPU holds for the run:
    only a restart from a checkpoint (every rank back, the fault-free schedule) can go on."""


def check_fits(job: TrainingJob, schedule: Schedule) -> None:
    """Raise ScheduleWouldNotFit, naming the worker and both figures, when ``schedule`` does not fit."""
    allocation = job.allocation
    gpu = next(job.cluster.gpu_of(n) for n in job.cluster.nodes if n.gpu_type == allocation.gpu_type)
    budget = allocation.gpu_memory_bytes - allocation.margin_bytes
    peaks = schedule_peaks(job.model, allocation.plan, job.request.workload, schedule, gpu)
    (pipeline, stage), peak = max(peaks.items(), key=lambda item: item[1])
    if peak > budget:
        raise ScheduleWouldNotFit(
            f"ReCycle's schedule for the live workers would need {gib(peak)} GiB on the worker of pipeline {pipeline}, stage "
            f"{stage}, more than the {gib(budget)} GiB its {allocation.gpu_type} holds for the run (memory less margin): "
            "restarting from the last checkpoint"
        )
