"""When live ReCycle ranks stop re-routing and re-plan: a smaller layout over the ranks left.

Re-routing keeps a failed worker's stage going on its peers, and the most depleted stage sets
the pace. A plan over the live ranks alone (fewer pipelines, or a different depth), resumed from a
checkpoint, may run faster; switching to it costs a checkpoint's save and load, and again to
switch back when the rank returns. How long a failed rank stays away is not known when it fails,
so the runtime rents before it buys (the ski-rental rule, within 2x of knowing the outage in
advance): it re-routes until the time re-routing has lost against the smaller layout equals the
switches' cost (``Replan.horizon_s``), then re-plans. A request may fix the horizon instead
(``replan_after_s``).

The smaller layout uses every live rank (tp 1, ZeRO 0, the run's micro-batch and recomputation,
any pipeline depth up to the layers) and must fit the run's GPUs by MARP; among those, the one the
step-time model predicts fastest, if faster than re-routing by ReCycle's planner."""

from __future__ import annotations

from dataclasses import dataclass

from frenzy_prefect.allocator.space import divisors
from frenzy_prefect.allocator.step_time import predict_step
from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.memory.analytic import estimate
from frenzy_prefect.recycle.fits import run_gpu
from frenzy_prefect.spec.layout import check_engine_plan
from frenzy_prefect.spec.plan import ParallelPlan, TrainingJob

SWITCHES = 2  # there and back: a replanned run goes back to its own plan when the rank returns


@dataclass(frozen=True)
class Replan:
    plan: ParallelPlan  # the smaller layout
    step_s: float  # its predicted step time
    rerouted_s: float  # the run's plan's, re-routed around the failed workers

    def horizon_s(self, save_s: float) -> float:
        """How long the failed ranks must have been away before re-planning pays: the switches'
        cost (each a checkpoint's save and its load, taken as long as the save) over the share
        of time re-routing loses against the smaller layout."""
        return SWITCHES * 2 * save_s / (1 - self.step_s / self.rerouted_s)


def smaller_layout(job: TrainingJob, live: int, rerouted_share: float) -> Replan | None:
    """The layout over ``live`` ranks to re-plan to, or None when none fits or none is predicted
    faster than re-routing (``rerouted_share``: the re-routed iteration's time over the
    fault-free one's, by ReCycle's planner)."""
    plan, work, model = job.allocation.plan, job.request.workload, job.model
    gpu, budget = run_gpu(job), job.allocation.gpu_memory_bytes - job.allocation.margin_bytes
    rerouted_s = predict_step(model, plan, work, gpu=gpu).seconds * rerouted_share
    best: Replan | None = None
    for dp in divisors(live):
        smaller = ParallelPlan(dp=dp, pp=live // dp, micro_batch=plan.micro_batch, recompute=plan.recompute)
        if job.request.global_batch % (dp * plan.micro_batch):
            continue
        try:
            check_engine_plan(model, smaller, work.precision, work.master_weights)
        except FrenzyError:
            continue
        if estimate(model, smaller, work, gpu=gpu).peak_bytes > budget:
            continue
        step_s = predict_step(model, smaller, work, gpu=gpu).seconds
        if step_s < rerouted_s and (best is None or step_s < best.step_s):
            best = Replan(smaller, step_s, rerouted_s)
    return best
