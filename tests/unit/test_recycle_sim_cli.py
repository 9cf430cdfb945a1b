"""`frenzy recycle simulate`: the throughput of a policy through a node trace, as a table or JSON."""

import json

import pytest
from typer.testing import CliRunner

from frenzy_prefect.cli import app

runner = CliRunner()


TRACE = "0,add,node1\n0,add,node2\n0,add,node3\n0,add,node4\n600000,remove,node2\n3600000,add,node2\n"


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "nodes.csv"
    path.write_text(TRACE)
    return path


def test_json_from_a_step_time_table(trace, tmp_path):
    table = tmp_path / "steps.json"
    table.write_text('{"4": 2.0, "2": 3.5}')
    args = [
        *"recycle simulate --trace".split(),
        str(trace),
        *"--dp 2 --pp 2 --microbatches 8 --step-time-table".split(),
        str(table),
        *"--samples-per-step 64 --policy recycle --horizon-s 7200 --json".split(),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["fault_free_throughput"] == 32.0 and out["samples_per_iteration"] == 64
    assert out["counts"] == {"start": 1, "reroute": 1, "rejoin": 1}
    assert 0.5 < out["ratio"] < 1 and out["horizon_s"] == 7200


def test_the_table_uses_the_throughput_model_by_default_and_a_mapping(trace, tmp_path):
    mapping = tmp_path / "map.csv"
    mapping.write_text("node1,0,0\nnode2,1,0\nnode3,0,1\nnode4,1,1\n")  # node2 holds stage 0 of pipeline 1
    args = [
        *"recycle simulate --trace".split(),
        str(trace),
        *"--dp 2 --pp 2 --microbatches 4 --mapping".split(),
        str(mapping),
        *"--policy drop_pipeline --knob drop_reform_s=5 --horizon-s 7200".split(),
    ]
    result = runner.invoke(app, args, env={"COLUMNS": "150"})
    assert result.exit_code == 0, result.output
    assert "drop-pipeline 1, reconfigure 1" in result.stdout
    # both throughputs, over the fixed window and over the training span, each with its ratio
    out = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    window = next(line for line in result.stdout.splitlines() if "throughput (window)" in line)
    span = next(line for line in result.stdout.splitlines() if "throughput (training span)" in line)
    assert f"{out['throughput']:.2f} samples/s, {out['ratio']:.1%}" in window
    assert f"{out['span_throughput']:.2f} samples/s, {out['span_ratio']:.1%}" in span
    assert out["throughput"] != out["span_throughput"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--policy", "spares"], "unknown policy 'spares'"),
        (["--knob", "restart=5"], "--knob 'restart=5': expected NAME=VALUE with NAME one of detection_s"),
        (["--knob", "restart_s=-1"], "restart_s: Input should be greater than or equal to 0"),
        (["--gpu", "B300"], "unknown GPU type 'B300'"),
        (["--horizon-s", "0"], "the horizon must be positive"),
        (["--step-time-table", "steps.json"], "--step-time-table needs --samples-per-step"),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_exit_2(trace, extra, message):
    result = runner.invoke(app, ["recycle", "simulate", "--trace", str(trace), "--dp", "2", "--pp", "2", "--microbatches", "4", *extra])
    assert result.exit_code == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_bad_trace_line_is_named(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("0,add,node1\nlater,remove,node1\n")
    result = runner.invoke(app, ["recycle", "simulate", "--trace", str(path), "--dp", "1", "--pp", "1", "--microbatches", "1"])
    assert result.exit_code == 2 and "bad.csv:2: field 1 (time_ms): 'later' is not a whole number" in result.stderr
