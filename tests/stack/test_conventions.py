"""Prefect's conventions, on real parts (the session's Prefect server and S3 endpoint, real CLI
and worker processes): block registration by module, the pool's default cluster block, deployment
names from the environment, S3 credentials from a prefect-aws block that never show."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowFilter,
    FlowFilterName,
    LogFilter,
    LogFilterFlowRunId,
)

from frenzy_prefect.localstack import StackError
from tests.support.conventions import SECRET
from tests.support.runs import GOOD, children, wait_final
from tests.support.stack import BUCKET, POOL_CLUSTER, ROOT, create_pool, deploy_all

TINY = GOOD | {"steps": 2}


@pytest.mark.pipelines
def test_prefect_block_register_finds_the_frenzy_cluster_block_type(stack, prefect_api):
    out = stack.run_cli("prefect", "block", "register", "-m", "frenzy_prefect")
    assert "Frenzy Cluster" in out
    assert "frenzy-cluster" in stack.run_cli("prefect", "block", "type", "ls")


@pytest.mark.pipelines
def test_frenzy_cluster_use_sets_a_pools_default_cluster_and_creates_the_pool_if_there_is_none(stack, prefect_api):
    for cluster in ("local-hetero.yaml", "local-recycle.yaml"):
        stack.run_cli("frenzy_prefect.cli", "cluster", "save", str(ROOT / "blocks" / cluster))
    use = ("frenzy_prefect.cli", "cluster", "use")
    assert "created work pool 'cluster-use'" in stack.run_cli(*use, "local-hetero", "--pool", "cluster-use")
    assert "updated work pool 'cluster-use'" in stack.run_cli(*use, "local-recycle", "--pool", "cluster-use")
    with stack.client_settings(), get_client(sync_client=True) as client:
        pool = client.read_work_pool("cluster-use")
    assert pool.type == "frenzy"
    assert pool.base_job_template["variables"]["properties"]["cluster"]["default"] == "local-recycle"
    assert pool.base_job_template["job_configuration"]["cluster"] == "{{ cluster }}"
    ssh = ROOT / "examples" / "ssh" / "job-variables.yaml"  # docs/cluster.md's example, as a user applies it
    assert "job variables set: launcher, ssh_user" in stack.run_cli(
        *use, "local-recycle", "--pool", "cluster-use", "--job-variables", str(ssh)
    )
    with stack.client_settings(), get_client(sync_client=True) as client:
        variables = client.read_work_pool("cluster-use").base_job_template["variables"]["properties"]
    assert (variables["launcher"]["default"], variables["ssh_key_secret"]["default"]) == ("ssh", "frenzy-ssh-key")
    assert variables["cluster"]["default"] == "local-recycle" and variables["env"]["default"]["NCCL_SOCKET_IFNAME"] == "eth0"

    stack.run_cli("prefect", "work-pool", "create", "cluster-use-process", "--type", "process")
    for args, message in [
        (("no-such-cluster", "--pool", "cluster-use"), "no FrenzyCluster block named 'no-such-cluster'"),
        (("local-hetero", "--pool", "cluster-use-process"), "work pool 'cluster-use-process' is of type 'process'"),
    ]:
        with pytest.raises(StackError, match="failed \\(2\\)") as failed:
            stack.run_cli(*use, *args)
        assert message in str(failed.value) and "Traceback" not in str(failed.value)


@pytest.mark.pipelines
def test_deployment_names_come_from_the_environment_or_frenzy_deploy_name(stack, worker_pool):
    deploy_all(stack, pool=worker_pool, name="nightly")  # prefect deploy --all, FRENZY_DEPLOYMENT=nightly
    assert "deployed train-llm/weekly and distributed-train/weekly" in stack.run_cli(
        "frenzy_prefect.cli", "deploy", "--pool", worker_pool, "--name", "weekly"
    )
    deploy_all(stack)  # FRENZY_* back to the session pool's names
    for name in ("nightly", "weekly"):
        with stack.client_settings(), get_client(sync_client=True) as client:
            train = client.read_deployment_by_name(f"train-llm/{name}")
            ranks = client.read_deployment_by_name(f"distributed-train/{name}")
        assert train.work_pool_name == ranks.work_pool_name == worker_pool
        assert train.parameters == {"training_deployment": f"distributed-train/{name}"}


@pytest.mark.pipelines
def test_a_run_without_a_cluster_parameter_plans_on_the_pools_cluster(stack, worker_pool, dataset):
    """The test pool's `cluster` defaults to the example cluster's block (`frenzy cluster use`): a
    run that names none plans on it (a run with neither fails at once, test_a_run_names_...).
    Planning is where the cluster is read; allocating and training on it: the demo's test."""
    with stack.client_settings():
        from prefect.deployments import run_deployment

        request = TINY | {"dataset": dataset}
        run = wait_final(run_deployment("train-llm/frenzy", parameters={"request": request, "plan_only": True}, timeout=0).id)
        assert run.state.is_completed(), run.state.message
        deadline = time.monotonic() + 60  # a run's logs reach the server in batches, after its last state at times
        with get_client(sync_client=True) as client:
            while not any(
                log.message.startswith(f"Cluster {POOL_CLUSTER}: a10-node: 2 x A10, t4-node: 2 x T4")
                for log in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
            ):
                assert time.monotonic() < deadline, "the run never logged the pool's cluster"
                time.sleep(1)


