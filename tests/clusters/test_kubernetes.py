"""The `kubernetes` launcher: the manifests it writes, held to the official schemas in strict
mode (tests/support/kubernetes_schemas.py), the inventory it reads from nodes and pods, and training runs
through the real pool against a Kubernetes API server on 127.0.0.1 (tests/support/kubernetes_cluster.py:
real HTTP, driven by kubernetes_asyncio; a scripted scheduler, Job/JobSet controllers and kubelet
that run each pod's command as a local process)."""

from __future__ import annotations

import copy

import pytest

from frenzy_prefect.launch.kubernetes_manifest import (
    KubernetesSettings,
    KubernetesSubmission,
    NodePods,
    manifests,
    object_name,
)
from tests.support.kubernetes import RUN_ID, container, kube_pod, submission
from tests.support.kubernetes_cluster import node_object as kube_node
from tests.support.runs import wait_for

pytestmark = pytest.mark.kubernetes


def pod_from(js: dict, group: int, index: int, node: str, phase: str, **state) -> dict:
    template = js["spec"]["replicatedJobs"][group]["template"]["spec"]["template"]
    name = f"{js['metadata']['name']}-g{group}-0-{index}"
    c = container(template)
    statuses = [
        {"name": c["name"], "image": c["image"], "imageID": "", "ready": phase == "Running", "restartCount": 0, "state": state or {}}
    ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{name}-x{index}", "namespace": js["metadata"]["namespace"], "labels": template["metadata"]["labels"]},
        "spec": {**copy.deepcopy(template["spec"]), "nodeName": node, "hostname": name},
        "status": {"phase": phase, "containerStatuses": statuses},
    }


async def until(check, timeout_s: float = 30.0):
    import asyncio

    deadline = asyncio.get_running_loop().time() + timeout_s
    while not (found := check()):
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)
    return found


def run_watcher(sub, script, jobset_served: bool = True):
    """The watcher on ``sub`` against a fresh test API server; ``script(server, jobset)`` plays
    the cluster once the run's objects exist. (exit code, the server, the watcher's lines)."""
    import asyncio
    import contextlib
    import io

    from aiohttp.test_utils import TestServer

    from frenzy_prefect.launch.kubernetes import Watcher
    from tests.support.kubernetes_api import ApiServer, kubeconfig

    async def scenario():
        server = ApiServer(namespaces=("training",), jobset=jobset_served)
        async with TestServer(server.app(), host="127.0.0.1") as http:
            watcher = Watcher(sub, kubeconfig(str(http.make_url("")).rstrip("/")), None)
            task = asyncio.ensure_future(watcher.run())
            kind = "jobsets" if jobset_served else "jobs"
            name = sub.name if jobset_served else f"{sub.name}-g0"
            obj = await until(lambda: server.objects.get((kind, "training", name)) or (task.done() and task.result() and {}))
            if obj:
                await until(lambda: server.watchers)  # (the server replays nothing: the watch is open before the pods change)
                await script(server, obj, watcher)
            return await asyncio.wait_for(task, 30), server

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code, server = asyncio.run(scenario())
    return code, server, out.getvalue().splitlines()


def test_the_watcher_creates_the_jobset_follows_its_pods_and_ends_when_all_succeed(tmp_path, monkeypatch):
    from frenzy_prefect.launch.failure import FAILURE_FILE_ENV

    monkeypatch.setenv(FAILURE_FILE_ENV, str(tmp_path / "failure.json"))

    async def cluster(server, js, _watcher):
        pods = [pod_from(js, 0, i, node, "Pending") for i, node in enumerate(("gpu-a", "gpu-b"))]
        for pod in pods:
            server.logs[pod["metadata"]["name"]] = f"frenzy-kubernetes: pod {pod['spec']['hostname']} is node rank 0\n"
            server.put("pods", pod, "ADDED")
        for phase, state in (("Running", {"running": {}}), ("Succeeded", {"terminated": {"reason": "Completed", "exitCode": 0}})):
            for pod in pods:
                pod = copy.deepcopy(pod)
                pod["status"] = {
                    **pod["status"],
                    "phase": phase,
                    "containerStatuses": [{**pod["status"]["containerStatuses"][0], "state": state}],
                }
                server.put("pods", pod)

    sub = submission()
    code, server, lines = run_watcher(sub, cluster)
    assert code == 0, lines
    assert lines[0] == f"Submitted Kubernetes JobSet {sub.name} in namespace training on gpu-a x2, gpu-b x2"
    assert f"Pod {sub.name}-g0-0-0-x0 on gpu-a: Running" in lines and f"Pod {sub.name}-g0-0-1-x1 on gpu-b: Succeeded (Completed)" in lines
    assert any(line.startswith(f"[{sub.name}-g0-0-0-x0] frenzy-kubernetes: pod") for line in lines), lines
    assert lines[-1] == f"Every pod of {sub.name} Succeeded" and server.deletes == []


