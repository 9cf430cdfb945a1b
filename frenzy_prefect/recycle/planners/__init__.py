"""ReCycle planners behind one interface: ``plan(dp, pp, microbatches, failures_per_stage, costs,
memory_bound=None) -> Plan``, on the canonical failed workers of the failure key, measured against
the same planner's plan without failures (``fault_free_plan``)."""

from __future__ import annotations

from collections.abc import Callable

from frenzy_prefect.pipeline.costs import StageCosts
from frenzy_prefect.pipeline.in_flight import MemoryBound
from frenzy_prefect.recycle.failures import RecycleInputError
from frenzy_prefect.recycle.planners import heuristic, milp
from frenzy_prefect.recycle.planners.base import Plan

PLANNERS: dict[str, Callable[..., Plan]] = {"heuristic": heuristic.plan, "milp": milp.plan}


def planner(name: str) -> Callable[..., Plan]:
    if name not in PLANNERS:
        raise RecycleInputError(f"unknown planner {name!r}; known: {', '.join(PLANNERS)}")
    return PLANNERS[name]


def fault_free_plan(name: str, dp: int, pp: int, microbatches: int, costs: StageCosts, memory_bound: MemoryBound = None) -> Plan:
    """The planner's plan without failures: its plans' baseline (planned once per shape, costs and bound)."""
    return planner(name).fault_free(dp, pp, microbatches, costs, memory_bound)  # type: ignore[attr-defined]


__all__ = ["PLANNERS", "Plan", "fault_free_plan", "planner"]
