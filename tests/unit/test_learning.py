"""What a cluster's finished runs teach the next plan (allocator/learning.py, memory/run_records.py,
`frenzy calibrate --from-runs`): measurements above the prediction raise the next plan's numbers,
below lower them, and too few runs change nothing."""

from __future__ import annotations

import json

import pytest

from frenzy_prefect.allocator.learning import MINIMUM_RUNS, learn, record_of
from frenzy_prefect.allocator.step_time import predict_step
from frenzy_prefect.memory import estimate, peak_bytes
from frenzy_prefect.memory.calibration import Calibration, GpuConstants
from frenzy_prefect.memory.run_records import CalibrationStore, RankRecord, RunRecord
from frenzy_prefect.profiling.model import PRESETS
from frenzy_prefect.spec.catalog import GPU_CATALOG
from frenzy_prefect.spec.plan import ParallelPlan, Placement
from frenzy_prefect.spec.result import RankPeak, TrainingResult
from frenzy_prefect.spec.workload import Workload
from tests.support.cli import frenzy
from tests.support.training import make_job, unchecked

A10, MODEL, GIB = GPU_CATALOG["A10"], PRESETS["gpt2-small"], 2**30


NEXT = (ParallelPlan(micro_batch=16), Workload(global_batch=16, seq_len=1024))


def runs(memory_factor: float, step_factor: float, n: int = MINIMUM_RUNS) -> CalibrationStore:
    """``n`` one-GPU runs on A10s whose GPUs held ``memory_factor`` x MARP's tensors + 1 GiB and
    whose steps took ``step_factor`` x the predicted time."""
    records = []
    for micro_batch in (2, 4, 8, 12, 6)[:n]:
        plan, work = ParallelPlan(micro_batch=micro_batch), Workload(global_batch=micro_batch, seq_len=1024)
        tensors = peak_bytes(MODEL, plan, work, gpu=A10, calibration=Calibration(gpus={"A10": GpuConstants()}))
        rank = RankRecord(
            rank=0, stage=0, predicted_tensors_bytes=tensors, reserved_bytes=round(memory_factor * tensors), outside_allocator_bytes=GIB
        )
        step = predict_step(MODEL, plan, work, gpu=A10).seconds
        records.append(
            RunRecord(
                source=f"run-{micro_batch}",
                gpu_type="A10",
                model=MODEL,
                plan=plan,
                work=work,
                ranks=[rank],
                measured_step_s=step_factor * step,
            )
        )
    return CalibrationStore(cluster="lab").add(*records)


def next_plan(store: CalibrationStore) -> tuple[int, float]:
    learned = learn(store, A10)
    return peak_bytes(MODEL, *NEXT, gpu=learned.gpu, calibration=learned.calibration), predict_step(MODEL, *NEXT, gpu=learned.gpu).seconds


def test_runs_that_held_more_and_stepped_slower_than_predicted_raise_the_next_plans_numbers():
    assumed = peak_bytes(MODEL, *NEXT, gpu=A10), predict_step(MODEL, *NEXT, gpu=A10).seconds
    more, slower = next_plan(runs(1.40, 1.5))
    less, faster = next_plan(runs(1.00, 0.8))
    assert more > assumed[0] > less and slower > assumed[1] > faster
    # The fit recovers what the runs measured: x1.40 and the GiB outside the allocator.
    constants = learn(runs(1.40, 1.5), A10).constants
    assert constants.fragmentation == pytest.approx(1.40, rel=1e-3) and constants.overhead_bytes == pytest.approx(GIB, rel=0.01)
    assert learn(runs(1.40, 1.5), A10).summary().startswith(f"memory calibrated from {MINIMUM_RUNS} runs on A10; step time from")


def test_fewer_runs_than_the_minimum_teach_nothing():
    store = runs(1.40, 1.5, n=MINIMUM_RUNS - 1)
    learned = learn(store, A10)
    assert learned.constants is None and learned.gpu == A10 and learned.last == store.records[-1]
    assert next_plan(store) == (peak_bytes(MODEL, *NEXT, gpu=A10), predict_step(MODEL, *NEXT, gpu=A10).seconds)
    assert learned.summary() == f"documented assumptions for A10 ({MINIMUM_RUNS - 1} measured runs; {MINIMUM_RUNS} are needed)"
    assert learn(store, GPU_CATALOG["T4"]).memory_runs == 0  # another type's runs teach this one nothing


