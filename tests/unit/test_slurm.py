"""Slurm as the cluster's source of truth and the `slurm` launcher.

The parsing runs on `scontrol` output captured from the real test cluster (tests/data/slurm);
the `slurm` tests run on a real Slurm (tests/support/slurm_cluster.py): discovery against `sinfo`, and
training runs through the real pool, a real worker and real ranks under slurmd."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.launch.node_restart import moved_nodes, replacements
from frenzy_prefect.launch.slurm import SlurmSettings, SlurmSubmission, exit_code, job_state, placement, sbatch_argv
from frenzy_prefect.launch.slurm_inventory import (
    SlurmNode,
    cluster_from_slurm,
    free_counts,
    narrow_to_slurm,
    node_of,
    parse_gres,
    parse_records,
)
from frenzy_prefect.spec.catalog import GPU_CATALOG
from tests.support.stack import ROOT

DATA = ROOT / "tests" / "data" / "slurm"


def captured_nodes():
    """n1 with one of two A10s taken, n3 with both H100s taken, n4 drained (captured live)."""
    return [node_of(r) for r in parse_records((DATA / "show_node_busy.txt").read_text())]


def test_typed_gpu_gres_is_parsed_with_its_indices():
    assert [(g.type, g.count, g.indices) for g in parse_gres("gpu:a10:2(S:0),gpu:h100:1(IDX:0-1,3)")] == [
        ("a10", 2, ()),
        ("h100", 1, (0, 1, 3)),
    ]
    assert [(g.type, g.count) for g in parse_gres("gpu:2")] == [(None, 2)]
    assert parse_gres("(null)") == []


def test_discovery_maps_slurm_types_to_the_catalog_and_counts_what_is_free_now():
    nodes = captured_nodes()
    spec = cluster_from_slurm(nodes, "test")
    assert [(n.name, n.host, n.gpu_type, n.gpu_count) for n in spec.nodes] == [
        ("n1", "127.0.0.1", "A10", 2),
        ("n2", "127.0.0.1", "A10", 2),
        ("n3", "127.0.0.1", "H100", 2),
        ("n4", "127.0.0.1", "H100", 2),
    ]
    assert free_counts(nodes) == {"n1": 1, "n2": 2, "n3": 0, "n4": 0}  # n4 is drained: no new job goes there


def test_a_slurm_gpu_type_the_catalog_lacks_is_refused_naming_it_until_declared():
    nodes = [node_of({"NodeName": "x1", "Gres": "gpu:mi300x:8", "State": "IDLE"})]
    with pytest.raises(FrenzyError, match=r"Slurm GPU type\(s\) mi300x match no known GPU type .*--gpu-types"):
        cluster_from_slurm(nodes, "test")
    declared = {"mi300x": GPU_CATALOG["H100"].model_copy(update={"name": "mi300x"})}
    assert cluster_from_slurm(nodes, "test", gpu_types=declared).nodes[0].gpu_type == "mi300x"


def test_the_pools_free_gpus_are_cut_to_what_slurm_has_free():
    free = {"n1": [0, 1], "n2": [1], "n3": [0, 1], "n4": [0, 1], "gone": [0]}
    assert narrow_to_slurm(free, free_counts(captured_nodes())) == {"n1": [0], "n2": [1], "n3": [], "n4": [], "gone": []}


def settings(tmp_path: Path, **kw) -> SlurmSettings:
    return SlurmSettings(python=sys.executable, working_dir=tmp_path, **kw)


def test_a_run_on_like_nodes_is_one_job_and_on_unlike_nodes_a_heterogeneous_one(tmp_path):
    sub = SlurmSubmission(
        settings=settings(tmp_path, partition="gpu", time_limit="1:00:00"), job_name="j", comment="c", nodes=[("n1", 2), ("n2", 2)]
    )
    argv = sbatch_argv(sub, {"n1": "a10", "n2": "a10"}, tmp_path)
    assert ":" not in argv and "--no-requeue" in argv
    assert {"--nodelist=n1,n2", "--nodes=2", "--gres=gpu:a10:2", "--partition=gpu", "--time=1:00:00"} <= set(argv)
    het = sbatch_argv(sub.model_copy(update={"nodes": [("n1", 2), ("n3", 1)]}), {"n1": "a10", "n3": "h100"}, tmp_path)
    first, second = " ".join(het).split(" : ")
    assert "--nodelist=n1" in first and "--gres=gpu:a10:2" in first
    assert "--nodelist=n3" in second and "--gres=gpu:h100:1" in second and "--partition=gpu" in second


def test_a_jobs_state_placement_and_exit_code_are_read_from_scontrol():
    running = (DATA / "show_job_running.txt").read_text()
    records = parse_records(running)
    assert job_state(records) == ("RUNNING", "None")
    assert placement(running) == ["n1 gpu:a10:1(IDX:0)"]
    assert job_state(parse_records((DATA / "show_job_pending.txt").read_text()))[0] == "PENDING"
    het = parse_records((DATA / "show_job_het.txt").read_text())  # a heterogeneous job: one record per component
    assert [r["HetJobOffset"] for r in het] == ["0", "1"] and job_state(het)[0] == "PENDING"
    assert exit_code("COMPLETED", records) == 0
    assert exit_code("FAILED", [{"ExitCode": "3:0"}]) == 3 and exit_code("CANCELLED", [{"ExitCode": "0:15"}]) == 143
    assert job_state([{"JobState": "RUNNING"}, {"JobState": "NODE_FAIL", "Reason": "NodeDown"}]) == ("NODE_FAIL", "NodeDown")


def test_a_failed_node_is_replaced_by_a_like_node_that_takes_jobs_preferring_one_that_has_not_failed():
    def node(name, state="IDLE", gpu_type="a10", used=0):
        return SlurmNode(name, f"10.0.0.{name[-1]}", state, ("gpu",), gpu_type, 2, used)

    found = [
        node("a", "MIXED", used=2),
        node("b", "DOWN"),
        node("c", used=1),
        node("d"),
        node("e", gpu_type="h100"),
        node("f", "IDLE+DRAIN"),
    ]
    job = [("a", 2), ("b", 2)]
    moves = replacements(job, ["b"], found, failed_before={"b"})
    assert {k: v.name for k, v in moves.items()} == {"b": "d"}  # a like node with the most GPUs free; not a (the run's), e, f
    assert moved_nodes(job, moves) == [("a", 2), ("d", 2)]
    assert replacements(job, ["b"], found, failed_before={"b", "d"})["b"].name == "c"  # d failed earlier in this run
    assert replacements(job, ["b"], found[:3], failed_before=set())["b"].name == "c"  # busy in part: the new job waits for it
    assert replacements(job, ["a", "b"], found[:3] + found[4:], failed_before=set()) is None  # one A10 node left for two


def test_a_nodes_tracebacks_reach_the_runs_log_as_one_line_each_pointing_at_the_full_output(tmp_path):
    """A rank killed with SIGKILL, as its node's log shows it (captured from torchrun): the other
    rank's gloo error and torchrun's 30-line ChildFailedError report come as one line each,
    gloo's "GLHF!" sign-off cut; read in two parts, cut inside a traceback."""
    from frenzy_prefect.launch.slurm import LogTail

    captured = (DATA / "torchrun_failure.log").read_text().splitlines(keepends=True)
    log, tail = tmp_path / "n1.log", LogTail(tmp_path)
    log.write_text("".join(captured[:3]))
    lines = tail.lines()
    with open(log, "a") as f:
        f.write("".join(captured[3:]))
    lines += tail.lines()
    assert lines == [
        "[n1] [rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer"
        " [127.0.0.1]:36485. This is typically caused by a remote worker crashing. Check the logs of the remote worker before"
        f" reporting an error. (traceback in {log})",
        "[n1] W1207 22:47:18.924000 22223 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 22240 closing signal"
        " SIGTERM",
        "[n1] E1207 22:47:18.957000 22223 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 1"
        " (pid: 22241) of binary: /opt/venv/bin/python",
        f"[n1] torchrun: rank 1 (local_rank: 1) failed first: Signal 9 (SIGKILL) received by PID 22241 (full report in {log})",
    ]


def test_a_pending_job_slurm_has_not_looked_at_yet_says_so_not_none(tmp_path, capsys):
    from frenzy_prefect.launch.slurm import NOT_YET_SCHEDULED, Watcher

    watcher = Watcher(
        SlurmSubmission(settings=SlurmSettings(python=sys.executable, working_dir=tmp_path), job_name="j", comment="c", nodes=[("n1", 1)])
    )
    watcher.job_id = "7"
    said = watcher._tell_news("PENDING", "None", "")
    said = watcher._tell_news("PENDING", "Priority", said)
    assert capsys.readouterr().out.splitlines() == [f"Slurm job 7 pending: {NOT_YET_SCHEDULED}", "Slurm job 7 pending: Priority"]
