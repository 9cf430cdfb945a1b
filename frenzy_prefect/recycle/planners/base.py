"""What every ReCycle planner returns, and the parts they share: the work each live worker hosts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache, wraps
from typing import Literal

from pydantic import BaseModel, ConfigDict

from frenzy_prefect.pipeline.costs import StageCosts
from frenzy_prefect.pipeline.in_flight import MemoryBound, bounds_per_stage
from frenzy_prefect.pipeline.schedule import Schedule
from frenzy_prefect.pipeline.timeline import Timeline
from frenzy_prefect.pipeline.workers import Worker, check_shape, live_pipelines
from frenzy_prefect.recycle.failures import FailureKey, canonical_failed, check_key, reroute

Status = Literal["heuristic", "optimal", "time_limit"]


class Plan(BaseModel):
    """A schedule for one failure key (on its canonical failed workers) and what it achieves."""

    model_config = ConfigDict(frozen=True)

    key: FailureKey
    schedule: Schedule
    iteration_s: float  # the schedule's timeline makespan (timeline.py defines it)
    fault_free_s: float  # the same planner's iteration with no failures, same costs and memory bound (``against_fault_free``)
    planner: str
    planner_wall_s: float
    status: Status
    mip_gap: float | None = None  # MILP: (iteration - HiGHS's bound for this F/B order) / iteration
    lower_bound_s: float = 0.0  # no schedule of this failure key can be faster (Problem.lower_bound_s)

    @property
    def relative_throughput(self) -> float:
        """Iterations per second relative to the same planner's schedule without failures (1.0: no loss)."""
        return self.fault_free_s / self.iteration_s


class Problem:
    """One planning problem after its inputs are checked: who is alive, what each live worker hosts
    (its own micro-batches, then re-routed ones), and the in-flight cap of each stage."""

    def __init__(self, dp: int, pp: int, microbatches: int, failures_per_stage, costs: StageCosts, memory_bound: MemoryBound):
        check_shape(dp, pp, microbatches)
        costs.check_stages(pp)
        self.dp, self.pp, self.m, self.costs = dp, pp, microbatches, costs
        self.key = check_key(dp, pp, failures_per_stage)
        self.failed = canonical_failed(dp, self.key)
        self.host = reroute(dp, pp, microbatches, self.failed)
        self.bounds = bounds_per_stage(memory_bound, pp)
        self.hosted: dict[Worker, list[tuple[int, int]]] = {}
        for s in range(pp):
            for p in live_pipelines(dp, self.failed, s):
                self.hosted[(p, s)] = [(p, j) for j in range(microbatches)]
        for (q, j, s), p in sorted(self.host.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            self.hosted[(p, s)].append((q, j))

    def runs_on(self, q: int, j: int, s: int) -> int:
        return self.host.get((q, j, s), q)

    def cap(self, stage: int, wanted: int) -> int:
        return wanted if self.bounds is None else min(wanted, self.bounds[stage])

    def lower_bound_s(self) -> float:
        """A bound every schedule obeys, whatever its order and re-routing: a worker of stage s
        cannot start before a micro-batch has passed the stages before it, must then run F, B and W
        of every micro-batch it hosts (balanced hosting minimises the most loaded), and its stage
        then all-reduces and steps; nor can an iteration beat one micro-batch's round trip."""
        c = self.costs
        fill = [sum(c.forward_s[:s]) + s * c.p2p_s for s in range(self.pp)]
        live = {s: sum(1 for w in self.hosted if w[1] == s) for s in range(self.pp)}
        tail = [c.allreduce_s(s, live[s]) + c.optimizer_s[s] for s in range(self.pp)]
        work = max(
            fill[s] + len(mbs) * (c.forward_s[s] + c.backward_input_s[s] + c.backward_weight_s[s]) + tail[s]
            for (_, s), mbs in self.hosted.items()
        )
        trip = sum(c.forward_s) + sum(c.backward_input_s) + 2 * (self.pp - 1) * c.p2p_s + c.backward_weight_s[0] + tail[0]
        return max(work, trip)

    def result(self, schedule: Schedule, timeline: Timeline, planner: str, wall_s: float, status: Status, gap: float | None = None) -> Plan:
        """The plan, as its own baseline: ``against_fault_free`` gives a failure key's plan the no-failure one's."""
        return Plan(
            key=self.key,
            schedule=schedule,
            iteration_s=timeline.iteration_s,
            fault_free_s=timeline.iteration_s,
            planner=planner,
            planner_wall_s=wall_s,
            status=status,
            mip_gap=gap,
            lower_bound_s=self.lower_bound_s(),
        )


PlanFunction = Callable[..., Plan]


def against_fault_free(plan_fn: PlanFunction) -> PlanFunction:
    """A planner whose plans are measured against its own plan with no failures, on the same shape,
    costs and memory bound: what failures cost is then all that relative throughput shows (against
    plain 1F1B, a plan of no failures would reach 110%: the planner defers W into bubbles, as it
    does under failures). A plan of no failures is its own baseline, exactly 100%. The baseline is
    planned once per shape, costs and bound (``plan.fault_free``)."""

    @lru_cache(maxsize=64)
    def planned(dp: int, pp: int, microbatches: int, costs: StageCosts, bound: int | tuple[int, ...] | None) -> Plan:
        return plan_fn(dp, pp, microbatches, (0,) * pp, costs, bound)

    def fault_free(dp: int, pp: int, microbatches: int, costs: StageCosts, memory_bound: MemoryBound = None) -> Plan:
        return planned(dp, pp, microbatches, costs, tuple(memory_bound) if isinstance(memory_bound, Sequence) else memory_bound)

    @wraps(plan_fn)
    def plan(dp: int, pp: int, microbatches: int, failures_per_stage, costs: StageCosts, memory_bound: MemoryBound = None, **kw) -> Plan:
        result = plan_fn(dp, pp, microbatches, failures_per_stage, costs, memory_bound, **kw)
        if not any(result.key):
            return result
        return result.model_copy(update={"fault_free_s": fault_free(dp, pp, microbatches, costs, memory_bound).iteration_s})

    plan.fault_free = fault_free  # type: ignore[attr-defined]
    return plan
