"""``ilp``: a round-based allocator in the Gavel/Sia style. Every ROUND_S seconds in which
something changed, one MILP (scipy's HiGHS) over the oldest WINDOW queued jobs picks, for each,
at most one of MARP's frontier plans on one GPU type, within each type's free GPUs, maximising

    sum over started jobs of  2 - runtime(plan) / runtime(cheapest plan) + waited / runtime(cheapest plan)

(every start is worth about one job; faster plans earn their speed-up; waiting raises a job's
worth by its slowdown, so nothing starves). The chosen plans are then placed by HAS stage 2 in
queue order; one whose GPUs are free in count but split across too many nodes waits a round."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from frenzy_prefect.scheduling.cluster import SimCluster
from frenzy_prefect.scheduling.jobs import SimJob
from frenzy_prefect.scheduling.options import Option
from frenzy_prefect.scheduling.policies.base import Reject, Start, Waiting, no_plan_fits

ROUND_S = 60.0
WINDOW = 128
TIME_LIMIT_S = 10.0


@contextmanager
def _c_stdout_silenced() -> Iterator[None]:
    """HiGHS prints debugging lines from C straight to file descriptor 1 (``disp`` off or not),
    which would corrupt JSON its caller writes there."""
    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


class Ilp:
    name: ClassVar[str] = "ilp"
    round_s: ClassVar[float | None] = ROUND_S

    def prepare(self, job: SimJob, cluster: SimCluster, underestimate: float = 1.0) -> None:
        for gpu_type in cluster.types:
            cluster.options(job, gpu_type, underestimate)

    def schedule(self, now: float, queue: list[Waiting], cluster: SimCluster) -> list[Start | Reject]:
        out: list[Start | Reject] = []
        choices: list[tuple[int, Option, float]] = []  # (job in window, plan, value)
        window = queue[:WINDOW]
        for j, waiting in enumerate(window):
            job = waiting.job
            options = [o for t in cluster.types for o in cluster.options(job, t, waiting.underestimate)]
            if not options:
                out.append(Reject(waiting, no_plan_fits(waiting, cluster)))
                continue
            runtime = {o: job.steps * cluster.predicted_step_s(o) for o in options}
            cheapest = runtime[min(options, key=lambda o: o.gpus * runtime[o])]
            waited = now - job.arrival_s
            choices += [(j, o, 2 - runtime[o] / cheapest + waited / cheapest) for o in options if o.gpus <= cluster.free_total[o.gpu_type]]
        if not choices:
            return out
        picked = self._solve(choices, len(window), cluster)
        for j, o in sorted(picked, key=lambda c: c[0]):
            placements = cluster.place(o.gpu_type, o.gpus, o.plan.tp)
            if placements:
                out.append(Start(window[j], o.gpu_type, o.plan, placements))
        return out

    def _solve(self, choices: list[tuple[int, Option, float]], jobs: int, cluster: SimCluster) -> list[tuple[int, Option]]:
        types = {t: i for i, t in enumerate(cluster.types)}
        n = len(choices)
        rows, cols, vals = [], [], []
        for k, (j, o, _) in enumerate(choices):
            rows += [j, jobs + types[o.gpu_type]]  # one plan per job; GPUs per type
            cols += [k, k]
            vals += [1.0, float(o.gpus)]
        a = coo_array((vals, (rows, cols)), shape=(jobs + len(types), n))
        upper = np.array([1.0] * jobs + [float(cluster.free_total[t]) for t in types])
        with _c_stdout_silenced():
            result = milp(
                c=-np.array([v for _, _, v in choices]),
                constraints=LinearConstraint(a, -np.inf, upper),
                integrality=np.ones(n),
                bounds=Bounds(0, 1),
                options={"time_limit": TIME_LIMIT_S},
            )
        if result.x is None:
            return []
        return [(j, o) for (j, o, _), x in zip(choices, result.x, strict=True) if x > 0.5]
