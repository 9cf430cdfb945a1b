"""One failure case planned and summarised (what `frenzy recycle plan` prints): per
stage the live workers, micro-batches each and bubble share; the iteration time and throughput
relative to fault-free 1F1B, one iteration alone and back to back; the planner's time."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from frenzy_prefect.pipeline.builder import one_f_one_b
from frenzy_prefect.pipeline.timeline import run_timeline, steady_state_period_s
from frenzy_prefect.recycle.failures import key_from_stages
from frenzy_prefect.recycle.fault_free import costs_from_fault_free_step
from frenzy_prefect.recycle.planners import planner


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
) -> dict[str, Any]:
    """Plan the case where workers of ``failed_stages`` (0-based, one entry per failed worker) are
    gone, with F:B:W costs following from a fault-free iteration of ``step_s`` seconds. The result
    is the `recycle plan --json` schema; with ``actions``, also every worker's action list."""
    run = planner(planner_name)
    costs = costs_from_fault_free_step(step_s, dp, pp, microbatches)
    key = key_from_stages(dp, pp, failed_stages)
    result = run(dp, pp, microbatches, key, costs, memory_bound)
    timeline = run_timeline(result.schedule, costs)
    period = steady_state_period_s(result.schedule, costs)
    fault_free_period = steady_state_period_s(one_f_one_b(dp, pp, microbatches), costs)
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
    if actions:
        out["actions"] = {f"{p},{s}": result.schedule.render((p, s)) for p, s in sorted(result.schedule.programs)}
    return out
