"""ReCycle's schedule IR, costs, timeline, failure normalisation and validator: the fault-free
1F1B matches its closed form, costs invert a measured step of the planner's fault-free schedule
exactly, re-routing is balanced, and the validator names what is wrong with a broken schedule."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frenzy_prefect.pipeline.builder import one_f_one_b
from frenzy_prefect.pipeline.costs import StageCosts
from frenzy_prefect.pipeline.in_flight import in_flight_peak
from frenzy_prefect.pipeline.schedule import Action, ActionKind, parse_action
from frenzy_prefect.pipeline.timeline import ScheduleDeadlock, iteration_s, run_timeline, steady_state_period_s
from frenzy_prefect.pipeline.validate import InvalidSchedule, validate, violations
from frenzy_prefect.pipeline.workers import ScheduleInputError
from frenzy_prefect.profiling.model import PRESETS
from frenzy_prefect.recycle.failures import (
    NeedsCheckpointRestart,
    RecycleInputError,
    canonical_failed,
    key_from_stages,
    normalise,
    pipeline_maps,
    reroute,
)
from frenzy_prefect.recycle.fault_free import costs_from_fault_free_step
from frenzy_prefect.recycle.planners import heuristic
from frenzy_prefect.spec.catalog import GPU_CATALOG
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.workload import Workload


def one_f_one_b_s(costs: StageCosts, dp: int, pp: int, m: int) -> float:
    return iteration_s(one_f_one_b(dp, pp, m), costs)


shapes = st.tuples(st.integers(1, 4), st.integers(1, 6), st.integers(1, 12))


positive = st.floats(0.1, 10.0)


@given(shapes, positive, positive, positive)
def test_fault_free_1f1b_makespan_is_the_closed_form(shape, f, b, w):
    dp, pp, m = shape
    costs = StageCosts.uniform(pp, f, b, w)
    assert one_f_one_b_s(costs, dp, pp, m) == pytest.approx(m * (f + b + w) + (pp - 1) * (f + b))


def test_p2p_allreduce_and_optimizer_add_to_the_critical_path():
    # Warm-up and cool-down each cross pp - 1 boundaries; the last stage to finish then reduces and steps.
    dp, pp, m = 4, 4, 8
    costs = StageCosts.uniform(pp, 1.0, 1.0, 1.0, p2p=0.1, gradient_transfer=2.0, optimizer=0.5)
    expected = m * 3 + (pp - 1) * (2 + 2 * 0.1) + 2.0 * 2 * (dp - 1) / dp + 0.5
    assert one_f_one_b_s(costs, dp, pp, m) == pytest.approx(expected)


@given(shapes, st.floats(0.01, 100.0), st.floats(0, 0.3), st.floats(0, 0.3), st.floats(0, 0.5))
@settings(max_examples=40, deadline=None)
def test_costs_from_a_fault_free_step_reproduce_it(shape, step_s, allreduce, optimizer, p2p):
    dp, pp, m = shape
    costs = costs_from_fault_free_step(step_s, dp, pp, m, allreduce_fraction=allreduce, optimizer_fraction=optimizer, p2p_per_forward=p2p)
    assert heuristic.plan(dp, pp, m, (0,) * pp, costs).iteration_s == pytest.approx(step_s, rel=1e-9)
    assert costs.forward_s[0] == pytest.approx(costs.backward_input_s[0]) == pytest.approx(costs.backward_weight_s[0])


def test_costs_from_a_fault_free_step_reject_impossible_fractions():
    with pytest.raises(RecycleInputError, match=r"allreduce_fraction \(0.7\) and optimizer_fraction \(0.4\) must be >= 0 and sum below 1"):
        costs_from_fault_free_step(1.0, 2, 2, 4, allreduce_fraction=0.7, optimizer_fraction=0.4)
    with pytest.raises(ScheduleInputError, match="microbatches must be a positive integer, got 0"):
        costs_from_fault_free_step(1.0, 2, 2, 0)


def test_costs_from_the_throughput_model_are_close_to_its_step():
    from frenzy_prefect.allocator.step_time import predict_step

    model, gpu = PRESETS["gpt2-medium"], GPU_CATALOG["A100-80GB"]
    plan = ParallelPlan(dp=2, pp=4, micro_batch=2)
    work = Workload(global_batch=64, seq_len=1024, precision="bf16")
    costs = StageCosts.from_model(model, plan, work, gpu=gpu)
    assert costs.stages == 4 and costs.p2p_s > 0 and all(x > 0 for x in costs.gradient_transfer_s + costs.optimizer_s)
    predicted = predict_step(model, plan, work, gpu=gpu).seconds
    timed = one_f_one_b_s(costs, plan.dp, plan.pp, plan.accumulation(64))
    # The same pieces; the timeline's bubble is (pp - 1)(F + B) rather than the model's (pp - 1)(F + B + W).
    assert 0.8 * predicted < timed < 1.05 * predicted


def test_action_strings_round_trip():
    schedule = one_f_one_b(2, 3, 4)
    for program in schedule.programs.values():
        for action in program:
            assert parse_action(str(action)) == action
    assert str(Action(ActionKind.F, 1, 3)) == "F3@1" and str(Action(ActionKind.AR, divisor=128)) == "AR/128"
    assert parse_action("SA3@1>2").kind is ActionKind.SA and {type(a.kind) for a in schedule.programs[(0, 1)]} == {ActionKind}
    with pytest.raises(ValueError, match="not an action: 'X1'"):
        parse_action("X1")


def test_schedules_survive_json_and_compact_form():
    from frenzy_prefect.pipeline.schedule import Schedule

    schedule = one_f_one_b(2, 3, 4)
    assert Schedule.model_validate_json(schedule.model_dump_json()) == schedule
    assert '"programs":{"0,0":[["F",0,0,-1,0],["SA",0,0,0,0],' in schedule.model_dump_json()  # kinds serialise as their letters
    assert {type(a.kind) for a in Schedule.model_validate_json(schedule.model_dump_json()).programs[(1, 2)]} == {ActionKind}
    compact = {f"{p},{s}": schedule.render((p, s)).split() for p, s in schedule.programs}
    assert Schedule(dp=2, pp=3, microbatches=4, programs=compact) == schedule


def test_one_f_one_b_holds_pp_minus_stage_in_flight():
    schedule = one_f_one_b(2, 4, 8)
    assert [in_flight_peak(schedule, (0, s)) for s in range(4)] == [4, 3, 2, 1]
    validate(schedule, memory_bound=[4, 3, 2, 1])


def test_normalise_counts_failures_per_stage():
    assert normalise(4, 3, [(0, 1), (3, 1), (2, 2)]) == (0, 2, 1)
    assert key_from_stages(4, 6, [2, 2, 5]) == (0, 0, 2, 0, 0, 1)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda: normalise(4, 3, [(4, 0)]),
            RecycleInputError,
            r"failed worker \(pipeline 4, stage 0\) does not exist; pipelines are 0..3, stages 0..2",
        ),
        (
            lambda: normalise(2, 3, [(0, 1), (1, 1)]),
            NeedsCheckpointRestart,
            "stage.s. 1 lost all 2 replicas: .* needs a checkpoint restart",
        ),
        (lambda: key_from_stages(2, 3, [1, 1, 1]), RecycleInputError, "stage 1 has 2 replicas; 3 failures there is impossible"),
        (lambda: key_from_stages(2, 3, [3]), RecycleInputError, r"stage 3 does not exist; stages are 0..2 \(0-based\)"),
        (lambda: reroute(2, 2, 0, frozenset()), ScheduleInputError, "microbatches must be a positive integer, got 0"),
    ],
)
def test_bad_failures_are_named(call, error, message):
    with pytest.raises(error, match=message):
        call()


@given(st.integers(2, 6), st.integers(1, 4), st.integers(1, 16), st.data())
def test_rerouting_is_balanced_and_deterministic(dp, pp, m, data):
    failed = frozenset(data.draw(st.sets(st.tuples(st.integers(0, dp - 1), st.integers(0, pp - 1)), max_size=dp - 1)))
    hosts = reroute(dp, pp, m, failed)
    assert hosts == reroute(dp, pp, m, failed)
    assert set(hosts) == {(q, j, s) for q, s in failed for j in range(m)}
    for stage in range(pp):
        live = [p for p in range(dp) if (p, stage) not in failed]
        extra = [sum(1 for (_, _, s), p in hosts.items() if s == stage and p == host) for host in live]
        assert max(extra) - min(extra) <= 1
        assert all(hosts[(q, j, s)] in live for q, j, s in hosts if s == stage)


def test_pipeline_maps_send_canonical_failures_to_actual_ones():
    key = normalise(4, 2, [(0, 1), (2, 1)])
    maps = pipeline_maps(4, frozenset({(0, 1), (2, 1)}), key)
    assert {(maps[s][p], s) for p, s in canonical_failed(4, key)} == {(0, 1), (2, 1)}
    assert all(sorted(m) == [0, 1, 2, 3] for m in maps)


BASE = one_f_one_b(2, 2, 2)


def _program(worker, *actions):
    return BASE.replaced(worker, [parse_action(a) for a in actions])


def test_a_valid_schedule_passes():
    assert violations(BASE) == []


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        (BASE.replaced((0, 0), [a for a in BASE.programs[(0, 0)] if str(a) != "W1@0"]), "micro-batch 1 of pipeline 0 has 0 W at stage 0"),
        (
            BASE.replaced((0, 1), [a if a.kind != "AR" else a._replace(divisor=2) for a in BASE.programs[(0, 1)]]),
            r"divides its gradients by 2; fault-free training divides by dp \* microbatches = 4",
        ),
        (
            _program((0, 1), "RA0@0<0", "F0@0", "W0@0", "B0@0", "SG0@0>0", "RA1@0<0", "F1@0", "B1@0", "SG1@0>0", "W1@0", "AR/4", "OPT"),
            "micro-batch 0 of pipeline 0 at stage 1: F, B, W out of order",
        ),
        (
            _program((0, 1), "F0@0", "RA0@0<0", "B0@0", "SG0@0>0", "W0@0", "RA1@0<0", "F1@0", "B1@0", "SG1@0>0", "W1@0", "AR/4", "OPT"),
            "RA is on the wrong side of its F",
        ),
        (
            _program((0, 1), "RA0@0<1", "F0@0", "B0@0", "SG0@0>0", "W0@0", "RA1@0<0", "F1@0", "B1@0", "SG1@0>0", "W1@0", "AR/4", "OPT"),
            "RA names pipeline 1, but stage 0 runs it on 0",
        ),
        (
            _program((0, 1), "RA0@0<0", "F0@0", "B0@0", "SG0@0>0", "W0@0", "RA1@0<0", "F1@0", "B1@0", "SG1@0>0", "AR/4", "W1@0", "OPT"),
            r"\(pipeline 0, stage 1\) computes after its all-reduce",
        ),
        (BASE.model_copy(update={"failed": frozenset({(1, 0)})}), r"failed worker \(pipeline 1, stage 0\) has actions"),
    ],
)
def test_broken_schedules_are_rejected_with_the_reason(schedule, message):
    with pytest.raises(InvalidSchedule, match=message):
        validate(schedule)


def test_a_schedule_whose_receives_wait_on_each_other_deadlocks():
    # Stage 0 waits for micro-batch 0's gradient before sending micro-batch 1; stage 1 wants 1 first.
    schedule = _program((0, 0), "F0@0", "SA0@0>0", "RG0@0<0", "B0@0", "W0@0", "F1@0", "SA1@0>0", "RG1@0<0", "B1@0", "W1@0", "AR/4", "OPT")
    program = "RA1@0<0 F1@0 B1@0 SG1@0>0 W1@0 RA0@0<0 F0@0 B0@0 SG0@0>0 W0@0 AR/4 OPT"
    schedule = schedule.replaced((0, 1), [parse_action(a) for a in program.split()])
    stuck = r"deadlocks: 4 worker\(s\) never finish: \(pipeline 0, stage 0\) at RG0@0<0, \(pipeline 0, stage 1\) at RA1@0<0"
    with pytest.raises(ScheduleDeadlock, match=stuck):
        run_timeline(schedule, StageCosts.uniform(2))
    with pytest.raises(InvalidSchedule, match="deadlocks"):
        validate(schedule)


def test_the_memory_bound_is_checked_per_stage():
    with pytest.raises(InvalidSchedule, match=r"\(pipeline 0, stage 0\) holds 2 micro-batches in flight; the memory bound of stage 0 is 1"):
        validate(BASE, memory_bound=1)
    validate(BASE, memory_bound=[2, 1])


def test_costs_must_match_the_schedules_stages():
    with pytest.raises(ScheduleInputError, match="the costs describe 3 stages but the schedule has pp=2"):
        run_timeline(BASE, StageCosts.uniform(3))


def test_steady_state_of_1f1b_is_its_iteration_time():
    # Stage 0 finishes last and starts the next iteration: 1F1B gains nothing from staggering.
    costs = StageCosts.uniform(4, 1.0, 1.0, 1.0, p2p=0.1, gradient_transfer=1.0, optimizer=0.5)
    schedule = one_f_one_b(2, 4, 8)
    timeline = run_timeline(schedule, costs, iterations=3)
    assert timeline.iteration_ends == pytest.approx([one_f_one_b_s(costs, 2, 4, 8) * k for k in (1, 2, 3)])
    assert steady_state_period_s(schedule, costs) == pytest.approx(one_f_one_b_s(costs, 2, 4, 8))


def test_timeline_bubbles_of_1f1b():
    timeline = run_timeline(one_f_one_b(1, 4, 8), StageCosts.uniform(4))
    assert timeline.iteration_s == 30
    assert timeline.bubble_fraction((0, 0)) == pytest.approx(6 / 30)
    assert math.isclose(timeline.stage_end_s(0), 30) and timeline.stage_end_s(3) < 30
