"""Sia's workloads replayed at a throughput table's speeds (issue 29 item 4): the reader, the
table, and the simulator on them under every policy, against arithmetic done here by hand."""

import json
import math

import pytest

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.scheduling.inputs import load_cluster, load_sia_workload
from frenzy_prefect.scheduling.policies import POLICIES, make_policy
from frenzy_prefect.scheduling.simulator import simulate
from frenzy_prefect.scheduling.throughput import ThroughputTable
from frenzy_prefect.scheduling.workloads import load_jobs
from tests.support.cli import frenzy
from tests.support.stack import ROOT

SIA = ROOT / "benchmarks" / "data" / "sia"


SATURN_1 = SIA / "workloads" / "saturn" / "workload-1.csv"


HEADER = "model,global_batch,gpu_type,gpus,step_s,spread_step_s,startup_s,job_steps\n"


@pytest.fixture(scope="module")
def table():
    return ThroughputTable.load(SIA / "throughput.csv")


@pytest.fixture(scope="module")
def cluster():
    return load_cluster(SIA / "cluster.yaml")


def types(cluster):
    return list(dict.fromkeys(n.gpu_type for n in cluster.nodes))


def test_every_job_of_sias_workloads_has_its_shape_in_the_table_with_steps(table):
    for path in sorted((SIA / "workloads").glob("*/*.csv")):
        for job in load_sia_workload(path):
            shape = table.shape(job.application, job.batch_size)
            assert shape.job_steps and shape.job_steps > 0 and shape.startup_s > 0, (path.name, job.name)


def test_a_sia_workload_reads_whole_in_submission_order():
    jobs = load_sia_workload(SATURN_1)
    assert len(jobs) == 160
    assert [j.time for j in jobs] == sorted(j.time for j in jobs)
    assert {j.application for j in jobs} == {"bert", "cifar10", "deepspeech2", "imagenet", "yolov3"}


@pytest.mark.parametrize(
    ("rows", "error"),
    [
        ("a,10.0,cifar10,4,2048\na,20,cifar10,4,2048\n", ":3: column name: 'a' repeats line 2; job names must be unique"),
        ("a,10,cifar10,four,2048\n", ":2: column num_replicas: 'four' is not a number"),
        ("a,10,cifar10,0,2048\n", ":2: num_replicas: Input should be greater than 0"),
        ("", " holds no jobs"),
    ],
)
def test_a_bad_sia_workload_row_is_named_by_line_and_column(tmp_path, rows, error):
    path = tmp_path / "w.csv"
    path.write_text("name,time,application,num_replicas,batch_size\n" + rows)
    with pytest.raises(FrenzyError, match=error):
        load_sia_workload(path)


def test_the_table_frontier_keeps_counts_faster_than_every_smaller_one(table, cluster):
    node_gpus = {n.gpu_type: n.gpu_count for n in cluster.nodes}
    for gpu_type in types(cluster):
        frontier = table.frontier("cifar10", 2048, gpu_type, 64, node_gpus[gpu_type])
        placed = [o.step_time(1 if o.gpus <= node_gpus[gpu_type] else 2) for o in frontier]
        assert frontier and placed == sorted(placed, reverse=True) and len(set(placed)) == len(placed)
        assert [o.gpus for o in frontier] == sorted({o.gpus for o in frontier})
    assert table.option("cifar10", 2048, "A100-40GB", 17) is None  # no row: 16 A100s in Sia's cluster


@pytest.mark.parametrize(
    ("rows", "error"),
    [
        ("m,8,T4,1,1.0,,0,10\nm,8,T4,1,2.0,,0,10\n", ":3: m at batch 8 on 1 x T4 is listed twice"),
        ("m,8,T4,1,1.0,,0,10\nm,8,T4,2,0.6,,0,11\n", ":3: startup_s and job_steps of m at batch 8 differ from line 2's"),
        ("m,8,T4,1,nan,,0,10\n", ":2: column step_s: nan is not a finite number"),
        ("m,8,T4,1,0,,0,10\n", ":2: model, gpu_type, gpus, global_batch and step_s must be set and non-zero"),
        ("m,8,T4,1,1.0,,0,2.5\n", ":2: column job_steps: 2.5 is not a whole number"),
        ("", " holds no rows"),
    ],
)
def test_a_bad_throughput_table_fails_naming_the_line(tmp_path, rows, error):
    path = tmp_path / "t.csv"
    path.write_text(HEADER + rows)
    with pytest.raises(FrenzyError, match=error):
        ThroughputTable.load(path)


