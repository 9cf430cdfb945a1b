"""The ReCycle resilience simulator: exact throughput in hand-checkable cases, per policy."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.recycle.iteration import IterationTimes, StepTimeTable, balanced_reroute_bound, from_step_time_table
from frenzy_prefect.recycle.knobs import Knobs
from frenzy_prefect.recycle.membership import Membership
from frenzy_prefect.recycle.policies import POLICIES, make_policy
from frenzy_prefect.recycle.policies.base import View, reform
from frenzy_prefect.recycle.replay import simulate
from frenzy_prefect.recycle.traces import FailureTrace, NodeEvent, shrink_trace, transient_trace

T = 10.0  # fault-free iteration seconds of the full grid


def grid(dp=2, pp=4, reroute=None):
    """Fault-free time proportional to 1/GPUs (the same global batch on fewer GPUs); re-routing
    by the pessimistic bound unless told otherwise (hand-checkable, and fast)."""
    return IterationTimes(dp, pp, 8, lambda d, p: T * dp * pp / (d * p), reroute or balanced_reroute_bound(T, dp))


def trace(nodes, *events):
    adds = [NodeEvent(time_s=0, kind="add", node=f"node{k}") for k in range(1, nodes + 1)]
    return FailureTrace(name="t", events=adds + [NodeEvent(time_s=t, kind=k, node=n) for t, k, n in events])


def run(policy, tr, model=None, horizon=None, **knobs):
    model = model or grid()
    return simulate(model, tr, make_policy(policy), samples_per_iteration=16, knobs=Knobs(**knobs), horizon_s=horizon)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_without_failures_every_policy_runs_at_fault_free_throughput_and_bamboo_pays_its_overhead(policy):
    result = run(policy, trace(8), horizon=1000.0)
    expected = 16 / T / (Knobs().bamboo_overhead if policy == "bamboo" else 1)
    assert result.span_throughput == pytest.approx(expected)
    assert expected * (1 - 13 / 1000) < result.throughput <= expected  # the window cuts at most one iteration
    assert result.counts == {"start": 1} and result.lost_samples == 0 and result.downtime_s == 0
    assert result.ratio == pytest.approx(result.throughput / (16 / T))


def test_one_permanent_failure_recycle_runs_at_samples_over_rerouted_time():
    seen = []
    model = grid(reroute=lambda f: seen.append(f) or 20.0)
    # 100 fault-free iterations end at 1000 s; detection 2 s; then 50 re-routed iterations of 20 s
    result = run("recycle", trace(8, (1000, "remove", "node3")), model=model, horizon=2002.0)
    assert seen and set(seen) == {(0, 0, 1, 0)}  # node3 is pipeline 0, stage 2
    assert result.completed_samples == (100 + 50) * 16
    assert [e.kind for e in result.events] == ["start", "reroute"]
    assert result.events[1].downtime_s == 2.0 and result.events[1].iteration_s == 20.0


def test_a_rejoining_node_starts_up_while_the_others_reroute_then_copies_state_at_an_iteration_boundary():
    result = run("recycle", trace(8, (100, "remove", "node2"), (300, "add", "node2")), horizon=1000.0)
    rejoin = result.events[-1]
    # the node is up 45 s after it arrives; the copy (10 s) waits for the boundary and pauses everyone
    assert rejoin.kind == "rejoin" and rejoin.time_s == 345 and rejoin.downtime_s == 10 and rejoin.iteration_s == T
    assert rejoin.lost_samples == 0
    # 10 iterations to 100 s; 2 s detection; re-routed (bound: 2x) iterations end at 122, ..., 342, 362:
    # the one running at 345 s finishes (13 in all); copy to 372 s; 62 fault-free iterations to 1000 s
    assert result.completed_samples == 16 * (10 + 13 + 62)


def test_every_policy_redoes_the_interrupted_iteration_except_bamboos_failover():
    """A death halfway through an iteration: the first iteration after the pause ends a whole new
    iteration later, except where the real system salvages the interrupted one."""
    for policy in POLICIES:
        fault_free_s = run(policy, trace(8), horizon=100.0).events[0].iteration_s
        failure = 10.5 * fault_free_s
        tr = trace(8, (failure, "remove", "node8"))
        switch = run(policy, tr, horizon=1000.0, checkpoint_interval_s=100).events[1]
        # a quarter of the new iteration after the pause: only a salvaged iteration has ended
        horizon = failure + switch.downtime_s + 0.75 * switch.iteration_s
        result = run(policy, tr, horizon=horizon, checkpoint_interval_s=100)
        salvaged = result.completed_samples // 16 - 10
        assert salvaged == (1 if policy == "bamboo" else 0), (policy, switch.kind)
        assert result.lost_samples == 0  # the checkpoint at 100 s or later holds everything completed


def test_recycle_redoes_the_interrupted_iteration_after_detection():
    # failure at 105 s, halfway through iteration 11; 2 s detection; the re-routed iteration (20 s)
    # restarts at 107 s: iterations end at 127, 147, 167, 187 -- four by 200 s, not five
    result = run("recycle", trace(8, (105, "remove", "node3")), horizon=200.0)
    assert result.completed_samples == 16 * (10 + 4)


def test_checkpoint_restart_loses_exactly_the_work_since_the_last_checkpoint():
    # checkpoint at 250 s (iteration 25); failure at 333 s after 33 iterations: 8 are lost
    result = run("checkpoint_restart", trace(8, (333, "remove", "node8")), horizon=1000.0, checkpoint_interval_s=250)
    restart = result.events[1]
    assert restart.kind == "checkpoint-restart" and restart.lost_samples == 8 * 16 and restart.downtime_s == 120
    # 7 nodes: the fastest grid is 2 pipelines x 3 stages (6 GPUs), 8/6 x slower; resumes at 453 s
    assert restart.grid == "2x3" and restart.iteration_s == pytest.approx(T * 8 / 6)
    assert result.completed_samples == 16 * (25 + int((1000 - 453) / (T * 8 / 6)))


def test_a_stage_that_loses_every_replica_forces_a_reported_restart():
    # node1 and node5 hold stage 0 of both pipelines
    tr = trace(8, (500, "remove", "node1"), (500, "remove", "node5"))
    for policy in ("recycle", "adaptive", "drop_pipeline", "bamboo"):
        result = run(policy, tr, horizon=1000.0, checkpoint_interval_s=200)
        assert result.stage_wipeouts == 1
        restart = next(e for e in result.events if e.kind in ("checkpoint-restart", "stall"))
        assert restart.kind == ("stall" if policy == "drop_pipeline" else "checkpoint-restart"), policy
        assert result.counts.get("reroute", 0) == 0
    recycle = run("recycle", tr, horizon=1000.0, checkpoint_interval_s=200)
    restart = recycle.events[1]
    assert restart.kind == "checkpoint-restart" and "lost every replica" in restart.note
    assert restart.grid == "2x3"  # layers re-partitioned over 3 stages on the 6 survivors
    assert restart.lost_samples == (50 - 40) * 16  # checkpoints at 200 and 400 s, failure at 500 s


def test_a_spare_that_fills_a_wiped_stage_has_no_state_to_copy():
    tr = FailureTrace(
        name="t",
        events=[NodeEvent(time_s=0, kind="add", node=f"node{k}") for k in range(1, 4)]
        + [NodeEvent(time_s=50, kind="remove", node="node1")],
    )
    result = simulate(grid(dp=1, pp=2), tr, make_policy("recycle"), samples_per_iteration=16, horizon_s=200.0)
    assert result.spare_fills == 1 and result.stage_wipeouts == 1
    assert result.events[1].kind == "checkpoint-restart" and result.events[1].grid == "1x2"  # node3 loads the checkpoint


def test_drop_pipeline_shrinks_data_parallelism_and_reforms_when_the_node_returns():
    result = run("drop_pipeline", trace(8, (100, "remove", "node6"), (400, "add", "node6")), horizon=1000.0)
    drop, back = result.events[1:]
    assert drop.kind == "drop-pipeline" and drop.grid == "1x4" and drop.iteration_s == pytest.approx(2 * T)
    assert back.kind == "reconfigure" and back.grid == "2x4" and back.downtime_s == 60


def test_bamboo_fails_over_to_the_shadow_and_restarts_when_adjacent_stages_die():
    slow = Knobs().bamboo_overhead * Knobs().bamboo_failover_slowdown
    one = run("bamboo", trace(8, (100, "remove", "node2")), horizon=1000.0)
    assert one.events[1].kind == "failover" and one.events[1].iteration_s == pytest.approx(T * slow)
    adjacent = run("bamboo", trace(8, (100, "remove", "node2"), (200, "remove", "node3")), horizon=1000.0)
    assert adjacent.events[2].kind == "checkpoint-restart" and adjacent.events[2].grid == "1x4"


def test_oobleck_uses_every_node_with_pipelines_of_different_lengths():
    m = Membership(2, 4)
    for k in range(1, 8):
        m.apply(NodeEvent(time_s=0, kind="add", node=f"node{k}"), started=False)
    layout = reform(View(0, m, grid(), Knobs(), [], False), heterogeneous=True)
    assert layout is not None and [len(p) for p in layout.pipelines] == [4, 3]
    # half the rate of a 2x4 grid plus half the rate of a 2x3 grid
    assert 1 / layout.iteration_s == pytest.approx(0.5 / T + 0.5 / (T * 8 / 6))
    result = run("oobleck", trace(8, (100, "remove", "node8")), horizon=1000.0)
    assert result.events[1].kind == "reconfigure" and result.events[1].grid == "2x3/4"


def test_adaptive_reroutes_when_cheap_and_reforms_when_rerouting_is_slow():
    tr = trace(8, (100, "remove", "node3"))
    cheap = run("adaptive", tr, model=grid(reroute=lambda f: 1.05 * T), horizon=5000.0)
    assert cheap.events[1].kind == "reroute"
    slow = run("adaptive", tr, model=grid(reroute=lambda f: 3 * T), horizon=5000.0)
    assert slow.events[1].kind == "reconfigure"
    assert slow.throughput > run("recycle", tr, model=grid(reroute=lambda f: 3 * T), horizon=5000.0).throughput


def test_adaptive_is_never_below_oobleck_when_nodes_only_leave():
    for seed in range(3):
        tr = shrink_trace(32, mtbf_s=20 * 3600, horizon_s=8 * 3600, seed=seed)
        for dp, pp in ((4, 8), (8, 4)):
            model = IterationTimes(
                dp, pp, 32, lambda d, p: T * 32 / (d * p) * (1 + (p - 1) / 32), balanced_reroute_bound(T * (1 + (pp - 1) / 32), dp)
            )
            adaptive = simulate(model, tr, make_policy("adaptive"), samples_per_iteration=dp * 32, horizon_s=8 * 3600)
            oobleck = simulate(model, tr, make_policy("oobleck"), samples_per_iteration=dp * 32, horizon_s=8 * 3600)
            assert adaptive.throughput >= oobleck.throughput * 0.999


def every_10_minutes(nodes=30, failures=14):
    """The shape of Oobleck's artifact trace 10m.csv: all nodes at 0, one leaves every 10 minutes."""
    adds = [NodeEvent(time_s=0, kind="add", node=f"node{k}") for k in range(1, nodes + 1)]
    return FailureTrace(
        name="10m",
        events=adds + [NodeEvent(time_s=600.0 * (i + 1), kind="remove", node=f"node{7 * i % nodes + 1}") for i in range(failures)],
    )


