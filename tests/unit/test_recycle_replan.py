"""When live ReCycle ranks re-plan to a smaller layout (recycle/replan.py): which layout, and after
how long. The live runtime's switch is in test_recycle_live.py."""

from __future__ import annotations

import pytest

from frenzy_prefect.pipeline.costs import StageCosts
from frenzy_prefect.recycle.cache import PlanCache
from frenzy_prefect.recycle.replan import Replan, smaller_layout
from frenzy_prefect.spec.plan import ParallelPlan, Placement, TrainingJob
from tests.support.training import make_job, unchecked

PLAN = ParallelPlan(dp=2, pp=2, micro_batch=2)  # gpt-nano, global batch 16: 4 micro-batches per pipeline


def job_of(plan: ParallelPlan = PLAN, **request) -> TrainingJob:
    gpus = list(range(plan.gpus))
    return make_job(unchecked("s3://b/d"), "s3://b/runs/r", plan, [Placement(node="n0", host="127.0.0.1", gpus=gpus)], **request)


def rerouted_share(plan: ParallelPlan, failed: set[tuple[int, int]]) -> float:
    cache = PlanCache(plan.dp, plan.pp, plan.accumulation(16), StageCosts.uniform(plan.pp), plan_on_demand=True)
    return cache.lookup(failed).plan.iteration_s / cache.lookup(()).plan.iteration_s


def test_three_live_ranks_of_two_by_two_re_plan_to_one_pipeline_of_three_stages():
    share = rerouted_share(PLAN, {(1, 1)})  # pipeline 1's last stage failed: its peer runs 8 micro-batches
    assert share > 1.5
    found = smaller_layout(job_of(), 3, share)
    assert found is not None and found.plan == ParallelPlan(dp=1, pp=3, micro_batch=2)
    assert found.step_s < found.rerouted_s  # every live rank busy, the bubble no larger (2 of 8 micro-batches)


def test_no_re_plan_where_re_routing_loses_nothing_or_no_layout_fits():
    assert smaller_layout(job_of(), 3, 1.0) is None  # three ranks cannot beat four at full speed
    tight = job_of()
    tight = tight.model_copy(update={"allocation": tight.allocation.model_copy(update={"gpu_memory_bytes": tight.allocation.margin_bytes})})
    assert smaller_layout(tight, 3, rerouted_share(PLAN, {(1, 1)})) is None


def test_a_layout_uses_every_live_rank_and_the_runs_micro_batch():
    plan = ParallelPlan(dp=2, pp=4, micro_batch=1)  # 8 ranks; 6 live after two failures
    job = job_of(plan)
    found = smaller_layout(job, 6, 4.0)
    assert found is not None and found.plan.gpus == 6 and found.plan.micro_batch == 1
    assert found.plan.pp <= job.model.layers and 16 % found.plan.dp == 0


def test_the_horizon_is_the_switches_cost_over_what_re_routing_loses():
    # Re-routing at half the smaller layout's speed loses half its time: two switches, each a
    # save and a load of 1 s, are paid back after 8 s away.
    assert Replan(PLAN, step_s=1.0, rerouted_s=2.0).horizon_s(1.0) == pytest.approx(8.0)
    assert Replan(PLAN, step_s=1.0, rerouted_s=1.1).horizon_s(1.0) == pytest.approx(44.0)
