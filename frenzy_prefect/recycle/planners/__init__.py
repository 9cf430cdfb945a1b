"""ReCycle planners behind one interface: ``plan(dp, pp, microbatches, failures_per_stage, costs,
memory_bound=None) -> Plan``, on the canonical failed workers of the failure key."""

from __future__ import annotations

from collections.abc import Callable

from frenzy_prefect.recycle.failures import RecycleInputError
from frenzy_prefect.recycle.planners import heuristic, milp
from frenzy_prefect.recycle.planners.base import Plan

PLANNERS: dict[str, Callable[..., Plan]] = {"heuristic": heuristic.plan, "milp": milp.plan}


def planner(name: str) -> Callable[..., Plan]:
    if name not in PLANNERS:
        raise RecycleInputError(f"unknown planner {name!r}; known: {', '.join(PLANNERS)}")
    return PLANNERS[name]


__all__ = ["PLANNERS", "Plan", "planner"]
