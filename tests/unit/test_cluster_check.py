"""The commands that talk to a Prefect server: each refuses, in one line, to write into the
temporary server Prefect would start for it alone, or to talk to one that does not answer (no
server is started here: the fast tier's guard would fail the test). `frenzy cluster check`'s
arguments, and the verdict its ranks' accounts make of a node (training/node_check.py)."""

from __future__ import annotations

import socket

import pytest
from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE, temporary_settings

from frenzy_prefect.flows.node_check import check_job
from frenzy_prefect.spec.cluster import ClusterSpec
from frenzy_prefect.training.node_check import AllReduce, RankCheck, verdict
from tests.support.cli import frenzy
from tests.support.stack import EXAMPLE_CLUSTER

WRITERS = [
    (["cluster", "save", str(EXAMPLE_CLUSTER)], "FrenzyCluster block 'local-hetero'"),
    (["cluster", "use", "local-hetero", "--pool", "gpu"], "work pool 'gpu'"),
    (["deploy", "--pool", "gpu"], "the deployments on work pool 'gpu'"),
    (["discover", "--save", "mine"], "FrenzyCluster block 'mine'"),
    (["cluster", "discover", "--slurm", "--save", "hpc"], "FrenzyCluster block 'hpc'"),
    (["cluster", "check", "local-hetero"], "the node checks' flow runs"),
]


@pytest.mark.parametrize(("args", "what"), WRITERS)
def test_a_command_that_writes_to_a_server_refuses_the_temporary_one_in_one_line(args, what):
    with temporary_settings(updates={PREFECT_API_URL: None, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE: True}):
        out = frenzy(*args)
    assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("error: PREFECT_API_URL is not set (profile ")
    assert f"so Prefect would start a temporary server for this command alone and {what} would land in " in out.stderr
    assert "which no worker reads: start one where the workers and nodes reach it (`prefect server start --host 0.0.0.0`)" in out.stderr
    assert "`prefect config set PREFECT_API_URL=http://HOST:4200/api` (docs/cluster.md, step 1)" in out.stderr
    with temporary_settings(updates={PREFECT_API_URL: None, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE: False}):
        out = frenzy(*args)
    assert out.returncode == 2 and f"there is no Prefect server for {what}: start one where" in out.stderr


def test_a_server_that_does_not_answer_is_named_at_once():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/api"
    with temporary_settings(updates={PREFECT_API_URL: url}):
        out = frenzy("cluster", "save", str(EXAMPLE_CLUSTER))
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"error: the Prefect server at {url} (PREFECT_API_URL) does not answer (")
    assert "start it there (`prefect server start --host 0.0.0.0`) or set PREFECT_API_URL to the one that runs" in out.stderr


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("launcher: ssh\nsshuser: me\n", "'sshuser' is not a variable of a frenzy pool (did you mean ssh_user?); its variables: command"),
        ("launcher: pbs\n", "launcher: Input should be 'local', 'ssh', 'slurm' or 'kubernetes' (got 'pbs')"),
        ("ssh_port: 70000\n", "ssh_port: Input should be less than or equal to 65535 (got 70000)"),
        ("cluster: other\n", "sets cluster 'other', and the command names 'local-hetero': leave it out of the file"),
        ("- launcher\n", "must be a mapping of the pool's variables"),
        ("launcher: [unclosed\n", "cannot read job variables file"),
    ],
)
def test_a_pools_job_variables_file_is_checked_before_the_server_is_asked(tmp_path, content, message):
    path = tmp_path / "job-variables.yaml"
    path.write_text(content)
    out = frenzy("cluster", "use", "local-hetero", "--job-variables", str(path))
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and out.stderr.startswith("error: ") and message in out.stderr, out.stderr


