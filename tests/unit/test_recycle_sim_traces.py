"""Failure traces, worker mapping and iteration-time sources of the ReCycle simulator."""

import json
import statistics

import pytest

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.recycle.iteration import (
    IterationTimes,
    StepTimeTable,
    balanced_reroute_bound,
    from_step_time_table,
    from_throughput_model,
    load_step_time_table,
)
from frenzy_prefect.recycle.knobs import Knobs
from frenzy_prefect.recycle.membership import Membership, load_mapping
from frenzy_prefect.recycle.policies import make_policy
from frenzy_prefect.recycle.replay import simulate
from frenzy_prefect.recycle.traces import NodeEvent, load_failure_trace, shrink_trace, transient_trace
from frenzy_prefect.scheduling.inputs import shared_traces
from tests.support.stack import ROOT

FAILURES = shared_traces() / "failures"


needs_traces = pytest.mark.skipif(not FAILURES.exists(), reason="the shared traces are not beside this checkout")


@needs_traces
@pytest.mark.parametrize(("name", "events", "peak", "nodes"), [("p3-trace", 344, 32, 177), ("g4dn-trace", 153, 24, 79)])
def test_the_shared_spot_traces_load_whole(name, events, peak, nodes):
    trace = load_failure_trace(FAILURES / f"{name}.csv")
    assert len(trace.events) == events
    assert max(n for _, n in trace.alive_over_time()) == peak
    assert len({e.node for e in trace.events}) == nodes  # a preempted instance never comes back under its name
    assert [e.time_s for e in trace.events] == sorted(e.time_s for e in trace.events)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("0,add,node1\n10,add\n", r":2: expected 3 fields time_ms,add\|remove,nodeN, got 2"),
        ("0,add,node1\n1.5,remove,node1\n", r":2: field 1 \(time_ms\): '1.5' is not a whole number of milliseconds"),
        ("0,add,node1\n5,kill,node1\n", r":2: field 2 \(event\): 'kill' is not add or remove"),
        ("0,add,server1\n", r":1: field 3 \(node\): 'server1' is not a node name like node7"),
        ("9,add,node1\n3,add,node2\n", r":2: field 1 \(time_ms\): 3 is earlier than the previous event \(9\)"),
        ("0,add,node1\n# comment\n4,add,node1\n", r":3: node1 is added but is already present \(added at line 1\)"),
        ("0,add,node1\n4,remove,node2\n", r":2: node2 is removed but is not present"),
        ("\n# nothing\n", r"no events"),
    ],
)
def test_a_bad_trace_line_is_named_by_file_line_and_field(tmp_path, body, message):
    path = tmp_path / "t.csv"
    path.write_text(body)
    with pytest.raises(FrenzyError, match=rf"t\.csv{message}" if message.startswith(":") else message):
        load_failure_trace(path)


def test_transient_traces_are_seeded_and_their_failures_are_exponential_with_the_mtbf():
    one = transient_trace(20, mtbf_s=1000, repair_s=100, horizon_s=200_000, seed=7)
    assert one == transient_trace(20, mtbf_s=1000, repair_s=100, horizon_s=200_000, seed=7)
    assert one != transient_trace(20, mtbf_s=1000, repair_s=100, horizon_s=200_000, seed=8)
    up: list[float] = []
    repairs: list[float] = []
    for k in range(1, 21):
        times = [(e.time_s, e.kind) for e in one.events if e.node == f"node{k}"]
        for (t0, k0), (t1, k1) in zip(times, times[1:], strict=False):
            (up if k0 == "add" else repairs).append(t1 - t0)
            assert k0 != k1  # add and remove alternate
    assert len(up) > 3000
    assert statistics.mean(up) == pytest.approx(1000, rel=0.06)  # ~1.7% standard error
    assert statistics.stdev(up) == pytest.approx(1000, rel=0.1)  # exponential: sd = mean
    assert set(round(r, 6) for r in repairs) == {100.0}