@pytest.fixture(scope="module")
def aws_pool(stack, worker_pool, dataset) -> str:
    """A second pool whose runs take their S3 keys and endpoint from an AwsCredentials block; its
    worker's own endpoint goes nowhere, so a run that reaches S3 did so through the block."""
    pytest.importorskip("prefect_aws")
    from prefect_aws import AwsCredentials
    from prefect_aws.client_parameters import AwsClientParameters

    with stack.client_settings():
        AwsCredentials(
            aws_access_key_id="frenzy-test-key",
            aws_secret_access_key=SECRET,
            region_name="us-east-1",
            aws_client_parameters=AwsClientParameters(endpoint_url=stack.env["AWS_ENDPOINT_URL"]),
        ).save("moto", overwrite=True)
    pool = "frenzy-aws"
    create_pool(stack, pool, POOL_CLUSTER, storage_credentials="aws-credentials/moto")
    endpoint, key = stack.env["AWS_ENDPOINT_URL"], stack.env.get("AWS_SECRET_ACCESS_KEY")
    stack.env.update(AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_SECRET_ACCESS_KEY="not-the-block-secret")  # nothing listens on 9
    try:
        stack.start_worker(pool, name="frenzy-aws-worker")
    finally:
        stack.env.update(AWS_ENDPOINT_URL=endpoint, AWS_SECRET_ACCESS_KEY=key or "")
    deploy_all(stack, pool=pool, name="aws")
    deploy_all(stack)  # FRENZY_* back to the session pool's names
    return pool


def _everything_shown(stack, run, logged: str, timeout_s: float = 60) -> str:
    """A run's and its children's state messages, parameters, logs and artifacts, as text, once
    their logs hold ``logged`` (logs reach the server in batches, at times after the last state)."""
    runs = [run, *children(stack, run)]
    ids = [r.id for r in runs]
    deadline = time.monotonic() + timeout_s
    with stack.client_settings(), get_client(sync_client=True) as client:
        while True:
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=ids)))
            if any(logged in log.message for log in logs):
                break
            assert time.monotonic() < deadline, f"no log of {run.name} says {logged!r}"
            time.sleep(1)
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=ids)))
        runs = [client.read_flow_run(i) for i in ids]
    parts = [f"{r.state.message} {r.parameters} {r.job_variables}" for r in runs]
    return "\n".join(parts + [log.message for log in logs] + [str(a.data) for a in artifacts])


@pytest.mark.pipelines
def test_s3_credentials_from_an_aws_credentials_block_reach_every_process_and_never_show(stack, aws_pool, dataset):
    with stack.client_settings():
        from prefect.deployments import run_deployment

        ok = run_deployment("train-llm/aws", parameters={"request": TINY | {"dataset": dataset}}, timeout=0).id
        absent = f"s3://{BUCKET}/data/absent.txt"
        missing = run_deployment("train-llm/aws", parameters={"request": TINY | {"dataset": absent}}, timeout=0).id
        ok, missing = wait_final(ok), wait_final(missing)
    assert ok.state.is_completed(), ok.state.message
    (training,) = children(stack, ok)
    assert training.state.is_completed() and training.work_pool_name == aws_pool  # the ranks read and wrote S3 too
    assert missing.state.is_failed() and f"{absent} does not exist" in missing.state.message
    for run, logged in ((ok, "step 2/2"), (missing, f"{absent} does not exist")):  # what each run's logs say
        assert SECRET not in _everything_shown(stack, run, logged)


@pytest.mark.pipelines
def test_the_example_pipeline_calls_train_llm_as_a_subflow(stack, worker_pool, dataset):
    """examples/pipeline.py as a user runs it: its flow in its own process, train-llm inside it,
    the ranks through the pool."""
    argv = [sys.executable, str(ROOT / "examples" / "pipeline.py"), dataset, "--cluster", POOL_CLUSTER, "--steps", "2", "--max-loss", "100"]
    out = subprocess.run(argv, env=stack.env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    gate = json.loads(out.stdout.strip().splitlines()[-1])
    assert gate["accepted"] and gate["gpus"] == "2 x A10"
    with stack.client_settings(), get_client(sync_client=True) as client:
        (pipeline,) = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["nightly-training"])))
    (train,) = children(stack, pipeline)
    (ranks,) = children(stack, train)
    assert pipeline.state.is_completed() and train.state.is_completed()
    assert (str(ranks.id), ranks.work_pool_name) == (gate["training_flow_run"], worker_pool)
