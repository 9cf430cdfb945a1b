"""ReCycle's planners and plan cache: schedules that always validate, throughput between the
fault-free one and a naive bound, a MILP never worse than the heuristic where it proves optimality,
and the memory bound respected."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frenzy_prefect.pipeline.builder import one_f_one_b
from frenzy_prefect.pipeline.costs import StageCosts
from frenzy_prefect.pipeline.in_flight import in_flight_peak
from frenzy_prefect.pipeline.schedule import Action, ActionKind
from frenzy_prefect.pipeline.timeline import iteration_s, run_timeline, steady_state_period_s
from frenzy_prefect.pipeline.validate import InvalidSchedule, validate
from frenzy_prefect.recycle.cache import PlanCache, failure_keys
from frenzy_prefect.recycle.failures import NeedsCheckpointRestart, RecycleInputError, canonical_failed
from frenzy_prefect.recycle.fault_free import costs_from_fault_free_step
from frenzy_prefect.recycle.planners import heuristic, milp, planner
from tests.support.recycle_planner import _costs, assert_mutations_rejected, cases


@given(cases(), st.data())
@settings(max_examples=60, deadline=None)
def test_heuristic_schedules_always_validate(case, data):
    dp, pp, m, key = case
    costs = _costs(pp, data)
    bound = data.draw(st.none() | st.integers(1, pp + 2))
    plan = heuristic.plan(dp, pp, m, key, costs, bound)
    validate(plan.schedule, costs, bound)
    assert plan.schedule.failed == canonical_failed(dp, key)
    assert plan.lower_bound_s <= plan.iteration_s * (1 + 1e-9)


@pytest.mark.parametrize(("dp", "pp", "m"), [(2, 2, 4), (3, 4, 8), (2, 3, 6), (3, 2, 5)])
def test_milp_is_optimal_and_at_least_as_good_on_small_cases(dp, pp, m):
    costs = costs_from_fault_free_step(1.0, dp, pp, m)
    for key in failure_keys(dp, pp, 1):
        h, opt = heuristic.plan(dp, pp, m, key, costs), milp.plan(dp, pp, m, key, costs)
        assert opt.status == "optimal" and opt.mip_gap is not None and opt.mip_gap <= milp.MIP_REL_GAP
        assert opt.iteration_s <= h.iteration_s + 1e-9


@given(cases(max_m=6), st.data())
@settings(max_examples=20, deadline=None)
def test_mutated_heuristic_schedules_are_rejected(case, data):
    """The MILP's schedules too, in tests/ranks (its branch and bound runs in a child process)."""
    dp, pp, m, key = case
    costs = _costs(pp, data)
    assert_mutations_rejected(heuristic.plan(dp, pp, m, key, costs).schedule, costs)


def test_one_failure_costs_throughput_but_less_than_the_naive_bound():
    dp, pp, m = 4, 4, 8
    costs = costs_from_fault_free_step(1.0, dp, pp, m)
    healthy = heuristic.plan(dp, pp, m, (0,) * pp, costs)
    for stage in range(pp):
        key = tuple(1 if s == stage else 0 for s in range(pp))
        plan = heuristic.plan(dp, pp, m, key, costs)
        # Naive: every pipeline runs 1F1B over the most loaded worker's micro-batches.
        most = max(plan.schedule.compute_counts(w) for w in plan.schedule.programs)
        naive = iteration_s(one_f_one_b(dp, pp, most), costs)
        assert healthy.iteration_s < plan.iteration_s < naive
        assert plan.fault_free_s == pytest.approx(1.0)


def test_staggered_steps_let_the_next_warm_up_overlap_a_late_stages_tail():
    costs = costs_from_fault_free_step(1.0, 4, 4, 8)
    plan = heuristic.plan(4, 4, 8, (0, 0, 0, 1), costs)
    period = steady_state_period_s(plan.schedule, costs)
    assert period < plan.iteration_s
    # Still no faster than the busiest worker's own work, all-reduce and optimizer step.
    hosted = max(plan.schedule.compute_counts(w) for w in plan.schedule.programs)
    assert period >= hosted * 3 * costs.forward_s[0] + costs.allreduce_s(3, 3) + costs.optimizer_s[3] - 1e-9


def test_a_failure_in_a_wide_shallow_pipeline_keeps_about_90_percent():
    costs = costs_from_fault_free_step(1.0, 8, 4, 32)
    plan = heuristic.plan(8, 4, 32, (1, 0, 0, 0), costs)
    assert plan.relative_throughput > 0.895  # 89.98% of the same planner without failures (90.3% of 1F1B before)
    # The first stage's hosts never idle: the schedule meets the work bound.
    assert plan.iteration_s == pytest.approx(plan.lower_bound_s)


def test_without_failures_deferring_w_fills_the_1f1b_bubble():
    costs = StageCosts.uniform(4)
    plan = heuristic.plan(1, 4, 8, (0, 0, 0, 0), costs)
    assert plan.iteration_s < 30  # 1F1B: 8 * 3 + 3 * 2
    assert plan.iteration_s >= 8 * 3  # no worker runs faster than its own work