@pytest.mark.parametrize(("reroute_slowdown", "better"), [(1.05, "recycle"), (1.3, "oobleck")])
def test_adaptive_learns_frequent_failures_from_the_trace_and_is_not_worse_than_the_better_mode(reroute_slowdown, better):
    """Failures every 10 minutes, re-forming at a 60 s pause: re-routing 5% slower than a re-formed
    grid is the better mode (a prior of one failure an hour would pick re-forming for the first
    several failures); 30% slower, re-forming is."""
    model = IterationTimes(5, 6, 8, lambda d, p: T * 30 / (d * p), lambda f: T * 30 / (30 - sum(f)) * reroute_slowdown)
    tr, knobs = every_10_minutes(), Knobs(oobleck_reconfigure_s=60)
    results = {p: simulate(model, tr, make_policy(p), samples_per_iteration=64, knobs=knobs) for p in ("recycle", "oobleck", "adaptive")}
    assert max(results, key=lambda p: results[p].throughput if p != "adaptive" else 0) == better
    assert results["adaptive"].throughput >= max(results["recycle"].throughput, results["oobleck"].throughput) * (1 - 1e-9)


def test_adaptive_keeps_a_reformed_grid_when_taking_a_joining_node_in_costs_more_than_it_gains():
    model = IterationTimes(5, 6, 8, lambda d, p: T * 30 / (d * p), lambda f: 3 * T)  # re-routing is slow: re-form
    tr = trace(30, (100, "remove", "node7"), (200, "add", "node7"))  # node7 is up again at 245 s
    frequent = run("adaptive", tr, model=model, horizon=2000.0)
    # changes every ~120 s so far: one more node (30/29 faster) is not worth a pause and a lost iteration
    assert [(e.time_s, e.kind) for e in frequent.events] == [(0, "start"), (100, "reconfigure")]
    rare = run("adaptive", tr, model=model, horizon=2000.0, expected_gap_s=36000)
    assert [(e.time_s, e.kind, e.grid) for e in rare.events][2] == (245, "reconfigure", "5x6")


