"""``frenzy``: HAS online. Each queued job gets the first of MARP's plans, ranked by predicted
completion time over every GPU type (ties: fewer GPU-seconds), that the free GPUs can hold now,
placed by HAS stage 2 (exact node, tightest node, greedy split; tensor-parallel groups inside
a node).

Plan width. A plan is *efficient* when its GPU-seconds per step are within 1 / MIN_EFFICIENCY
of the cheapest plan's on the same type. Only efficient plans are open to a job while others
wait behind it; the last job waiting may also take a wider, inefficient plan if it leaves at
least 1 - IDLE_SHARE of its type's free GPUs free: GPUs nobody is waiting for buy it speed,
and some stay for the next arrival (no job is ever moved once started).

Order and starvation. The queue is served highest response ratio first ((waited + predicted
run) / predicted run: short jobs go first, and every waiting job's ratio grows without bound,
so none starves), with EASY backfilling behind the first job that cannot start: it reserves
the earliest time one of its plans' GPUs free up (from the running jobs' predicted ends;
counted per GPU type, not per node), and later jobs start only if they end before then, run on
another GPU type, or leave the reserved GPUs free. Backfilling looks BACKFILL_DEPTH jobs deep
(the role of Slurm's bf_max_job_test).

Objective and stretch. Plans are ranked by the owner's objective: ``time`` (predicted completion,
ties: fewer GPU-seconds; the default), ``gpu-hours`` (fewest GPU-seconds, ties: sooner) or
``cost`` (the cluster's price of those GPU-seconds). Whatever the objective, a plan is never
started if its predicted run is longer than STRETCH_BOUND times the longer of what the job asked
for (its requested duration) and its fastest plan on this cluster: a job waits for GPUs that run
it within that bound rather than start on a few slow ones (the fastest plan always qualifies, so
no job is left without one)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.scheduling.cluster import SimCluster
from frenzy_prefect.scheduling.jobs import SimJob
from frenzy_prefect.scheduling.options import Option
from frenzy_prefect.scheduling.policies.base import Reject, Start, Waiting, no_plan_fits

MIN_EFFICIENCY = 0.5
IDLE_SHARE = 0.5
BACKFILL_DEPTH = 100
STRETCH_BOUND = 2.0
OBJECTIVES = ("time", "gpu-hours", "cost")


class Ranked(NamedTuple):
    option: Option
    step_s: float  # as HAS would place it (SimCluster.predicted_step_s)
    efficient: bool  # GPU-seconds per step within 1 / MIN_EFFICIENCY of the type's cheapest plan


@dataclass(slots=True)
class Reservation:
    """The blocked job's claim on ``gpu_type`` from ``at_s``; ``spare`` GPUs of that type will be
    free then beyond the claim, for backfilled jobs that outlive it."""

    at_s: float
    gpu_type: str
    spare: int

    def admits(self, by_type: tuple[tuple[str, int], ...], ends_s: float) -> bool:
        """Whether a plan holding ``by_type`` (GPUs of each type) until ``ends_s`` leaves the claim whole."""
        taken = dict(by_type).get(self.gpu_type, 0)
        return not taken or ends_s <= self.at_s or taken <= self.spare

    def claim(self, by_type: tuple[tuple[str, int], ...], ends_s: float) -> None:
        if ends_s > self.at_s:
            self.spare -= dict(by_type).get(self.gpu_type, 0)


class Frenzy:
    name: ClassVar[str] = "frenzy"
    round_s: ClassVar[float | None] = None

    def __init__(
        self,
        min_efficiency: float = MIN_EFFICIENCY,
        idle_share: float = IDLE_SHARE,
        backfill_depth: int = BACKFILL_DEPTH,
        objective: str = "time",
        stretch_bound: float | None = STRETCH_BOUND,
    ) -> None:
        if objective not in OBJECTIVES:
            raise FrenzyError(f"unknown objective {objective!r}; known: {', '.join(OBJECTIVES)}")
        if stretch_bound is not None and stretch_bound < 1:
            raise FrenzyError(f"stretch bound must be at least 1 (a job's fastest plan must qualify); got {stretch_bound}")
        self.min_efficiency = min_efficiency
        self.idle_share = idle_share
        self.backfill_depth = backfill_depth
        self.objective = objective
        self.stretch_bound = stretch_bound
        self._shaped: dict[tuple[str, int, float], list[Ranked]] = {}
        self._ranked: dict[tuple[str, float], list[Ranked]] = {}

    def prepare(self, job: SimJob, cluster: SimCluster, underestimate: float = 1.0) -> None:
        self.ranked(job, cluster, underestimate)

    def ranked(self, job: SimJob, cluster: SimCluster, underestimate: float = 1.0) -> list[Ranked]:
        """The job's plans, best first by the objective, within its stretch bound (cached per job
        and what its out-of-memory runs proved of its estimates: the bound is the job's own)."""
        key = (job.job_id, underestimate)
        if key not in self._ranked:
            self._ranked[key] = self._within_stretch(job, self._by_shape(job, cluster, underestimate))
        return self._ranked[key]

    def _by_shape(self, job: SimJob, cluster: SimCluster, underestimate: float) -> list[Ranked]:
        """Every plan of the job's shape (model, global batch), best first by the objective (cached per shape)."""
        key = (job.model, job.global_batch, underestimate)
        if key not in self._shaped:
            plans: list[Ranked] = []
            for gpu_type in cluster.types:
                steps = [(o, cluster.predicted_step_s(o)) for o in cluster.options(job, gpu_type, underestimate)]
                if steps:
                    cheapest = min(o.gpus * s for o, s in steps)
                    plans += [Ranked(o, s, cheapest >= self.min_efficiency * o.gpus * s) for o, s in steps]
            plans.sort(key=self._order(cluster))
            self._shaped[key] = plans
        return self._shaped[key]

    def _order(self, cluster: SimCluster) -> Callable[[Ranked], tuple[float, float]]:
        """The objective's ranking of a job's plans, best first."""
        if self.objective == "time":
            return lambda r: (r.step_s, r.option.gpus * r.step_s)
        if self.objective == "gpu-hours":
            return lambda r: (r.option.gpus * r.step_s, r.step_s)
        prices = cluster.spec.prices
        missing = sorted(set(cluster.types) - prices.keys())
        if missing:
            raise FrenzyError(
                f"objective 'cost' needs the price of a GPU-hour of every type; cluster {cluster.spec.name!r} lacks {', '.join(missing)}"
            )
        return lambda r: (prices[r.option.gpu_type] * r.option.gpus * r.step_s, r.step_s)

    def _run_limit(self, job: SimJob, plans: list[Ranked]) -> float:
        """The longest run the stretch bound allows ``job`` (unbounded without one)."""
        if self.stretch_bound is None or not plans:
            return math.inf
        return self.stretch_bound * max(job.requested_s, job.steps * min(r.step_s for r in plans))

    def _within_stretch(self, job: SimJob, plans: list[Ranked]) -> list[Ranked]:
        """The plans whose predicted run is within the stretch bound (all without one)."""
        limit = self._run_limit(job, plans)
        return [r for r in plans if job.steps * r.step_s <= limit]

    def _urgency(self, waiting: Waiting, now: float, cluster: SimCluster) -> float:
        """Highest response ratio first: (waited + predicted run) / predicted run, negated."""
        plans = self.ranked(waiting.job, cluster, waiting.underestimate)
        if not plans:
            return -math.inf
        run = waiting.job.steps * plans[0].step_s
        return -(now - waiting.job.arrival_s + run) / run

    def schedule(self, now: float, queue: list[Waiting], cluster: SimCluster) -> list[Start | Reject]:
        out: list[Start | Reject] = []
        reservation: Reservation | None = None
        looked = 0
        ordered = sorted(queue, key=lambda w: self._urgency(w, now, cluster))
        for position, waiting in enumerate(ordered):
            if not any(cluster.free_total.values()) or looked > self.backfill_depth:
                break
            plans = self.ranked(waiting.job, cluster, waiting.underestimate)
            if self._never_runs(waiting, plans, cluster):
                out.append(Reject(waiting, no_plan_fits(waiting, cluster)))
                continue
            if reservation is not None:
                looked += 1
            last = position == len(ordered) - 1
            start = self._start(waiting, plans, now, cluster, reservation, last)
            start = start or self._start_blocked(waiting, plans, now, cluster, reservation)
            if start:
                out.append(start)
            elif reservation is None:
                reservation = reserve([r.option for r in plans], cluster)
        return out

    def _never_runs(self, waiting: Waiting, plans: list[Ranked], cluster: SimCluster) -> bool:
        """Whether ``waiting`` can never run here: none of its plans fits a GPU type."""
        return not plans

    def _start(
        self, waiting: Waiting, plans: list[Ranked], now: float, cluster: SimCluster, reservation: Reservation | None, last: bool
    ) -> Start | None:
        """The best of the job's plans, in rank order, that the free GPUs hold now within the
        width and backfilling rules (its GPUs taken), or None."""
        steps = waiting.job.steps
        limit = self._run_limit(waiting.job, plans)
        for o, step_s, efficient in plans:
            if o.gpus > cluster.free_total[o.gpu_type]:
                continue
            if not efficient and (not last or o.gpus > self.idle_share * cluster.free_total[o.gpu_type]):
                continue
            ends = now + steps * step_s
            if reservation is not None and not reservation.admits(o.by_type, ends):
                continue
            placements = cluster.place(o.gpu_type, o.gpus, o.plan.tp)
            if placements and steps * o.step_time(len(placements)) > limit:  # split over nodes, slower than the bound
                cluster.release(placements)
                continue
            if placements:
                if reservation is not None:
                    reservation.claim(o.by_type, ends)
                return Start(waiting, o.gpu_type, o.plan, placements)
        return None

    def _start_blocked(
        self, waiting: Waiting, plans: list[Ranked], now: float, cluster: SimCluster, reservation: Reservation | None
    ) -> Start | None:
        """What a job none of whose plans the free GPUs hold starts as instead: nothing (it waits)."""
        return None


def reserve(plans: list[Option], cluster: SimCluster) -> Reservation:
    """The earliest moment one of the head job's GPU types frees enough GPUs for its smallest plan there."""
    best = Reservation(math.inf, "", 0)
    for gpu_type in dict.fromkeys(o.gpu_type for o in plans):  # in rank order: ties go to the better type
        need = min(o.gpus for o in plans if o.gpu_type == gpu_type)
        free = cluster.free_total[gpu_type]
        for end, gpus in sorted((r.end_s, r.gpus) for r in cluster.running.values() if r.gpu_type == gpu_type):
            free += gpus
            if free >= need:
                if end < best.at_s:
                    best = Reservation(end, gpu_type, free - need)
                break
    return best