def test_a_table_without_the_optional_columns_is_read_with_their_defaults(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("model,global_batch,gpu_type,gpus,step_s\nm,8,T4,2,0.5\n")
    table = ThroughputTable.load(path)
    assert table.option("m", 8, "T4", 2).spread_step_s == 0.5
    assert table.shape("m", 8).startup_s == 0 and table.shape("m", 8).job_steps is None


def test_which_trace_needs_a_table_is_said_in_one_line(table, cluster, tmp_path):
    with pytest.raises(FrenzyError, match=r"is a Sia workload: its jobs need a throughput table \(e.g. benchmarks/data/sia/\S+\)$"):
        load_jobs(SATURN_1, types(cluster))
    elastic = ROOT / "examples" / "traces" / "elasticflow-cluster01-80jobs.csv"
    with pytest.raises(FrenzyError, match="is an ElasticFlow trace; a throughput table applies to Sia workloads"):
        load_jobs(elastic, types(cluster), table)
    odd = tmp_path / "odd.csv"
    odd.write_text("name,time,application,num_replicas,batch_size\na,0,cifar10,4,1000\n")
    with pytest.raises(FrenzyError, match=r"throughput.csv has no rows for cifar10 at batch 1000; it has bert@384, cifar10@2048"):
        load_jobs(odd, types(cluster), table)


def test_a_lone_job_runs_its_startup_and_steps_at_the_tables_speed_under_every_policy(table, cluster, tmp_path):
    """One cifar10 job (batch 2048, 3,343 steps, 50 s start-up) on an idle cluster: its JCT is the
    start-up plus its steps at the table's step time of the plan each policy chose, as placed."""
    path = tmp_path / "one.csv"
    path.write_text("name,time,application,num_replicas,batch_size\ncifar10-0,100,cifar10,4,2048\n")
    jobs = load_jobs(path, types(cluster), table)
    assert jobs[0].steps == 3343 and jobs[0].arrival_s == 0 and jobs[0].deadline_s == math.inf
    best4 = min(table.option("cifar10", 2048, t, 4).step_s for t in types(cluster))
    assert jobs[0].requested_s == pytest.approx(3343 * best4)  # its 4 GPUs on the fastest type that lists them
    for name in POLICIES:
        result = simulate(jobs, cluster, make_policy(name), table=table, records=True)
        [record] = result.jobs
        row = table.option("cifar10", 2048, record.gpu_type, record.gpus)
        expected = 50 + 3343 * row.step_s  # one node holds each policy's choice here
        assert record.end_s - record.started_s == pytest.approx(expected), name
        assert record.jct_s == pytest.approx(record.end_s - record.arrival_s)
        assert result.out_of_memory_restarts == 0 and result.memory_truth == "the throughput table's rows (throughput.csv)"
        if name == "first-fit":
            assert (record.gpu_type, record.gpus) == ("T4", 4)  # the request, on the cluster's first type


def test_sias_workload_replays_whole_under_every_policy_without_running_out_of_memory(table, cluster):
    jobs = load_jobs(SATURN_1, types(cluster), table)
    by_id = {j.job_id: j for j in jobs}
    for name in POLICIES:
        result = simulate(jobs, cluster, make_policy(name), table=table, records=True)
        assert result.jobs_completed == 160 and result.out_of_memory_restarts == 0, name
        assert sorted(r.job_id for r in result.jobs) == sorted(j.job_id for j in jobs)
        assert result.avg_jct_s == pytest.approx(sum(r.jct_s for r in result.jobs) / 160)
        for r in result.jobs:  # each run: its start-up and its steps at its row's step time, in one node or spread
            job = by_id[r.job_id]
            row = table.option(job.model, job.global_batch, r.gpu_type, r.gpus)
            run = r.end_s - r.started_s - table.shape(job.model, job.global_batch).startup_s
            assert min(abs(run - job.steps * row.step_s), abs(run - job.steps * row.spread_step_s)) < 1e-6 * run, (name, r)


def test_frenzy_simulate_replays_a_sia_workload_with_per_job_records():
    argv = ["simulate", "--trace", str(SATURN_1), "--cluster", str(SIA / "cluster.yaml")]
    out = frenzy(*argv, "--throughput-table", str(SIA / "throughput.csv"), "--json", "--per-job")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["jobs_completed"] == 160 and len(result["jobs"]) == 160
    assert {"job_id", "arrival_s", "started_s", "end_s", "jct_s", "gpu_type", "gpus"} <= result["jobs"][0].keys()
    bare = frenzy(*argv)
    assert bare.returncode == 2 and bare.stderr.strip().startswith("error: ") and len(bare.stderr.strip().splitlines()) == 1
    assert "its jobs need a throughput table" in bare.stderr
