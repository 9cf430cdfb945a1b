"""Prefect's conventions, on real parts (the session's Prefect server and S3 endpoint, real CLI
and worker processes): block registration by module, the pool's default cluster block, deployment
names from the environment, S3 credentials from a prefect-aws block that never show."""

from __future__ import annotations

import asyncio

import pytest

from frenzy_prefect.blocks import CLUSTER_ENV, cluster_block_name
from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.pool.worker import FrenzyJobConfiguration, FrenzyWorker
from frenzy_prefect.storage.credentials import _env_of, credentials_env
from tests.support.conventions import SECRET


def test_a_run_names_its_cluster_or_the_pool_does(monkeypatch):
    monkeypatch.delenv(CLUSTER_ENV, raising=False)
    with pytest.raises(FrenzyError, match="pass train-llm's `cluster` parameter .* or set the `cluster` variable"):
        cluster_block_name(None)
    monkeypatch.setenv(CLUSTER_ENV, "pool-default")
    assert cluster_block_name(None) == "pool-default" and cluster_block_name("mine") == "mine"


def test_the_worker_gives_a_runs_processes_the_pools_cluster_and_the_blocks_keys_in_place_of_its_own(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "the-workers")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "the-workers-token")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://workers-endpoint")
    config = FrenzyJobConfiguration(command="python -m prefect.engine", cluster="pool-cluster")
    credentials = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": SECRET}
    (launch,) = FrenzyWorker(work_pool_name="p").launches_for(config, None, credentials)
    assert launch.env[CLUSTER_ENV] == "pool-cluster" and launch.env["AWS_SECRET_ACCESS_KEY"] == SECRET
    assert "AWS_SESSION_TOKEN" not in launch.env and launch.env["AWS_ENDPOINT_URL"] == "http://workers-endpoint"


def test_each_kind_of_prefect_aws_block_stands_for_the_aws_environment():
    pytest.importorskip("prefect_aws")
    from prefect_aws import AwsCredentials, MinIOCredentials, S3Bucket
    from prefect_aws.client_parameters import AwsClientParameters

    aws = AwsCredentials(aws_access_key_id="k", aws_secret_access_key=SECRET, aws_session_token="t", region_name="eu-west-1")
    keys = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": SECRET}
    assert _env_of(aws) == keys | {"AWS_SESSION_TOKEN": "t", "AWS_DEFAULT_REGION": "eu-west-1"}
    minio = MinIOCredentials(
        minio_root_user="u", minio_root_password=SECRET, aws_client_parameters=AwsClientParameters(endpoint_url="http://minio:9000")
    )
    assert _env_of(minio) == {"AWS_ACCESS_KEY_ID": "u", "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL": "http://minio:9000"}
    assert _env_of(S3Bucket(bucket_name="b", credentials=minio).credentials) == _env_of(minio)
    with pytest.raises(FrenzyError, match="assume_role_arn is not supported"):
        _env_of(AwsCredentials(assume_role_arn="arn:aws:iam::1:role/r"))


def test_a_storage_credentials_value_of_another_form_is_refused_naming_the_forms():
    with pytest.raises(FrenzyError, match=r"'vault/x': expected one of aws-credentials/NAME, minio-credentials/NAME, s3-bucket/NAME"):
        asyncio.run(credentials_env("vault/x"))