@pytest.mark.parametrize(("outage_s", "chosen"), [(60.0, "reroute"), (2000.0, "reconfigure")])
def test_adaptive_weighs_a_failure_over_the_outages_it_has_seen_end(outage_s, chosen):
    """Re-routing a stage-0 failure (12 s) is slower than re-forming 7 nodes (11.43 s). Over a
    learnt outage of 60 s, re-routing and a state copy (2 + 10 s) beat a re-form now and one when the
    node is back (10 + 10 s); over 2,000 s the faster re-formed grid wins. The first outage (a
    stage-2 failure, cheap to re-route) is what the policy learns the outage from."""
    model = grid(reroute=lambda f: 10.5 if f[2] else 12.0)
    join = Knobs().join_delay_s
    tr = trace(
        8,
        (1000, "remove", "node3"),
        (1000 + outage_s - join, "add", "node3"),
        (5000, "remove", "node5"),
        (5000 + outage_s - join, "add", "node5"),
    )
    result = run("adaptive", tr, model=model, horizon=9000.0)
    assert [(e.time_s, e.kind) for e in result.events][:4] == [(0, "start"), (1000, "reroute"), (1000 + outage_s, "rejoin"), (5000, chosen)]
    others = {p: run(p, tr, model=model, horizon=9000.0).throughput for p in ("recycle", "oobleck")}
    assert result.throughput >= max(others.values()) * (1 - 1e-9)