def test_calibrate_from_runs_shows_each_run_and_refits_without_a_gpu(tmp_path):
    store, out = tmp_path / "lab.json", tmp_path / "calibration.json"
    store.write_text(runs(1.40, 1.5).model_dump_json())
    done = frenzy("calibrate", "--from-runs", str(store), "--out", str(out), columns=200)
    assert done.returncode == 0, done.stderr
    assert "calibration store of lab: 3 runs" in done.stdout and "run-8" in done.stdout
    assert f"A10: memory calibrated from {MINIMUM_RUNS} runs on A10" in done.stdout
    written = Calibration.model_validate(json.loads(out.read_text()))
    assert written.gpus["A10"].source == "fitted" and written.gpus["A10"].fragmentation == pytest.approx(1.40, rel=1e-3)
    store.write_text("{not json")
    bad = frenzy("calibrate", "--from-runs", str(store))
    assert bad.returncode != 0 and f"cannot read calibration store {store}" in bad.stderr and "Traceback" not in bad.stderr


def job_on(plan: ParallelPlan):
    placements = [Placement(node="a10-node", host="localhost", gpus=list(range(plan.gpus)))]
    return make_job(unchecked("/tmp/never-read.txt"), "/tmp/out", plan, placements, global_batch=8)


def test_a_finished_run_is_recorded_per_stage_with_its_most_loaded_rank():
    job = job_on(ParallelPlan(dp=2, pp=2, micro_batch=2))
    peaks = [RankPeak(rank=r, allocated_bytes=100 + r, reserved_bytes=(5, 9, 7, 3)[r], outside_allocator_bytes=GIB) for r in range(4)]
    done = {"steps": 3, "losses": [3.0, 2.0, 1.0], "checkpoint": "c", "world_size": 4, "backend": "nccl", "wall_s": 3.0}
    result = TrainingResult(**done, tokens_per_s=1.0, step_s=[5.0, 1.0, 3.0], rank_peaks=peaks)
    record = record_of(job, result, "flow-run-1")
    neutral = Calibration(gpus={"A10": GpuConstants()})
    predicted = estimate(job.model, job.allocation.plan, job.request.workload, gpu=A10, calibration=neutral)
    # ranks are numbered stage-major: 0-1 stage 0, 2-3 stage 1; the most reserved of each stage
    assert [(k.rank, k.stage, k.reserved_bytes) for k in record.ranks] == [(1, 0, 9), (2, 1, 7)]
    assert [k.predicted_tensors_bytes for k in record.ranks] == [s.total for s in predicted.per_stage]
    assert record.ranks[0].device_bytes == 9 + GIB
    assert (record.measured_step_s, record.predicted_step_s, record.gpu_type) == (2.0, 1.0, "A10")  # the median after the first
    on_cpu = record_of(job, result.model_copy(update={"rank_peaks": []}), "cpu-run")
    assert [(k.rank, k.reserved_bytes) for k in on_cpu.ranks] == [(0, None), (2, None)]  # no allocator: the stage's first rank


def test_the_next_plan_on_a_cluster_uses_what_its_runs_taught():
    from frenzy_prefect.allocator import candidate_plans
    from frenzy_prefect.allocator.learning import applied
    from frenzy_prefect.spec.cluster import ClusterSpec
    from frenzy_prefect.spec.request import TrainingRequest

    cluster = ClusterSpec(nodes=[{"name": "n", "host": "n", "gpu_type": "A10", "gpu_count": 4}])
    request = TrainingRequest(model="gpt2-small", dataset="/tmp/d.txt", global_batch=16, seq_len=1024, steps=10)
    before = candidate_plans(MODEL, request, cluster)[0]
    taught, calibration, learned = applied(runs(1.40, 1.5), cluster)
    assert taught.gpu_types["A10"].achievable_fraction < A10.achievable_fraction
    after = {(c.plan, c.gpu_type): c for c in candidate_plans(MODEL, request, taught, calibration)}[before.plan, "A10"]
    assert after.memory.peak_bytes > before.memory.peak_bytes and after.step_time_s > before.step_time_s
    untaught = applied(CalibrationStore(cluster="lab"), cluster)
    assert untaught[0] == cluster and [r.memory_runs for r in untaught[2]] == [0]
