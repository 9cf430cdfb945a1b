"""`frenzy cluster check` as a user runs it once set up (docs/cluster.md): one tiny run per node of
the example cluster through the session's pool and worker (its queue, GPU take and launcher), each
pinned to its node, every rank's account and the node's verdict reported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from prefect.client.orchestration import get_client

from frenzy_prefect.pool import run_labels
from frenzy_prefect.pool.gpu_queue import Holds
from frenzy_prefect.spec.cluster import ClusterSpec
from tests.support.stack import EXAMPLE_CLUSTER, POOL_CLUSTER

pytestmark = pytest.mark.e2e


def test_cluster_check_runs_one_pinned_dispatch_per_node_and_reports_each(stack, worker_pool):
    argv = [sys.executable, "-m", "frenzy_prefect.cli", "cluster", "check", POOL_CLUSTER, "--allow-cpu", "--timeout-s", "300", "--json"]
    proc = subprocess.run(argv, env=stack.env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    nodes = ClusterSpec.from_file(EXAMPLE_CLUSTER).nodes
    assert out["passed"] == len(nodes) == len(out["nodes"]) and out["server"] == stack.env["PREFECT_API_URL"]
    for row, node in zip(out["nodes"], nodes, strict=True):
        assert (row["node"], row["state"], row["passed"], row["gpus_seen"]) == (node.name, "Completed", True, 0), row
        assert [r["rank"] for r in row["ranks"]] == list(range(node.gpu_count))  # one rank per GPU of the node
        assert {r["cuda_visible_devices"] for r in row["ranks"]} == {",".join(map(str, range(node.gpu_count)))}
        assert row["message"].startswith(f"no GPU: {node.gpu_count} ranks on CPU (--allow-cpu) on ")
        assert "; all-reduce of 64 MiB in " in row["message"] and row["seconds"] > 0
        with stack.client_settings(), get_client(sync_client=True) as client:
            run = client.read_flow_run(row["flow_run"])
        holds = Holds.model_validate_json(run.labels[run_labels.HOLDS])  # what the worker took for it
        assert holds.gpus == {node.name: list(range(node.gpu_count))}  # its own node, every GPU of it