def test_adaptive_decides_from_the_trace_so_far_never_from_its_future():
    tr = transient_trace(8, mtbf_s=1500, repair_s=300, horizon_s=6000, seed=3)
    cut = 3000.0
    full = run("adaptive", tr, horizon=6000.0)
    prefix = run("adaptive", FailureTrace(name="t", events=[e for e in tr.events if e.time_s <= cut]), horizon=6000.0)
    before = [e for e in full.events if e.time_s < cut]
    assert len(before) > 3 and before == [e for e in prefix.events if e.time_s < cut]


def test_the_ceiling_is_above_every_policy_on_a_trace():
    tr = transient_trace(8, mtbf_s=1500, repair_s=300, horizon_s=6000, seed=1)
    ceiling = run("ceiling", tr, horizon=6000.0)
    assert ceiling.downtime_s == 0 and ceiling.lost_samples == 0
    for policy in POLICIES:
        assert run(policy, tr, horizon=6000.0).completed_samples <= ceiling.completed_samples


def test_a_job_starts_with_whatever_nodes_the_trace_has_first():
    tr = FailureTrace(
        name="t",
        events=[NodeEvent(time_s=60, kind="add", node=f"node{k}") for k in range(1, 5)]
        + [NodeEvent(time_s=200, kind="add", node=f"node{k}") for k in range(5, 9)],
    )
    result = run("recycle", tr, horizon=1000.0)
    assert result.start_s == 60 and result.workers_at_start == 4
    # every stage has one live worker: ReCycle starts on the full grid, re-routing around the holes
    assert result.events[0].grid == "2x4" and result.events[0].iteration_s == pytest.approx(2 * T)
    assert result.events[1].kind == "rejoin" and result.events[1].iteration_s == T
    assert result.events[1].time_s == 200 + 45 - 60  # the added nodes are up 45 s after they arrive
    oobleck = run("oobleck", tr, horizon=1000.0)
    # Oobleck's artifact takes added nodes in only at the next failure's reconfiguration
    assert [(e.kind, e.grid) for e in oobleck.events] == [("start", "1x4")]
    failing = FailureTrace(name="t", events=tr.events + [NodeEvent(time_s=500, kind="remove", node="node5")])
    assert [(e.kind, e.grid) for e in run("oobleck", failing, horizon=1000.0).events] == [("start", "1x4"), ("reconfigure", "2x3/4")]


def test_busy_traces_replay_quickly_and_consistently():
    tr = transient_trace(32, mtbf_s=3600, repair_s=900, horizon_s=6 * 3600, seed=3)
    for policy in POLICIES:
        model = IterationTimes(4, 8, 32, lambda d, p: T * 32 / (d * p), balanced_reroute_bound(T, 4))
        result = simulate(model, tr, make_policy(policy), samples_per_iteration=128)
        assert 0 <= result.ratio <= 1 and result.completed_samples % 128 == 0
        assert result.counts["start"] == 1 and result.events[0].kind == "start"


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(FrenzyError, match="unknown policy 'spare'; known: recycle, checkpoint_restart"):
        make_policy("spare")
    with pytest.raises(FrenzyError, match="the horizon must be positive"):
        simulate(grid(), trace(8), make_policy("recycle"), samples_per_iteration=16)


