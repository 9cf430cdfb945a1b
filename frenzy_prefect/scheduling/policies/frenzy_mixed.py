"""``frenzy-mixed``: ``frenzy`` that may also start a job across two GPU types (issue 31).

The rules are frenzy's, and a job's single-type plans come first: only when none of them can
start now (the free GPUs of no one type hold one, or backfilling forbids it) does the job try
the plans across two of the types with free GPUs (``allocator.mixed``: stages or replicas dealt
by each type's speed within its memory), in the objective's order. Such a plan must
fit every stage or replica (with what the job's out-of-memory runs proved of its estimates), end
within the job's stretch bound, be efficient, leave the blocked job's reservation whole, and end
before the job would by waiting for one type (its smallest plan on the type that frees its GPUs
first, from the running jobs' predicted ends, as frenzy reserves): a plan across types is never
chosen where waiting for a single type would do as well.
Efficient, across types, weighs each GPU by its type's achievable throughput: the throughput a
plan holds times its step within 1 / min_efficiency of the job's cheapest single-type plan's (on
one type this is frenzy's GPU-seconds rule; counting bare GPU-seconds would price a T4's second
as an A100's, and keep every slow pair out); its GPUs of each type are placed by HAS stage 2. A job
no single type could hold at all, even idle, runs across types if some plan fits there.

Each search is bounded (``allocator.mixed``), one pair of types at a time, and cached per job
shape and free counts, each type's free GPUs counted up to the most any of the job's single-type
plans uses and rounded down to a power of two (a few searches per job shape, not one per free
count); a decision runs at most SEARCHES_PER_DECISION searches not cached, so a blocked job
may try across types a decision later than it could have; a pair is not searched when even a perfect split of the job over its free GPUs
(``allocator.mixed.fastest_possible_s``) would break the stretch bound. With a
throughput table, which has no rows across types, it is ``frenzy``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

from frenzy_prefect.allocator.mixed import speed
from frenzy_prefect.errors import NoFeasiblePlan
from frenzy_prefect.scheduling.cluster import SimCluster
from frenzy_prefect.scheduling.jobs import PRECISION, Waiting
from frenzy_prefect.scheduling.options import MixedOption, fastest_across_s, mixed_options
from frenzy_prefect.scheduling.policies.base import Reject, Start
from frenzy_prefect.scheduling.policies.frenzy import Frenzy, Ranked, Reservation, reserve
from frenzy_prefect.spec.plan import Placement

# Searches across types (each up to a few hundred ms on a cluster of many types) one decision may
# run; the rest of its blocked jobs use what earlier decisions searched. Bounded work per
# decision, as BACKFILL_DEPTH bounds the backfill.
SEARCHES_PER_DECISION = 1


class FrenzyMixed(Frenzy):
    name: ClassVar[str] = "frenzy-mixed"

    def __init__(self, **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self._eligible: dict[tuple, list[MixedOption]] = {}
        self._searches_left = 0

    def schedule(self, now: float, queue: list[Waiting], cluster: SimCluster) -> list[Start | Reject]:
        self._searches_left = SEARCHES_PER_DECISION
        return super().schedule(now, queue, cluster)

    def _never_runs(self, waiting: Waiting, plans: list[Ranked], cluster: SimCluster) -> bool:
        return not plans and not self._eligible_across(waiting, plans, cluster, cluster.total, always=True)

    def _start_blocked(
        self, waiting: Waiting, plans: list[Ranked], now: float, cluster: SimCluster, reservation: Reservation | None
    ) -> Start | None:
        across = self._eligible_across(waiting, plans, cluster, cluster.free_total)
        waited_out = _finish_by_waiting(waiting, plans, cluster) if across else math.inf
        for o in across:
            ends = now + waiting.job.steps * o.step_s
            if ends >= waited_out:
                continue
            if reservation is not None and not reservation.admits(o.by_type, ends):
                continue
            if (placements := _place_each(o, cluster)) is not None:
                if reservation is not None:
                    reservation.claim(o.by_type, ends)
                return Start(waiting, o.gpu_type, o.plan, placements)
        return None

    def _eligible_across(
        self, waiting: Waiting, plans: list[Ranked], cluster: SimCluster, free: dict[str, int], always: bool = False
    ) -> list[MixedOption]:
        """The job's plans across two of the types with ``free`` GPUs that fit, keep its stretch
        bound and are efficient, best first by the objective (cached per job, what its
        out-of-memory runs proved, and free counts as searched); none if that is not cached and
        this decision has searched its SEARCHES_PER_DECISION (unless ``always``)."""
        if cluster.table is not None:
            return []
        cap = max((r.option.gpus for r in plans), default=cluster.gpus)
        counts = tuple((cluster.gpu[t], _power_of_two_at_most(min(free[t], cap))) for t in cluster.types if free[t])
        key = (waiting.job.job_id, waiting.underestimate, counts)
        if key not in self._eligible:
            if not always and self._searches_left <= 0:
                return []
            self._searches_left -= 1
            self._eligible[key] = self._search(waiting, plans, cluster, counts)
        return self._eligible[key]

    def _search(self, waiting: Waiting, plans: list[Ranked], cluster: SimCluster, counts: tuple) -> list[MixedOption]:
        job, spec = waiting.job, cluster.spec
        limit_s = self._run_limit(job, plans) / job.steps
        throughput = {t: speed(cluster.gpu[t], PRECISION) for t in cluster.types}  # FLOP/s of one GPU of each type
        cheapest = min((throughput[r.option.gpu_type] * r.option.gpus * r.step_s for r in plans), default=math.inf)
        found: list[MixedOption] = []
        for i, fast in enumerate(counts):
            for slow in counts[i + 1 :]:
                if fastest_across_s(job.model, job.global_batch, (fast, slow)) > limit_s:
                    continue  # not even a perfect split keeps the stretch bound
                try:
                    found += mixed_options(job.model, job.global_batch, (fast, slow), spec.memory_margin, spec.network_gbps)
                except NoFeasiblePlan:  # a search larger than the bound: the job keeps to one type
                    continue
        eligible = [
            o
            for o in found
            if o.step_s <= limit_s
            and self.min_efficiency * sum(throughput[t] * n for t, n in o.by_type) * o.step_s <= cheapest
            and o.fits(cluster.gpu, spec.memory_margin, waiting.underestimate)
        ]
        return sorted(eligible, key=self._mixed_order(cluster))

    def _mixed_order(self, cluster: SimCluster) -> Callable[[MixedOption], tuple[float, float]]:
        """The objective's ranking (``Frenzy._order``) of plans across types."""
        if self.objective == "time":
            return lambda o: (o.step_s, o.gpus * o.step_s)
        if self.objective == "gpu-hours":
            return lambda o: (o.gpus * o.step_s, o.step_s)
        self._order(cluster)  # checks every type has a price
        prices = cluster.spec.prices
        return lambda o: (sum(prices[t] * n for t, n in o.by_type) * o.step_s, o.step_s)


def _finish_by_waiting(waiting: Waiting, plans: list[Ranked], cluster: SimCluster) -> float:
    """When the job would end if it waited for one type instead: the earliest moment a type frees
    the GPUs of its smallest plan there (``frenzy.reserve``, from the running jobs' predicted
    ends), plus that plan's run."""
    if not plans:
        return math.inf
    reserved = reserve([r.option for r in plans], cluster)
    if reserved.at_s == math.inf:
        return math.inf
    smallest = min((r for r in plans if r.option.gpu_type == reserved.gpu_type), key=lambda r: r.option.gpus)
    return reserved.at_s + waiting.job.steps * smallest.step_s


def _power_of_two_at_most(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _place_each(option: MixedOption, cluster: SimCluster) -> list[Placement] | None:
    """HAS stage 2 for each type's share of ``option``, all or nothing (GPUs taken on success)."""
    placed: list[Placement] = []
    for gpu_type, gpus in option.by_type:
        part = cluster.place(gpu_type, gpus)
        if part is None:
            cluster.release(placed)
            return None
        placed += part
    return placed