@pytest.mark.parametrize("launcher", ["ssh", "slurm", "kubernetes"])
def test_the_job_variable_examples_are_a_pools_variables(launcher):
    from frenzy_prefect.pool.template import job_variables

    path = EXAMPLE_CLUSTER.parents[1] / "examples" / launcher / "job-variables.yaml"
    assert job_variables(path, "my-k8s")["launcher"] == launcher


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "Missing argument 'cluster'"),
        (["local-hetero", "--timeout-s", "0"], "Invalid value for '--timeout-s': Input should be greater than or equal to 1"),
        (["local-hetero", "--nodes", "a10-node,,t4-node"], "--nodes takes node names separated by commas (e.g. gpu-1,gpu-2)"),
        (["local-hetero", "--surprise"], "No such option: --surprise"),
    ],
)
def test_cluster_check_arguments_are_refused_in_one_line(args, message):
    out = frenzy("cluster", "check", *args)
    assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("error: ") and message in out.stderr


def test_a_nodes_check_is_pinned_to_it_with_a_rank_per_gpu():
    cluster = ClusterSpec.from_file(EXAMPLE_CLUSTER)
    job = check_job(cluster, cluster.nodes[1])
    assert job.purpose == "check" and job.pinned and job.allocation.gpu_type == "T4" and job.allocation.plan.gpus == 2
    assert [(p.node, p.gpus) for p in job.allocation.placements] == [("t4-node", [0, 1])]


def _rank(rank: int, gpu: str | None = None, **fields) -> RankCheck:
    on_gpu = {"device": f"cuda:{rank}", "gpu_name": gpu, "free_bytes": 20 << 30, "total_bytes": 24 << 30} if gpu else {"device": "cpu"}
    return RankCheck(rank=rank, host="gpu-7", cuda_visible_devices="0,1", cuda_devices=2 if gpu else 0, **on_gpu | fields)


A10_NODE = check_job(ClusterSpec.from_file(EXAMPLE_CLUSTER), ClusterSpec.from_file(EXAMPLE_CLUSTER).nodes[0])
FAST = AllReduce(ranks=2, nbytes=64 << 20, seconds=0.01, correct=True)


@pytest.mark.parametrize(
    ("ranks", "reduced", "allow_cpu", "passed", "message"),
    [
        (
            [_rank(0, "NVIDIA A10"), _rank(1, "NVIDIA A10")],
            FAST,
            False,
            True,
            "2 x NVIDIA A10, at least 20.0 GiB free each on gpu-7; all-reduce of 64 MiB in 10 ms (6.7 GB/s bus)",
        ),
        ([_rank(0), _rank(1)], FAST, True, True, "no GPU: 2 ranks on CPU (--allow-cpu) on gpu-7; all-reduce of 64 MiB in 10 ms"),
        (
            [_rank(0), _rank(1)],
            FAST,
            False,
            False,
            "2 of its 2 ranks see no CUDA device (rank 0: torch ",
        ),
        ([_rank(0, "NVIDIA A10"), _rank(1)], FAST, True, False, "1 of its 2 ranks see no CUDA device (rank 1: torch "),
        (
            [_rank(0, "NVIDIA H100 80GB HBM3", total_bytes=80 << 30), _rank(1, "NVIDIA A10")],
            FAST,
            False,
            False,
            "the node is declared A10, but rank 0 sees NVIDIA H100 80GB HBM3 (H100): plans for it would be wrong",
        ),
        (
            [_rank(0, "NVIDIA A10"), _rank(1, "NVIDIA A10", error="OutOfMemoryError: CUDA out of memory")],
            FAST,
            False,
            False,
            "rank 1: OutOfMemoryError: CUDA out of memory",
        ),
        (
            [_rank(0, "NVIDIA A10"), _rank(1, "NVIDIA A10")],
            FAST.model_copy(update={"correct": False}),
            False,
            False,
            "the all-reduce over its 2 ranks summed wrong",
        ),
    ],
)
def test_the_verdict_on_a_node_says_what_its_ranks_saw_in_a_line(ranks, reduced, allow_cpu, passed, message):
    assert verdict(A10_NODE, ranks, reduced, allow_cpu)[0] is passed
    assert message in verdict(A10_NODE, ranks, reduced, allow_cpu)[1]
