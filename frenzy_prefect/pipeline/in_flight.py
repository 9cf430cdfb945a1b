"""How many micro-batches a worker holds in flight under a schedule, and what that makes its peak (MARP per worker).

In flight on a worker: a micro-batch whose F ran there and whose W has not yet. Zero Bubble's
split keeps the stage's inputs (and the activations W needs) until W, so W, not B, frees it;
counted in program order, so it does not depend on timing. Fault-free 1F1B holds pp - s at stage s.
"""

from __future__ import annotations

from collections.abc import Sequence

from frenzy_prefect.memory.analytic import on_device, plan_search, waiting_for_w_bytes
from frenzy_prefect.pipeline.schedule import Action, Schedule, fused_backwards
from frenzy_prefect.pipeline.workers import ScheduleInputError, Worker
from frenzy_prefect.spec.gpu import GpuType
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.workload import Workload

MemoryBound = int | Sequence[int] | None


def bounds_per_stage(memory_bound: MemoryBound, pp: int) -> list[int] | None:
    """One bound per stage from an int (every stage), a per-stage list, or None (unbounded)."""
    if memory_bound is None:
        return None
    bounds = [memory_bound] * pp if isinstance(memory_bound, int) else list(memory_bound)
    if len(bounds) != pp or any(not isinstance(b, int) or b < 1 for b in bounds):
        raise ScheduleInputError(f"memory_bound must be a positive int or {pp} positive ints (one per stage), got {memory_bound!r}")
    return bounds


def in_flight_peak(schedule: Schedule, worker: Worker) -> int:
    """The most micro-batches ``worker`` holds at once (F done, W not yet)."""
    held = peak = 0
    for a in schedule.programs.get(worker, ()):
        if a.kind == "F":
            held += 1
            peak = max(peak, held)
        elif a.kind == "W":
            held -= 1
    return peak


def schedule_peaks(
    model: ModelSpec, plan: ParallelPlan, work: Workload, schedule: Schedule, gpu: GpuType | None = None
) -> dict[Worker, int]:
    """MARP's peak of every worker that runs something in ``schedule`` (ReCycle's, fault-free or
    re-routed around failed workers), the larger of two moments:

    - within an action: its stage's estimate with the micro-batches it holds in flight at most
      (F done, W not) and runs in the step, each holding its saved activations;
    - between actions, where a split backward's deferred W's pile up: every micro-batch between
      its F and its B holds its saved activations, every one between its B and a W that does not
      follow at once holds them too (less the loss's logits on the last stage, freed by B) and the
      gradients its W needs (``deferred_weight_grad_bytes``); the most, over the program.

    ``gpu`` None: the tensors alone (as MemTracker measures them); else the planner's figure on
    that GPU (``on_device``)."""
    search = plan_search(model, work, gpu)
    terms, shapes = search.shared(plan)
    peaks = {}
    for (pipeline, stage), program in sorted(schedule.programs.items()):
        runs = sum(a.kind == "F" for a in program)
        if not runs:
            continue
        within = search.stage_peaks(plan, (stage,), {stage: (in_flight_peak(schedule, (pipeline, stage)), runs)})[0]
        params, grads, optimizer, _, _ = within
        micro = shapes[stage].micro
        waiting = waiting_for_w_bytes(model, plan, work, terms, micro, stage)
        between = params + grads + optimizer + runs * terms.ids + held_bytes(program, micro, waiting)
        tensors = max(sum(within), between)
        peaks[pipeline, stage] = tensors if gpu is None else on_device(tensors, plan, gpu)
    return peaks


def held_bytes(program: Sequence[Action], forwarded: int, deferred: int) -> int:
    """The most a program holds between its actions: ``forwarded`` bytes per micro-batch between
    its F and its B, ``deferred`` per one between its B and a W that does not follow it at once."""
    fused = fused_backwards(program)
    after_f = after_b = peak = 0
    for a in program:
        if a.kind == "F":
            after_f += 1
        elif a.kind == "B":
            after_f -= 1
            after_b += (a.pipeline, a.micro) not in fused
        elif a.kind == "W":
            after_b -= (a.pipeline, a.micro) not in fused
        peak = max(peak, after_f * forwarded + after_b * deferred)
    return peak