def test_shrink_traces_only_lose_nodes():
    trace = shrink_trace(32, mtbf_s=3600, horizon_s=7200, seed=1)
    removes = [e for e in trace.events if e.kind == "remove"]
    assert len([e for e in trace.events if e.kind == "add"]) == 32 and all(e.time_s == 0 for e in trace.events if e.kind == "add")
    assert len({e.node for e in removes}) == len(removes)  # nobody leaves twice, nobody returns
    assert 32 * 0.6 < len(removes) < 32 * 0.95  # P(fail before 2 MTBF) = 86%
    assert trace.alive_over_time()[-1][1] == 32 - len(removes)


def test_default_mapping_is_pipeline_major_and_nodes_beyond_the_grid_are_spares_that_fill_vacancies():
    m = Membership(dp=2, pp=3)
    for k in range(1, 8):
        m.apply(NodeEvent(time_s=0, kind="add", node=f"node{k}"), started=False)
    assert m.holders == ["node1", "node2", "node3", "node4", "node5", "node6"]  # node5 -> pipeline 1, stage 1
    assert m.spares == ["node7"] and m.outside_grid == {"node7"}
    changes = m.apply(NodeEvent(time_s=1, kind="remove", node="node5"), started=True)
    assert [(c.kind, c.node, c.slot) for c in changes] == [("lost", "node5", 4), ("filled", "node7", 4)]
    assert m.stateful[4] and m.spare_fills == 1  # copied from node2, its stage's live peer
    m.apply(NodeEvent(time_s=2, kind="add", node="node5"), started=True)
    assert m.spares == ["node5"]  # its home is taken: it waits


def test_without_vacancy_filling_nodes_beyond_the_grid_never_join():
    m = Membership(dp=1, pp=2, fill_vacancies=False)
    for k in (1, 2, 3):
        m.apply(NodeEvent(time_s=0, kind="add", node=f"node{k}"), started=False)
    m.apply(NodeEvent(time_s=1, kind="remove", node="node1"), started=True)
    assert m.holders == [None, "node2"] and m.spares == ["node3"] and m.lost_stages() == [0]


def test_a_mapping_file_pins_nodes_and_bad_lines_are_named(tmp_path):
    path = tmp_path / "map.csv"
    path.write_text("# node,pipeline,stage\nnode9,0,1\nnode3,1,0\n")
    assert load_mapping(path, dp=2, pp=2) == {"node9": 1, "node3": 2}
    for body, message in [
        ("node1,2,0\n", r"map\.csv:1: field pipeline: '2' is not a whole number in 0\.\.1"),
        ("node1,0,0\nnode2,0,0\n", r"map\.csv:2: pipeline 0 stage 0 is already mapped to node1"),
        ("node1,0\n", r"map\.csv:1: expected 3 fields nodeN,pipeline,stage"),
        ("gpu1,0,0\n", r"map\.csv:1: field 1 \(node\): 'gpu1' is not a node name"),
    ]:
        path.write_text(body)
        with pytest.raises(FrenzyError, match=message):
            load_mapping(path, dp=2, pp=2)


def test_the_step_time_table_interpolates_throughput_and_rejects_bad_files(tmp_path):
    path = tmp_path / "steps.json"
    path.write_text(json.dumps({"32": 1.0, "16": 2.5, "8": 4.0}))
    table = load_step_time_table(path)
    assert table.step_s(32) == 1.0 and table.step_s(16) == 2.5
    assert table.step_s(24) == pytest.approx(1 / (0.5 / 2.5 + 0.5 / 1.0))  # throughput halfway
    assert table.step_s(4) == pytest.approx(8.0)  # below the table: per-worker throughput held
    assert table.step_s(40) == 1.0  # above: the largest entry
    model = from_step_time_table(table, dp=4, pp=8, microbatches=32)
    assert model.fault_free_s(4, 8) == 1.0 and model.fault_free_s(2, 8) == 2.5
    for body, message in [
        ("[1, 2]", "expected a non-empty JSON object"),
        ('{"x": 1}', "key 'x' is not a positive whole number of workers"),
        ('{"8": -1}', r"workers 8: step time -1 is not a number of seconds >= 0 \(0: cannot run on that many workers\)"),
        ('{"8": "fast"}', "workers 8: step time 'fast' is not a number of seconds"),
        ("{", r"steps\.json:1:2: not JSON"),
    ]:
        path.write_text(body)
        with pytest.raises(FrenzyError, match=message):
            load_step_time_table(path)