def test_the_heuristic_uses_every_live_peer_and_respects_the_memory_bound():
    costs = costs_from_fault_free_step(1.0, 4, 3, 8)
    plan = heuristic.plan(4, 3, 8, (0, 2, 0), costs, memory_bound=[3, 2, 1])
    assert {plan.schedule.compute_counts((p, 1)) for p in (0, 1)} == {16}
    peaks = [max(in_flight_peak(plan.schedule, (p, s)) for p in plan.schedule.live(s)) for s in range(3)]
    assert all(peak <= bound for peak, bound in zip(peaks, [3, 2, 1], strict=True)) and peaks[2] == 1
    opt = milp.plan(4, 3, 8, (0, 2, 0), costs, memory_bound=[3, 2, 1])
    validate(opt.schedule, costs, [3, 2, 1])
    with pytest.raises(InvalidSchedule, match="memory bound"):
        validate(opt.schedule, costs, 1)


def test_planners_reject_bad_inputs():
    costs = StageCosts.uniform(2)
    with pytest.raises(NeedsCheckpointRestart):
        heuristic.plan(2, 2, 4, (2, 0), costs)
    with pytest.raises(RecycleInputError, match="one count per stage: 2 entries, got 3"):
        milp.plan(2, 2, 4, (0, 0, 0), costs)
    with pytest.raises(RecycleInputError, match="unknown planner 'gurobi'; known: heuristic, milp"):
        planner("gurobi")


def test_cache_looks_up_any_failed_set_with_the_same_counts():
    costs = costs_from_fault_free_step(1.0, 3, 3, 4)
    cache = PlanCache(3, 3, 4, costs, max_failures=2)
    assert len(cache) == len(failure_keys(3, 3, 2)) == 10
    a, b = cache.lookup({(0, 2), (1, 0)}), cache.lookup({(2, 2), (0, 0)})
    assert a.key == b.key == (1, 0, 1) and a.plan is b.plan
    actual = a.plan.schedule.relabelled(a.pipeline_maps)
    assert actual.failed == {(0, 2), (1, 0)}
    validate(actual, costs)
    assert run_timeline(actual, costs).iteration_s == pytest.approx(a.plan.iteration_s)
    assert cache.lookup([]).key == (0, 0, 0)
    assert cache.rerouted_s((1, 0, 1)) == a.plan.iteration_s and cache.plan([0, 0, 0]).relative_throughput == pytest.approx(1, abs=0.2)
    with pytest.raises(
        RecycleInputError, match=r"no precomputed plan for failures per stage \(1, 1, 1\) \(3 failures\); this cache covers up to 2"
    ):
        cache.lookup({(0, 0), (0, 1), (0, 2)})
    with pytest.raises(NeedsCheckpointRestart, match="stage.s. 1 lost all 3 replicas"):
        cache.lookup({(0, 1), (1, 1), (2, 1)})


def test_the_cache_plans_a_key_again_under_an_in_flight_bound_and_keeps_it():
    """What the runtime asks for when a plan holds more than a GPU does (recycle.fits)."""
    costs = costs_from_fault_free_step(1.0, 2, 2, 4)
    cache = PlanCache(2, 2, 4, costs)
    free = cache.lookup({(1, 1)})
    assert max(in_flight_peak(free.plan.schedule, w) for w in free.plan.schedule.programs) == 6
    tight = cache.lookup({(1, 1)}, in_flight=2)
    schedule = tight.plan.schedule.relabelled(tight.pipeline_maps)
    validate(schedule, costs)
    assert schedule.failed == {(1, 1)} and max(in_flight_peak(schedule, w) for w in schedule.programs) == 2
    assert cache.lookup({(0, 1)}, in_flight=2).plan is tight.plan and cache.lookup({(1, 1)}).plan is free.plan


def test_allreduce_uses_the_live_peers_and_normalises_by_the_global_count():
    costs = StageCosts.uniform(2, gradient_transfer=3.0)
    plan = heuristic.plan(4, 2, 4, (1, 0), costs)
    (ar,) = [a for a in plan.schedule.programs[(0, 0)] if a.kind == "AR"]
    assert ar == Action(ActionKind.AR, divisor=16)
    timeline = run_timeline(plan.schedule, costs)
    program = plan.schedule.programs[(0, 0)]
    i = program.index(ar)
    assert timeline.ends[(0, 0)][i] - timeline.starts[(0, 0)][i] == pytest.approx(3.0 * 2 * 2 / 3)  # 3 live peers


def test_the_plan_cache_drives_the_simulators_iteration_model():
    from frenzy_prefect.recycle.iteration import (
        IterationTimes,
        StepTimeTable,
        balanced_reroute_bound,
        bubble_filling_bound,
        from_step_time_table,
    )

    dp, pp, m = 2, 4, 8
    table = from_step_time_table(StepTimeTable({dp * pp: 1.5}), dp=dp, pp=pp, microbatches=m)
    fault_free = table.fault_free_s(dp, pp)
    cache = PlanCache(dp, pp, m, costs_from_fault_free_step(fault_free, dp, pp, m), max_failures=1)
    wired = IterationTimes(dp, pp, m, table.fault_free, cache.rerouted_s)
    pessimistic, optimistic = balanced_reroute_bound(fault_free, dp), bubble_filling_bound(fault_free, dp, pp, m)
    for key in failure_keys(dp, pp, 1)[1:]:
        assert wired.rerouted_s(key) == cache.plan(key).iteration_s
        assert optimistic(key) <= wired.rerouted_s(key) <= pessimistic(key)
