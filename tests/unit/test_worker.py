"""The `frenzy` worker type: registered through the entry point, typed job template, launches;
a rank that dies is named with its node, PID and signal."""

import asyncio
import sys
from uuid import uuid4

import pytest
from prefect.client.schemas.objects import FlowRun
from prefect.workers.base import BaseWorker

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.launch.command import Launch
from frenzy_prefect.launch.local import start_local
from frenzy_prefect.pool.worker import FrenzyJobConfiguration, FrenzyWorker, training_job_of
from frenzy_prefect.spec.plan import ParallelPlan, Placement
from frenzy_prefect.training.entry import JOB_ENV
from tests.support.training import make_job, unchecked


def test_prefect_finds_the_frenzy_worker_type_through_the_entry_point():
    assert BaseWorker.get_worker_class_from_type("frenzy") is FrenzyWorker


def test_the_worker_carries_prefects_catalogue_metadata():
    assert FrenzyWorker.get_documentation_url().startswith("https://docs.prefect.io/")
    assert FrenzyWorker.get_logo_url().startswith("https://raw.githubusercontent.com/PrefectHQ/prefect/")
    assert FrenzyWorker.get_logo_url().endswith(".png")
    assert "frenzy.gpu.waiting" in FrenzyWorker.get_description() and "Frenzy" in FrenzyWorker.get_description()


def test_the_base_job_template_is_typed_and_described():
    template = FrenzyWorker.get_default_base_job_template()
    props = template["variables"]["properties"]
    assert {"working_dir", "env", "command"} <= set(props)
    assert all(p.get("description") for p in props.values())
    assert template["job_configuration"]["working_dir"] == "{{ working_dir }}"


def _run(parameters):
    return FlowRun(flow_id=uuid4(), parameters=parameters)


def test_a_training_run_becomes_one_torchrun_agent_per_node():
    job = make_job(
        unchecked("s3://b/d.txt"),
        "s3://b/out",
        ParallelPlan(dp=3, micro_batch=1),
        global_batch=12,
        placements=[Placement(node="a", host="127.0.0.1", gpus=[0, 1]), Placement(node="b", host="127.0.0.1", gpus=[3])],
    )
    config = FrenzyJobConfiguration(command="ignored for training runs", env={"EXTRA": "1"})
    launches = FrenzyWorker(work_pool_name="p").launches_for(config, training_job_of(_run({"job": job.model_dump(mode="json")})))
    assert [l.processes for l in launches] == [2, 1]
    assert [l.env["CUDA_VISIBLE_DEVICES"] for l in launches] == ["0,1", "3"]
    assert all(l.env["EXTRA"] == "1" and JOB_ENV in l.env for l in launches)
    first, second = (" ".join(l.argv) for l in launches)
    assert "--nnodes=2 --node-rank=0 --nproc-per-node=2" in first and "--node-rank=1 --nproc-per-node=1" in second
    # The rendezvous port is left to the launcher, which picks it free on the first node's host.
    assert not any(a.startswith("--master-port") for l in launches for a in l.argv)
    assert [l.port_env for l in launches] == ["PET_MASTER_PORT"] * 2 and all("--master-addr=127.0.0.1" in l.argv for l in launches)


def test_any_other_run_is_one_engine_process_here():
    config = FrenzyJobConfiguration(command=f"{sys.executable} -m prefect.engine")
    (launch,) = FrenzyWorker(work_pool_name="p").launches_for(config, training_job_of(_run({"request": {}})))
    assert launch.argv == [sys.executable, "-m", "prefect.engine"] and launch.host == "127.0.0.1"


def test_the_local_launcher_refuses_remote_hosts_before_starting_anything():
    with pytest.raises(FrenzyError, match="runs only on this machine, but the job is placed on gpu-17"):
        asyncio.run(start_local([Launch(host="127.0.0.1", argv=["true"]), Launch(host="gpu-17", argv=["true"])]))