def test_a_killed_pod_fails_the_run_naming_pod_node_and_rank_and_its_jobset_is_deleted_foreground(tmp_path, monkeypatch):
    from frenzy_prefect.launch.failure import FAILURE_FILE_ENV, describe, read_report

    monkeypatch.setenv(FAILURE_FILE_ENV, str(tmp_path / "failure.json"))
    message = '{"rank": 2, "local_rank": 0, "pid": 77, "exitcode": -9, "attempt": 0}'

    async def cluster(server, js, _watcher):
        pods = [pod_from(js, 0, i, node, "Running", running={}) for i, node in enumerate(("gpu-a", "gpu-b"))]
        for pod in pods:
            server.put("pods", pod, "ADDED")
        dead = copy.deepcopy(pods[1])
        dead["status"]["phase"] = "Failed"
        dead["status"]["containerStatuses"][0]["state"] = {"terminated": {"reason": "Error", "exitCode": 137, "message": message}}
        server.put("pods", dead)

    sub = submission()
    code, server, lines = run_watcher(sub, cluster)
    assert code == 1
    expected = f"pod {sub.name}-g0-0-1-x1 (rank 2, pid 77 was killed by SIGKILL) on gpu-b failed (Error, was killed by SIGKILL)"
    assert describe("?", read_report(str(tmp_path / "failure.json"))) == expected
    assert server.deletes == [("jobsets", sub.name, "Foreground")]
    assert not [k for k in server.objects if k[0] == "pods"]  # its pods went with it


def test_cancelling_deletes_the_indexed_jobs_and_service_where_jobset_is_not_served(tmp_path, monkeypatch):
    from frenzy_prefect.launch.failure import FAILURE_FILE_ENV

    monkeypatch.setenv(FAILURE_FILE_ENV, str(tmp_path / "failure.json"))

    async def cluster(server, job, watcher):
        server.put("pods", {**pod_from_job(job, "gpu-a")}, "ADDED")
        await until(lambda: any("Running" in s for s in watcher.said.values()))
        watcher.cancelled.set()

    sub = submission(api="auto")
    code, server, lines = run_watcher(sub, cluster, jobset_served=False)
    assert code == 143, lines
    assert lines[0] == f"Submitted Kubernetes Service and Job {sub.name} in namespace training on gpu-a x2, gpu-b x2"
    assert server.deletes == [("jobs", f"{sub.name}-g0", "Foreground"), ("services", sub.name, "Foreground")]


def pod_from_job(job: dict, node: str) -> dict:
    template = job["spec"]["template"]
    c = container(template)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{job['metadata']['name']}-0-abc", "namespace": "training", "labels": template["metadata"]["labels"]},
        "spec": {**copy.deepcopy(template["spec"]), "nodeName": node},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {"name": c["name"], "image": c["image"], "imageID": "", "ready": True, "restartCount": 0, "state": {"running": {}}}
            ],
        },
    }


def test_the_api_server_answers_invalid_and_already_exists_as_the_real_one_does():
    import asyncio

    from aiohttp.test_utils import TestServer
    from kubernetes_asyncio import client

    from frenzy_prefect.launch.kubernetes_client import api_client
    from tests.support.kubernetes_api import ApiServer, kubeconfig

    (js,) = manifests(submission())
    bad = copy.deepcopy(js)
    bad["spec"]["replicatedJobs"][0]["replicas"] = "2"

    async def scenario():
        server = ApiServer(namespaces=("training",))
        async with TestServer(server.app(), host="127.0.0.1") as http, api_client(kubeconfig(str(http.make_url("")).rstrip("/"))) as api:
            custom = client.CustomObjectsApi(api)
            answers = []
            for obj, ns in ((bad, "training"), (js, "nowhere"), (js, "training"), (js, "training")):
                try:
                    await custom.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", ns, "jobsets", obj)
                    answers.append(201)
                except client.ApiException as exc:
                    answers.append(exc.status)
            return answers

    assert asyncio.run(scenario()) == [422, 404, 201, 409]


