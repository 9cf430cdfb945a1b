"""The ReCycle resilience simulator: exact throughput in hand-checkable cases, per policy."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.recycle.iteration import IterationTimes, balanced_reroute_bound
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


def test_a_rejoining_node_copies_state_while_the_others_keep_rerouting_then_takes_its_work_back():
    result = run("recycle", trace(8, (100, "remove", "node2"), (300, "add", "node2")), horizon=1000.0)
    rejoin = result.events[-1]
    assert rejoin.kind == "rejoin" and rejoin.downtime_s == 0 and rejoin.delay_s == 10.0 and rejoin.iteration_s == T
    # 10 iterations, 2 s detection, re-routed (bound: 2x) 198 s + 10 s copy, then fault-free to 1000 s
    rerouted = (300 - 102 + 10) / 20
    assert result.completed_samples == pytest.approx(16 * (10 + rerouted + (1000 - 310) / T), abs=16)


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
    oobleck = run("oobleck", tr, horizon=1000.0)
    assert oobleck.events[0].grid == "1x4" and oobleck.events[1].grid == "2x4"


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
        # re-routing that costs nothing keeps fault-free throughput through any failures
        assert free.completed_samples == 200 * 16
