"""Plans precomputed for every failure key up to k failures, looked up at run time.

Planning takes up to seconds; a failure must be answered in milliseconds. Every key with at most
``max_failures`` failures in total (and a live replica left in every stage) is planned once;
``lookup`` normalises the failed set to its key (counting failures per stage) and returns the
key's plan with, per stage, the map from the plan's canonical pipelines to the actual ones
(``Schedule.relabelled`` applies it; kept apart so the lookup itself is a dict access).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import NamedTuple

from frenzy_prefect.pipeline.costs import StageCosts
from frenzy_prefect.pipeline.in_flight import MemoryBound
from frenzy_prefect.pipeline.workers import Worker
from frenzy_prefect.recycle.failures import FailureKey, RecycleInputError, check_key, normalise, pipeline_maps
from frenzy_prefect.recycle.planners import Plan, planner


class Lookup(NamedTuple):
    key: FailureKey
    plan: Plan
    pipeline_maps: tuple[tuple[int, ...], ...]  # [stage][canonical pipeline] -> actual pipeline


def failure_keys(dp: int, pp: int, max_failures: int) -> list[FailureKey]:
    """Every key with 0..max_failures failures in total and fewer than dp in any stage."""
    most = min(max_failures, dp - 1)
    keys = [k for k in itertools.product(range(most + 1), repeat=pp) if sum(k) <= max_failures]
    return sorted(keys, key=lambda k: (sum(k), [-c for c in k]))


class PlanCache:
    """``plan_on_demand``: a key beyond ``max_failures`` is planned when first asked for and kept
    (for simulations, which meet many keys; a training run precomputes what it may need)."""

    def __init__(
        self,
        dp: int,
        pp: int,
        microbatches: int,
        costs: StageCosts,
        *,
        max_failures: int = 1,
        planner_name: str = "heuristic",
        memory_bound: MemoryBound = None,
        plan_on_demand: bool = False,
    ) -> None:
        if max_failures < 0:
            raise RecycleInputError(f"max_failures must be >= 0, got {max_failures}")
        self.dp, self.pp, self.microbatches, self.max_failures = dp, pp, microbatches, max_failures
        self.plan_on_demand = plan_on_demand
        self._plan_key = lambda key, bound=memory_bound: planner(planner_name)(dp, pp, microbatches, key, costs, bound)
        self.plans: dict[FailureKey, Plan] = {key: self._plan_key(key) for key in failure_keys(dp, pp, max_failures)}
        self.bounded: dict[tuple[FailureKey, int], Plan] = {}  # keys planned again under a tighter in-flight bound

    def __len__(self) -> int:
        return len(self.plans)

    def plan(self, failures_per_stage: Iterable[int]) -> Plan:
        """The plan of a failure key (failures per stage), without the relabelling."""
        key = check_key(self.dp, self.pp, failures_per_stage)
        if key not in self.plans and self.plan_on_demand:
            self.plans[key] = self._plan_key(key)
        if key not in self.plans:
            raise RecycleInputError(
                f"no precomputed plan for failures per stage {key} ({sum(key)} failures); this cache covers up to {self.max_failures}"
            )
        return self.plans[key]

    def rerouted_s(self, failures_per_stage: tuple[int, ...]) -> float:
        """The iteration time under these failures per stage: what the failure replay's
        IterationTimes takes as ``reroute``."""
        return self.plan(failures_per_stage).iteration_s

    def lookup(self, failed: Iterable[Worker], in_flight: int | None = None) -> Lookup:
        """The plan for these failed (pipeline, stage) workers; NeedsCheckpointRestart when a stage
        has no live replica, RecycleInputError when the failures exceed what was precomputed.
        ``in_flight``: the key planned again with at most that many micro-batches in flight per
        worker (on first use, then kept), for when the cached plan holds more than a GPU does."""
        failed = frozenset(failed)
        key = normalise(self.dp, self.pp, failed)
        if in_flight is None:
            plan = self.plans.get(key) or self.plan(key)
        elif (plan := self.bounded.get((key, in_flight))) is None:
            plan = self.bounded[key, in_flight] = self._plan_key(key, in_flight)
        return Lookup(key, plan, pipeline_maps(self.dp, failed, key))