def test_discover_kubernetes_reads_the_cluster_through_the_api_as_a_user_runs_it(tmp_path):
    """`frenzy cluster discover --kubernetes --json` against the test API server (KUBECONFIG):
    nodes' allocatable GPUs, the free ones beside a pod that is not ours; one line when the API is down."""
    import json
    import os
    import subprocess
    import sys

    import yaml

    from tests.support.kubernetes_api import ApiServer, kubeconfig, serve_in_thread

    server = ApiServer()
    for n in (kube_node("a1", 4, "NVIDIA-A10"), kube_node("h1", 8, "NVIDIA-H100-80GB-HBM3", 81559), kube_node("cpu", 0, None)):
        server.put("nodes", n, "ADDED")
    theirs = kube_pod("a1", 3)
    theirs |= {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "not-ours", "namespace": "default"}}
    theirs["spec"]["containers"] = [{**c, "image": "x"} for c in theirs["spec"]["containers"]]
    server.put("pods", theirs, "ADDED")
    url, stop, _ = serve_in_thread(server)
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump(kubeconfig(url)))
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"} | {"KUBECONFIG": str(config)}
    argv = [sys.executable, "-m", "frenzy_prefect.cli", "cluster", "discover", "--kubernetes", "--json"]
    try:
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    finally:
        stop()
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert [(n["name"], n["gpu_type"], n["gpu_count"]) for n in found["cluster"]["nodes"]] == [("a1", "A10", 4), ("h1", "H100", 8)]
    assert found["free_gpus"] == {"a1": 1, "h1": 8}
    down = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)  # the server is stopped now
    assert (
        down.returncode != 0 and down.stderr.startswith("error: the Kubernetes API did not answer") and len(down.stderr.splitlines()) == 1
    )


KUBE_NODES = {"gpu-a": "NVIDIA-A10", "gpu-b": "NVIDIA-A10", "gpu-t": "Tesla-T4"}  # two "GPUs" each


S3_SECRET = "s3-keys"


