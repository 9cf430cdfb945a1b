"""ReCycle's planners and plan cache: schedules that always validate, throughput between the
fault-free one and a naive bound, a MILP never worse than the heuristic where it proves optimality,
and the memory bound respected."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frenzy_prefect.pipeline.builder import one_f_one_b
from frenzy_prefect.pipeline.timeline import iteration_s
from frenzy_prefect.pipeline.validate import validate
from frenzy_prefect.recycle.fault_free import costs_from_fault_free_step
from frenzy_prefect.recycle.planners import PLANNERS, fault_free_plan, heuristic, milp, planner
from tests.support.recycle_planner import _costs, assert_mutations_rejected, cases


@given(cases(max_dp=3, max_pp=3, max_m=6), st.data())
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_milp_schedules_validate_and_never_lose_to_the_heuristic(case, data):
    dp, pp, m, key = case
    costs = _costs(pp, data)
    bound = data.draw(st.none() | st.integers(1, pp + 1))
    h = heuristic.plan(dp, pp, m, key, costs, bound)
    opt = milp.plan(dp, pp, m, key, costs, bound)
    validate(opt.schedule, costs, bound)
    assert opt.status == "optimal" and opt.mip_gap is not None and opt.mip_gap <= milp.MIP_REL_GAP
    assert opt.iteration_s <= h.iteration_s * (1 + 1e-6) + 1e-9  # the heuristic's schedule seeds the MILP
    assert opt.lower_bound_s <= opt.iteration_s * (1 + 1e-9)


@pytest.mark.parametrize("name", list(PLANNERS))
@pytest.mark.parametrize("bound", [None, 4])
def test_without_failures_a_plan_is_its_own_baseline_and_a_failure_is_measured_against_it(name, bound):
    """The baseline is the same planner's schedule without failures, not 1F1B (which that schedule
    beats by deferring W into the bubbles: 110.8% of it at 4 x 4, 8 micro-batches). The costs make
    the heuristic's (the runtime's) schedule last the step; the MILP's may be shorter."""
    dp, pp, m = 4, 4, 8
    costs = costs_from_fault_free_step(1.0, dp, pp, m, memory_bound=bound)
    healthy = planner(name)(dp, pp, m, (0,) * pp, costs, bound)
    assert healthy.relative_throughput == 1.0 and healthy.fault_free_s == healthy.iteration_s
    assert healthy.iteration_s == pytest.approx(1.0) if name == "heuristic" else healthy.iteration_s <= 1.0 + 1e-9
    if bound is None:  # unbounded, W fills the bubbles, beating 1F1B (the old baseline); bounded to pp in flight, it may not
        assert healthy.iteration_s < 0.95 * iteration_s(one_f_one_b(dp, pp, m), costs)
    failed = planner(name)(dp, pp, m, (0, 1, 0, 0), costs, bound)
    baseline = fault_free_plan(name, dp, pp, m, costs, bound)
    assert failed.fault_free_s == baseline.iteration_s == pytest.approx(healthy.iteration_s)
    assert failed.relative_throughput == pytest.approx(baseline.iteration_s / failed.iteration_s) and failed.relative_throughput < 1


def test_branch_and_bound_runs_in_a_child_that_is_killed_when_time_is_up():
    import numpy as np
    from scipy.optimize import LinearConstraint

    from frenzy_prefect.recycle import killable_milp

    # maximise x + y with 2x + 2y <= 3, integers: 1
    args = (np.array([-1.0, -1.0]), LinearConstraint(np.array([[2.0, 2.0]]), -np.inf, 3.0), np.ones(2), {"time_limit": 5.0})
    solved = killable_milp.solve(*args, kill_after_s=60)
    assert solved["status"] == 0 and sum(solved["x"]) == pytest.approx(1)
    assert killable_milp.solve(*args, kill_after_s=0.001) is None


@given(cases(max_m=6), st.data())
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_mutated_milp_schedules_are_rejected(case, data):
    dp, pp, m, key = case
    costs = _costs(pp, data)
    assert_mutations_rejected(milp.plan(dp, pp, m, key, costs).schedule, costs)