toggles = st.lists(st.tuples(st.integers(1, 1999), st.integers(1, 10)), max_size=25)


@settings(max_examples=60, deadline=None)
@given(toggles)
def test_no_policy_beats_fault_free_and_the_books_balance(flips):
    """Random add/remove toggles of 10 nodes (2 spares) on a 2 x 4 grid."""
    alive, events = set(range(1, 11)), []
    for t, k in sorted(flips):
        events.append((float(t), "remove" if k in alive else "add", f"node{k}"))
        alive ^= {k}
    tr = trace(10, *events)
    for policy in POLICIES:
        result = run(policy, tr, horizon=2000.0)
        assert 0 <= result.span_ratio <= 1 + 1e-9 and 0 <= result.ratio <= 1 + 1e-9
        assert result.completed_samples % 16 == 0 and result.lost_samples >= 0
        assert result.counts["start"] == 1 and result.events[0].kind == "start"
    free = run("recycle", tr, model=grid(reroute=lambda f: T), horizon=2000.0, detection_s=0, state_copy_s=0)
    if free.stage_wipeouts == 0 and free.counts.get("reconfigure", 0) == 0:
        # re-routing that costs nothing keeps fault-free throughput through any failures, but for
        # the interrupted iteration each one redoes
        assert 16 * (200 - free.counts.get("reroute", 0)) <= free.completed_samples <= 16 * 200


def table_grid(seconds, reroute=None):
    """A 2 x 4 grid timed by a step-time table (re-routing injected, else the table alone)."""
    return from_step_time_table(StepTimeTable(seconds), dp=2, pp=4, microbatches=8, reroute=reroute or (lambda f: 0.0))


def test_every_policy_reads_the_step_time_table_at_the_workers_it_runs_on():
    model = table_grid({8: 10.0, 7: 11.0, 6: 13.0, 4: 20.0}, reroute=lambda f: 10.5)
    tr = trace(8, (100, "remove", "node8"))
    first = {policy: run(policy, tr, model=model, horizon=1000.0).events[1] for policy in POLICIES}
    # Oobleck's templates use all 7 nodes; ReCycle's grid with a hole runs on 7 too, and its planner's
    # 10.5 s cannot beat what the table says 7 workers do; checkpoint-restart's homogeneous 2 x 3 runs on 6
    assert first["oobleck"].iteration_s == 11.0 and first["recycle"].iteration_s == 11.0
    assert first["checkpoint_restart"].grid == "2x3" and first["checkpoint_restart"].iteration_s == 13.0
    assert first["drop_pipeline"].iteration_s == 20.0  # one pipeline of 4
    assert first["bamboo"].iteration_s == pytest.approx(10.0 * Knobs().bamboo_overhead * Knobs().bamboo_failover_slowdown)
    slow = table_grid({8: 10.0, 7: 11.0}, reroute=lambda f: 12.5)
    assert run("recycle", tr, model=slow, horizon=1000.0).events[1].iteration_s == 12.5  # the planner's slower schedule stands


def test_a_zero_in_the_step_time_table_means_that_many_workers_cannot_run():
    table = StepTimeTable({8: 10.0, 7: 11.0, 6: 0.0})
    assert table.step_s(6) is None and table.step_s(5) is None  # below a 0 entry: cannot run either
    assert table_grid({8: 10.0, 6: 0.0}).layout_s((3, 4)) is None  # 7 lies next to a 0: cannot run
    model = table_grid(table.seconds)
    tr = trace(8, (100, "remove", "node8"), (200, "remove", "node7"), (400, "add", "node7"))
    for policy in ("recycle", "oobleck", "adaptive", "checkpoint_restart"):
        result = run(policy, tr, model=model, horizon=1000.0)
        assert [e.kind for e in result.events][2] == "stall", policy  # 6 workers: nothing runs
        assert result.events[3].time_s == 445, policy  # node7 is up 45 s after 400 s
        if policy == "checkpoint_restart":  # its homogeneous grids on 7 nodes (2 x 3, 1 x 4) use 6 or fewer
            assert result.events[3].kind == "stall" and result.completed_samples == 16 * 10
            continue
        assert result.events[3].iteration_s == 11.0, policy
        assert 240 < result.stalled_s <= 245, policy  # nothing ran from the (pause after the) loss to then
    with pytest.raises(FrenzyError, match="the step-time table says 8 workers cannot run"):
        table_grid({8: 0.0, 4: 3.0})