@pytest.fixture(scope="module")
def kube(s3, tmp_path_factory):
    import os

    from tests.support.kubernetes_api import ApiServer
    from tests.support.kubernetes_cluster import ScriptedCluster, missing

    if why := missing():
        pytest.skip(why)
    cluster = ScriptedCluster(ApiServer(namespaces=("default", "training")), tmp_path_factory.mktemp("kube"))
    for node, product in KUBE_NODES.items():
        cluster.add_node(node, 2, product)
    cluster.add_secret("training", S3_SECRET, {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")})
    cluster.start()
    yield cluster
    cluster.stop()


def test_a_jobset_of_two_pods_trains_through_the_scripted_cluster(kube, dataset, tmp_path):
    """The watcher alone (no pool): a dp=2 job on one A10 of gpu-a and one of gpu-b; both pods
    rendezvous at pod 0's DNS name, read S3 with the Secret's keys, train and succeed."""
    import json
    import os
    import subprocess
    import sys

    from frenzy_prefect.launch.failure import FAILURE_FILE_ENV
    from frenzy_prefect.launch.kubernetes import KUBECONFIG_ENV, SUBMISSION_ENV
    from frenzy_prefect.profiling.dataset import profile_dataset
    from frenzy_prefect.spec.plan import JOB_ENV, ParallelPlan, Placement
    from frenzy_prefect.storage import open_uri
    from frenzy_prefect.training.distributed import free_port
    from tests.support.kubernetes_api import kubeconfig
    from tests.support.stack import BUCKET
    from tests.support.training import NANO, make_job

    placements = [Placement(node="gpu-a", host="gpu-a", gpus=[0]), Placement(node="gpu-b", host="gpu-b", gpus=[0])]
    job = make_job(
        profile_dataset(dataset, 64, NANO.vocab_size), f"s3://{BUCKET}/kube/watcher", ParallelPlan(dp=2, micro_batch=4), placements, steps=3
    )
    settings = KubernetesSettings(
        image="frenzy:test",
        namespace="training",
        python=sys.executable,
        env={"AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"], "AWS_DEFAULT_REGION": "us-east-1"},
        storage_secret=S3_SECRET,
        rendezvous_port=free_port(),
        pod_spec={"terminationGracePeriodSeconds": 5},
    )
    sub = KubernetesSubmission(
        settings=settings,
        name=object_name("watcher only", RUN_ID),
        flow_run_id=RUN_ID,
        nodes=[NodePods(node=p.node, gpus=1, product="NVIDIA-A10") for p in placements],
        env={JOB_ENV: job.model_dump_json()},
    )
    env = {
        **os.environ,
        SUBMISSION_ENV: sub.model_dump_json(),
        KUBECONFIG_ENV: json.dumps({"config": kubeconfig(kube.url), "context": None}),
    }
    env[FAILURE_FILE_ENV] = str(tmp_path / "failure.json")
    argv = [sys.executable, "-m", "frenzy_prefect.launch.kubernetes"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, (done.stderr[-2000:], lines[-40:])
    assert lines[0] == f"Submitted Kubernetes JobSet {sub.name} in namespace training on gpu-a x1, gpu-b x1"
    pods = sorted({line.split()[1] for line in lines if line.startswith("Pod ")})
    assert [p.rsplit("-", 1)[0] for p in pods] == [f"{sub.name}-g0-0-0", f"{sub.name}-g0-0-1"], pods
    assert f"Pod {pods[0]} on gpu-a: Succeeded (Completed)" in lines and f"Pod {pods[1]} on gpu-b: Succeeded (Completed)" in lines
    assert any(
        line.startswith(f"[{pods[1]}] frenzy-kubernetes: pod {sub.name}-g0-0-1 is node rank 1 with 1 rank(s) on GPUs 0") for line in lines
    )
    assert any(f"rendezvous at {sub.name}-g0-0-0.{sub.name}:" in line for line in lines), lines
    with open_uri(job.metrics_uri, "r") as f:
        metrics = json.load(f)
    assert metrics["world_size"] == 2 and len(metrics["losses"]) == 3


KUBE_POOL, KUBE_CLUSTER, KUBE_CONFIG_BLOCK = "k8s", "k8s-test", "k8s-test-config"


@pytest.fixture(scope="module")
def kube_pool(kube, stack, s3, prefect_api, tmp_path_factory) -> str:
    """What a user sets up (README, "On a Kubernetes cluster"): a KubernetesClusterConfig block,
    `frenzy cluster discover --kubernetes --save`, a pool whose variables are the example's."""
    import os
    import sys

    import yaml
    from prefect_kubernetes.credentials import KubernetesClusterConfig

    from frenzy_prefect.training.distributed import free_port
    from tests.support.kubernetes_api import kubeconfig
    from tests.support.stack import ROOT, create_pool, deploy_all

    with stack.client_settings():
        KubernetesClusterConfig(config=kubeconfig(kube.url), context_name="test").save(KUBE_CONFIG_BLOCK, overwrite=True)
    stack.run_cli(
        "frenzy_prefect.cli", "cluster", "discover", "--kubernetes", "--cluster-config", KUBE_CONFIG_BLOCK, "--save", KUBE_CLUSTER
    )
    variables = yaml.safe_load((ROOT / "examples" / "kubernetes" / "job-variables.yaml").read_text())
    variables |= {
        "cluster": KUBE_CLUSTER,
        "cluster_config": KUBE_CONFIG_BLOCK,
        "node_python": sys.executable,  # the "image" is this machine
        "env": {"AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"], "AWS_DEFAULT_REGION": "us-east-1"},
        "rendezvous_port": free_port(),  # every pod listens on this host's loopback, not an IP of its own
        "working_dir": str(tmp_path_factory.mktemp("k8s-work")),
    }
    variables["pod_spec"] = {**variables["pod_spec"], "terminationGracePeriodSeconds": 5}
    kube.images = {variables["image"]}  # the image the nodes can pull: the example's
    create_pool(stack, KUBE_POOL, variables.pop("cluster"), **variables)
    stack.start_worker(KUBE_POOL, name="k8s-worker")
    deploy_all(stack, pool=KUBE_POOL, name=KUBE_POOL)
    return KUBE_POOL


def start_kube_run(stack, dataset: str, name: str, *, gpus: int, steps: int, gpu_type: str = "A10", job_variables=None, **request):
    from prefect.deployments import run_deployment

    from frenzy_prefect.blocks import FrenzyCluster
    from tests.support.runs import training_job
    from tests.support.stack import BUCKET

    with stack.client_settings():
        cluster = FrenzyCluster.load(KUBE_CLUSTER).cluster
        parameters = training_job(
            dataset, gpus=gpus, gpu_type=gpu_type, steps=steps, output=f"s3://{BUCKET}/k8s/{name}", cluster=cluster, **request
        )
        return run_deployment(f"distributed-train/{KUBE_POOL}", parameters=parameters, timeout=0, job_variables=job_variables).id


def jobset_of(stack, run_id) -> str:
    from tests.support.runs import wait_for_log

    (line,) = [m for m in wait_for_log(stack, run_id, "Submitted Kubernetes ") if m.startswith("Submitted Kubernetes ")]
    return line.split(" in namespace ")[0].split()[-1]


def test_a_run_trains_through_the_pool_as_one_jobset_one_pod_per_node(kube, stack, kube_pool, dataset):
    from frenzy_prefect.launch.kubernetes import PHASE_LINE
    from tests.support.runs import flow_run, run_events, run_logs, wait_final, wait_for_log

    run_id = start_kube_run(stack, dataset, "two-pods", gpus=4, steps=6)
    with stack.client_settings():
        run = wait_final(run_id, timeout_s=400)
    assert run.state.is_completed(), (run.state.message, run_logs(stack, run_id)[-30:])
    name = jobset_of(stack, run_id)
    # (rank 0 reports the run Completed before its last lines are sent and its process, so its pod, ends)
    logs = wait_for_log(stack, run_id, f"Every pod of {name} Succeeded", timeout_s=60)
    assert flow_run(stack, run_id).labels["frenzy.kubernetes-job"] == name
    (submitted,) = [m for m in logs if m.startswith("Submitted Kubernetes ")]
    assert submitted == f"Submitted Kubernetes JobSet {name} in namespace training on gpu-a x2, gpu-b x2", submitted
    # (the group's two pods may go to either of its two nodes, one each; a pod's Running phase can
    # fall between two of the worker's watches, so every phase it was seen in with a node counts)
    placed = {
        found["node"]
        for m in logs
        if (found := PHASE_LINE.match(m)) and found["pod"].startswith(f"{name}-g0-0-") and found["node"] != "unscheduled"
    }
    assert placed == {"gpu-a", "gpu-b"}, logs
    steps = [m for m in logs if m.startswith("step ")]
    losses = [float(m.split("loss ")[1].split()[0]) for m in steps]
    assert steps[-1].startswith("step 6/6") and losses[-1] < losses[0]
    pods = [p for p in kube.pods("training") if p["metadata"]["labels"].get("jobset.sigs.k8s.io/jobset-name") == name]
    assert sorted((p["spec"]["nodeName"], p["status"]["phase"]) for p in pods) == [("gpu-a", "Succeeded"), ("gpu-b", "Succeeded")]
    # prefect-kubernetes' pod events, related to the flow run
    names = {p["metadata"]["name"] for p in pods}

    def all_succeeded(found: list[dict]) -> bool:
        return {e["resource"]["prefect.resource.name"] for e in found if e["event"].endswith(".succeeded")} == names

    events = sorted(run_events(stack, run_id, "prefect.kubernetes.pod.", all_succeeded), key=lambda e: e["occurred"])
    for pod in names:
        mine = [e for e in events if e["resource"]["prefect.resource.name"] == pod]
        assert {"prefect.kubernetes.pod.running", "prefect.kubernetes.pod.succeeded"} <= {e["event"] for e in mine}, mine
        # (a pod seen Pending before the scheduler placed it is "unscheduled"; once running it names its node)
        (running,) = [e for e in mine if e["event"] == "prefect.kubernetes.pod.running"]
        assert running["resource"]["kubernetes.namespace"] == "training" and running["resource"]["kubernetes.node"] in ("gpu-a", "gpu-b")
        assert all(e["resource"]["kubernetes.node"] in ("gpu-a", "gpu-b", "unscheduled") for e in mine), mine
    env = {e["name"]: e for e in pods[0]["spec"]["containers"][0]["env"]}
    assert "value" not in env["AWS_SECRET_ACCESS_KEY"] and env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == S3_SECRET


def test_cancelling_a_run_deletes_its_jobset_and_its_pods_stop(kube, stack, kube_pool, dataset):
    from prefect.client.schemas.objects import StateType

    from tests.support.runs import cancel, flow_run, wait_for_log

    run_id = start_kube_run(stack, dataset, "cancelled", gpus=2, steps=100_000)
    wait_for_log(stack, run_id, "step ")
    name = jobset_of(stack, run_id)
    cancel(stack, run_id)
    wait_for("the JobSet deleted", lambda: ("jobsets", name, "Foreground") in kube.api.deletes, 60)
    wait_for("its pods gone", lambda: not [p for p in kube.pods() if name in p["metadata"]["name"]], 60)
    wait_for("its containers stopped", lambda: not [c for n, c in list(kube.containers.items()) if name in n], 30)
    wait_for("the run Cancelled", lambda: flow_run(stack, run_id).state.type == StateType.CANCELLED, 60)


@pytest.mark.faults
def test_a_pod_killed_for_memory_crashes_the_run_naming_pod_node_and_reason(kube, stack, kube_pool, dataset):
    from tests.support.runs import flow_run, wait_for_log

    run_id = start_kube_run(stack, dataset, "oom-killed", gpus=4, steps=100_000)
    wait_for_log(stack, run_id, "step ")
    name = jobset_of(stack, run_id)
    (victim,) = [n for n in list(kube.containers) if n.startswith(f"{name}-g0-0-1-")]
    kube.kill_container(victim, oom=True)
    expected = f"pod {victim} on gpu-b failed (OOMKilled, exit code 137)"
    wait_for(
        "the run crashed naming the cause", lambda: (s := flow_run(stack, run_id).state).is_crashed() and expected in (s.message or ""), 90
    )
    wait_for("the JobSet deleted", lambda: ("jobsets", name, "Foreground") in kube.api.deletes, 30)
    wait_for("the other pod stopped", lambda: not [c for n, c in list(kube.containers.items()) if name in n], 30)


@pytest.mark.faults
def test_a_node_lost_crashes_the_run_naming_the_pod_and_node(kube, stack, kube_pool, dataset):
    from tests.support.runs import flow_run, wait_for_log

    run_id = start_kube_run(stack, dataset, "node-lost", gpus=4, steps=100_000)
    wait_for_log(stack, run_id, "step ")
    name = jobset_of(stack, run_id)
    try:
        kube.lose_node("gpu-b")
        expected = "on gpu-b was deleted before it ended (DisruptionTarget: DeletionByTaintManager)"
        wait_for("the run crashed naming the cause", lambda: expected in (flow_run(stack, run_id).state.message or ""), 90)
        assert flow_run(stack, run_id).state.is_crashed()
        wait_for("the pod on gpu-a stopped", lambda: not [c for n, c in list(kube.containers.items()) if name in n], 30)
    finally:
        kube.restore_node("gpu-b")


@pytest.mark.faults
def test_a_run_whose_worker_machine_is_lost_has_its_jobset_deleted_by_the_next_worker(kube, stack, kube_pool, dataset):
    """The worker and its watcher die together (the watcher frozen, then both killed with -9:
    nothing deletes anything on the way out); the next worker reclaims the run: it deletes the
    JobSet, whose pods then stop, releases the GPUs and marks the run Crashed, saying so."""
    import os
    import signal

    import psutil

    from frenzy_prefect.launch.kubernetes import SUBMISSION_ENV
    from tests.support.runs import flow_run, wait_for_log

    run_id = start_kube_run(stack, dataset, "worker-lost", gpus=2, steps=100_000)
    wait_for_log(stack, run_id, "step ")
    name = jobset_of(stack, run_id)
    worker = stack.processes["k8s-worker"]
    (watcher,) = [p for p in psutil.Process(worker.pid).children(recursive=True) if name in p.environ().get(SUBMISSION_ENV, "")]
    watcher.send_signal(signal.SIGSTOP)  # (its SIGTERM from the worker's death then waits, and dies with it)
    worker.kill()
    worker.wait()
    os.kill(watcher.pid, signal.SIGKILL)
    assert ("jobsets", name, "Foreground") not in kube.api.deletes and [n for n in list(kube.containers) if name in n]
    stack.start_worker(KUBE_POOL, name="k8s-worker")
    wait_for("the next worker deleting the JobSet", lambda: ("jobsets", name, "Foreground") in kube.api.deletes, 120)
    wait_for("the run's pods stopped", lambda: not [n for n in list(kube.containers) if name in n], 60)
    # (rank 0, stopped by the deletion, reports a bare SIGTERM first; the reclaim's account replaces it)
    reclaimed = f"stopped its processes, deleted JobSet/{name} and released its GPUs"
    wait_for("the run crashed naming the cause", lambda: reclaimed in (flow_run(stack, run_id).state.message or ""), 60)
    assert flow_run(stack, run_id).state.is_crashed()


@pytest.mark.faults
def test_an_image_the_nodes_cannot_pull_crashes_the_run_at_once_naming_it(kube, stack, kube_pool, dataset):
    from tests.support.runs import flow_run

    image = "registry.example.com/team/frenzy-prefect:no-such-tag"
    run_id = start_kube_run(stack, dataset, "no-image", gpus=2, steps=2, job_variables={"image": image})
    expected = f'failed to pull image "{image}"'
    wait_for("the run crashed naming the cause", lambda: expected in (flow_run(stack, run_id).state.message or ""), 120)
    state = flow_run(stack, run_id).state
    assert state.is_crashed() and "cannot start (ErrImagePull: " in state.message and " on gpu-a " in state.message, state.message
    wait_for(
        "its pods gone", lambda: not [p for p in kube.pods() if p["metadata"]["labels"].get("prefect.io/flow-run-id") == str(run_id)], 60
    )


@pytest.mark.faults
def test_with_max_restarts_a_run_whose_node_is_lost_resumes_from_its_checkpoint_on_a_like_node(kube, stack, kube_pool, dataset):
    """A 2-GPU run on one A10 node with max_restarts=1: that node is lost after a checkpoint; the
    watcher deletes the run's JobSet, submits a new one on the other A10 node, and the run
    resumes from its last complete checkpoint and completes, never leaving Running meanwhile."""
    from frenzy_prefect.training.manifest import complete_checkpoints
    from tests.support.kubernetes_cluster import finished
    from tests.support.runs import flow_run, job_of_run, run_logs, wait_final, wait_for_log

    run_id = start_kube_run(stack, dataset, "node-restarts", gpus=2, steps=120, max_restarts=1, checkpoint_every=10, log_every=10)
    wait_for_log(stack, run_id, "step ")
    first, job = jobset_of(stack, run_id), job_of_run(stack, run_id)
    wait_for("a complete checkpoint", lambda: complete_checkpoints(job.checkpoint_uri), 240)
    (pod,) = [p for p in kube.pods("training") if p["metadata"]["name"].startswith(first) and not finished(p)]
    node = pod["spec"]["nodeName"]
    other = {"gpu-a": "gpu-b", "gpu-b": "gpu-a"}[node]
    try:
        kube.lose_node(node)
        with stack.client_settings():
            run = wait_final(run_id, timeout_s=400)
    finally:
        kube.restore_node(node)
    logs = run_logs(stack, run_id)
    assert run.state.is_completed(), (run.state.message, logs[-30:])
    (restart,) = [m for m in logs if m.startswith(f"node {node} lost; restarting from step ")]
    second = restart.split(" as ")[1].split()[0]
    assert restart.endswith(f"as {second} on {other} x2 (0 restart(s) left)"), restart
    submitted = [m for m in logs if m.startswith("Submitted Kubernetes JobSet ")]
    assert [m.split()[3] for m in submitted] == [first, second] and f"on {other} x2" in submitted[1]
    assert flow_run(stack, run_id).labels["frenzy.kubernetes-job"] == second
    step = int(restart.split("restarting from step ")[1].split()[0])
    assert step > 0 and any(m.startswith("resumed from ") and f"(step {step}," in m for m in logs), logs
    from prefect.client.orchestration import get_client

    with stack.client_settings(), get_client(sync_client=True) as client:
        states = [s.type.value for s in client.read_flow_run_states(run_id)]
    assert not {"FAILED", "CRASHED"} & set(states), states
