"""`frenzy recycle plan`: the JSON summary of one failure case, and one clear line for bad input."""

import json

import pytest
from typer.testing import CliRunner

from frenzy_prefect.cli import app

runner = CliRunner()


def recycle(*args: str):
    return runner.invoke(app, ["recycle", "plan", *args])


def test_plan_json_summarises_stages_and_throughput():
    out = recycle("--dp", "4", "--pp", "3", "--microbatches", "8", "--fail", "1,1,2", "--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["failures_per_stage"] == [0, 2, 1] and data["planner"] == "heuristic"
    assert [s["live_workers"] for s in data["stages"]] == [4, 2, 3]
    assert data["stages"][1]["microbatches_per_worker"] == [16, 16]
    assert sorted(data["stages"][2]["microbatches_per_worker"]) == [10, 11, 11]
    assert data["fault_free_s"] == pytest.approx(1.0) and 0 < data["relative_throughput"] < 1
    assert all(0 <= s["bubble_fraction"] < 1 for s in data["stages"])
    assert data["steady_state_period_s"] <= data["iteration_s"] * (1 + 1e-9) and data["steady_state_relative_throughput"] > 0


@pytest.mark.parametrize("planner", ["heuristic", "milp"])
def test_plan_without_failures_is_exactly_fault_free(planner):
    out = recycle("--dp", "4", "--pp", "4", "--microbatches", "8", "--planner", planner, "--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["relative_throughput"] == 1.0 and data["steady_state_relative_throughput"] == 1.0
    assert data["iteration_s"] == data["fault_free_s"] == pytest.approx(1.0)
    text = recycle("--dp", "4", "--pp", "4", "--microbatches", "8", "--planner", planner).stdout
    assert "against 1 s without failures (the same planner's schedule): 100.0% of its throughput" in " ".join(text.split())


def test_plan_with_the_milp_and_a_step_time():
    out = recycle("--dp", "2", "--pp", "2", "--microbatches", "4", "--fail", "0", "--planner", "milp", "--step-s", "3.5", "--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["status"] == "optimal" and data["fault_free_s"] == pytest.approx(3.5) and data["iteration_s"] > 3.5


def test_plan_table_names_the_throughput():
    out = recycle("--dp", "3", "--pp", "2", "--microbatches", "6", "--fail", "1", "--actions")
    assert out.exit_code == 0, out.output
    assert "without failures (the same planner's schedule)" in " ".join(out.stdout.split()) and "(0,1): RA0@0<0 F0@0" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dp", "2", "--pp", "3", "--microbatches", "4", "--fail", "3"], "error: stage 3 does not exist; stages are 0..2 (0-based)"),
        (["--dp", "2", "--pp", "3", "--microbatches", "4", "--fail", "1,1"], "needs a checkpoint restart"),
        (["--dp", "2", "--pp", "3", "--microbatches", "4", "--fail", "a"], "--fail takes 0-based stage numbers separated by commas"),
        (["--dp", "2", "--pp", "3", "--microbatches", "0"], "microbatches must be a positive integer, got 0"),
        (["--dp", "2", "--pp", "3", "--microbatches", "4", "--planner", "x"], "unknown planner 'x'; known: heuristic, milp"),
        (["--dp", "2", "--pp", "3", "--microbatches", "4", "--step-s", "-1"], "step_s must be positive, got -1.0"),
        (
            ["--dp", "2", "--pp", "3", "--microbatches", "4", "--memory-bound", "0"],
            "memory_bound must be a positive int or 3 positive ints",
        ),
        (["--dp", "two", "--pp", "3", "--microbatches", "4"], "error: Invalid value for '--dp': Input should be a valid integer"),
        (["--pp", "3", "--microbatches", "4"], "error: Missing option '--dp'."),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    out = recycle(*args)
    assert out.exit_code == 2
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_plan_with_a_model_predicts_every_live_workers_peak_under_the_cases_schedule():
    """With --model, each stage lists its live workers' peaks (here stage 1's two survivors run six
    micro-batches each, their failed peer's share included): schedule_peaks' of the planner's
    schedule, which tests/processes/test_recycle_memory.py holds to MemTracker on real ranks."""
    from frenzy_prefect.pipeline.in_flight import schedule_peaks
    from frenzy_prefect.profiling.model import PRESETS
    from frenzy_prefect.recycle.fault_free import costs_from_fault_free_step
    from frenzy_prefect.recycle.planners import planner
    from frenzy_prefect.spec.plan import ParallelPlan
    from frenzy_prefect.spec.workload import Workload

    args = ["--dp", "3", "--pp", "2", "--microbatches", "4", "--fail", "1", "--model", "gpt-nano", "--seq-len", "64", "--precision", "fp32"]
    out = json.loads(recycle(*args, "--json").stdout)
    assert out["memory"] == {
        "model": "gpt-nano",
        "micro_batch": 1,
        "seq_len": 64,
        "precision": "fp32",
        "gpu": None,
        "gpu_memory_bytes": None,
        "usable_bytes": None,
    }
    assert "fits_per_worker" not in out["stages"][0]  # (no GPU to fit)
    schedule = planner("heuristic")(3, 2, 4, (0, 1), costs_from_fault_free_step(1.0, 3, 2, 4), None).schedule
    work = Workload(global_batch=12, seq_len=64, precision="fp32")
    expected = schedule_peaks(PRESETS["gpt-nano"], ParallelPlan(dp=3, pp=2), work, schedule)
    last = out["stages"][1]
    assert last["microbatches_per_worker"] == [6, 6] and last["peak_bytes_per_worker"] == [expected[p, 1] for p in schedule.live(1)]
    table = recycle(*args).stdout
    assert "peak each, GiB" in table
    bad = recycle(*args[:8], "--model", "nope")
    assert bad.exit_code == 2 and "model 'nope' is neither a preset" in bad.stderr


def test_peaks_over_the_gpu_are_marked_and_counted_in_one_line():
    """With --gpu, each peak is held against the GPU less the default margin: the JSON says which
    fit, the table marks those that do not, and one line counts them and says what lowers them."""
    args = ["--dp", "2", "--pp", "4", "--microbatches", "8", "--fail", "1", "--model", "llama-3.1-8b", "--seq-len", "4096", "--gpu", "H100"]
    out = json.loads(recycle(*args, "--json").stdout)
    usable = out["memory"]["usable_bytes"]
    assert usable == out["memory"]["gpu_memory_bytes"] - 4_276_040_500 and usable > 0
    for stage in out["stages"]:
        assert stage["fits_per_worker"] == [peak <= usable for peak in stage["peak_bytes_per_worker"]]
    over = sum(not fit for stage in out["stages"] for fit in stage["fits_per_worker"])
    assert 0 < over < 7
    text = " ".join(recycle(*args).stdout.split())
    assert text.count("(over)") == over
    assert f"{over} of 7 live workers exceed H100's usable 75.7 GiB (79.6 GiB less the default margin): lower --micro-batch" in text
    fits = recycle(*args[:8], "--model", "gpt2-small", "--gpu", "H100").stdout
    assert "(over)" not in fits and "exceed" not in fits