def test_the_pessimistic_bound_stretches_by_the_most_loaded_stage_and_injection_replaces_it():
    assert balanced_reroute_bound(10.0, 4)((0, 1, 2, 0)) == pytest.approx(20.0)
    seen = []
    model = IterationTimes(4, 4, 16, lambda d, p: 10.0, reroute=lambda f: seen.append(f) or 11.0)
    assert model.rerouted_s((0, 0, 0, 0)) == 10.0 and seen == []  # no failures: fault-free, no lookup
    assert model.rerouted_s((1, 0, 0, 3)) == 11.0 and seen == [(1, 0, 0, 3)]
    with pytest.raises(FrenzyError, match="no live replica cannot be re-routed"):
        model.rerouted_s((4, 0, 0, 0))


def test_without_an_injected_reroute_the_planners_schedules_give_the_times():
    from frenzy_prefect.recycle.iteration import planned_reroute

    planned = IterationTimes(2, 3, 4, lambda d, p: 6.0).rerouted_s((1, 0, 0))
    assert planned == planned_reroute(6.0, 2, 3, 4)((1, 0, 0))
    assert 6.0 < planned < balanced_reroute_bound(6.0, 2)((1, 0, 0))  # bubbles absorb part of the extra work


def test_the_throughput_model_source_keeps_the_global_batch_when_the_grid_shrinks():
    from frenzy_prefect.profiling.model import PRESETS
    from frenzy_prefect.spec.catalog import GPU_CATALOG

    model = from_throughput_model(PRESETS["gpt2-xl"], GPU_CATALOG["A100-80GB"], dp=4, pp=8, microbatches=32)
    full, three, halved = model.fault_free_s(4, 8), model.fault_free_s(3, 8), model.fault_free_s(2, 8)
    assert 0 < full < three < halved
    assert halved == pytest.approx(2 * full, rel=0.25)  # half the GPUs, same batch: about twice as long


def test_the_optimistic_bound_hides_rerouted_work_in_bubbles_until_they_are_full():
    from frenzy_prefect.recycle.iteration import bubble_filling_bound

    bound = bubble_filling_bound(10.0, dp=8, pp=4, microbatches=32)  # 35 slots per worker
    assert bound((1, 0, 0, 0)) == pytest.approx(10.0 * (32 * 8 / 7) / 35)  # 36.6 micro-batches in 35 slots
    assert bubble_filling_bound(10.0, dp=8, pp=8, microbatches=32)((1, 0, 0, 0, 0, 0, 0, 0)) == 10.0  # 36.6 fit in 39
    assert bound((2, 0, 0, 0)) < balanced_reroute_bound(10.0, 8)((2, 0, 0, 0))


ARTIFACT = ROOT / "benchmarks" / "data" / "oobleck_artifact"


@pytest.mark.parametrize("model", ["GPT-3-6_7b", "BERT-large"])
@pytest.mark.parametrize("trace", ["1h", "10m"])
def test_our_oobleck_reproduces_oobleck_artifact_simulator_on_its_shrinking_traces(model, trace):
    """The artifact's own figures (recorded by running it, see benchmarks/data/oobleck_artifact),
    its step times as our table and its pause as our knob: within 2% over the training span."""
    artifact = json.loads((ARTIFACT / "artifact.json").read_text())
    spec = artifact["models"][model]
    figure = next(f["samples_per_s"] for f in artifact["oobleck"] if f["model"] == model and f["trace"] == trace)
    table = StepTimeTable({int(n): s for n, s in spec["step_s_by_nodes"].items()})
    times = from_step_time_table(table, dp=5, pp=6, microbatches=16)
    knobs = Knobs(oobleck_reconfigure_s={"GPT-3-6_7b": 10, "BERT-large": 2}[model])
    nodes = load_failure_trace(ARTIFACT / "traces" / f"{trace}.csv")
    ours = simulate(times, nodes, make_policy("oobleck"), samples_per_iteration=spec["samples_per_step"], knobs=knobs)
    assert ours.counts == {"start": 1, "reconfigure": 14}
    assert ours.span_throughput == pytest.approx(figure, rel=0.02)
