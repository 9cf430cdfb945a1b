"""The `kubernetes` launcher: the manifests it writes, held to the official schemas in strict
mode (tests/support/kubernetes_schemas.py), the inventory it reads from nodes and pods, and training runs
through the real pool against a Kubernetes API server on 127.0.0.1 (tests/support/kubernetes_cluster.py:
real HTTP, driven by kubernetes_asyncio; a scripted scheduler, Job/JobSet controllers and kubelet
that run each pod's command as a local process)."""

from __future__ import annotations

import copy

import pytest

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.launch.kubernetes_manifest import (
    GPU_RESOURCE,
    JOB_LABEL,
    RUN_ID_LABEL,
    check_dns_label,
    manifests,
    object_name,
)
from tests.support.kubernetes import RUN_ID, container, kube_pod, submission
from tests.support.kubernetes_cluster import node_object as kube_node
from tests.support.kubernetes_schemas import VERSIONS, Invalid, validate, validate_everywhere

pytestmark = pytest.mark.kubernetes


def pods_of(obj: dict) -> list[dict]:
    """The pod templates of a JobSet or a Job."""
    if obj["kind"] == "JobSet":
        return [rj["template"]["spec"]["template"] for rj in obj["spec"]["replicatedJobs"]]
    return [obj["spec"]["template"]] if obj["kind"] == "Job" else []


@pytest.mark.parametrize("api", ["jobset", "job"])
@pytest.mark.parametrize("nodes", [(("gpu-a", 2),), (("gpu-a", 2), ("gpu-b", 2)), (("gpu-a", 4), ("gpu-b", 4), ("gpu-c", 1))])
def test_every_manifest_validates_strictly_for_each_kubernetes_version(api, nodes):
    objects = manifests(submission(api, nodes))
    assert [o["kind"] for o in objects] == (["JobSet"] if api == "jobset" else ["Service"] + ["Job"] * (1 + (len(nodes) == 3)))
    for obj in objects:
        validate_everywhere(obj)
        assert obj["metadata"]["labels"][RUN_ID_LABEL] == RUN_ID and obj["metadata"]["namespace"] == "training"


def test_one_pod_per_node_with_its_gpus_pinned_to_its_node_and_product():
    (js,) = manifests(submission(nodes=(("gpu-a", 4), ("gpu-b", 4), ("gpu-c", 1))))
    jobs = js["spec"]["replicatedJobs"]
    assert [(rj["name"], rj["replicas"], rj["template"]["spec"]["completions"]) for rj in jobs] == [("g0", 1, 2), ("g1", 1, 1)]
    for rj, hosts, gpus, offset in zip(jobs, (["gpu-a", "gpu-b"], ["gpu-c"]), (4, 1), (0, 2), strict=True):
        spec = rj["template"]["spec"]
        assert (spec["completionMode"], spec["parallelism"], spec["backoffLimit"]) == ("Indexed", len(hosts), 0)
        pod = spec["template"]
        c = container(pod)
        assert c["resources"]["requests"][GPU_RESOURCE] == c["resources"]["limits"][GPU_RESOURCE] == gpus
        assert c["resources"]["requests"]["cpu"] == "8" and pod["spec"]["restartPolicy"] == "Never"
        (term,) = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert term["matchExpressions"] == [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": hosts},
            {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-A10"]},
        ]
        (spread,) = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert spread == {"labelSelector": {"matchLabels": {JOB_LABEL: js["metadata"]["name"]}}, "topologyKey": "kubernetes.io/hostname"}
        assert f"--node-rank-offset={offset}" in c["command"] and "--nnodes=3" in c["command"]
        assert f"--nproc-per-node={gpus}" in c["command"] and "--max-restarts=1" in c["command"]
        assert pod["spec"]["serviceAccountName"] == "frenzy-trainer" and pod["spec"]["priorityClassName"] == "training"
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": js["metadata"]["name"], "publishNotReadyAddresses": True}
    assert js["spec"]["ttlSecondsAfterFinished"] == 3600


def test_the_rendezvous_is_pod_index_0_by_the_headless_services_dns_name():
    name = object_name("Adorable Cat!", RUN_ID)
    assert name == "frenzy-adorable-cat-0b7c6f0e"
    (js,) = manifests(submission("jobset"))
    assert f"--master-addr={name}-g0-0-0.{name}" in container(pods_of(js)[0])["command"]
    svc, job = manifests(submission("job"))
    assert svc["spec"] == {"clusterIP": "None", "selector": {JOB_LABEL: name}, "publishNotReadyAddresses": True}
    assert job["metadata"]["name"] == f"{name}-g0" and job["spec"]["template"]["spec"]["subdomain"] == name
    assert f"--master-addr={name}-g0-0.{name}" in container(job["spec"]["template"])["command"]
    assert job["spec"]["ttlSecondsAfterFinished"] == 3600
    env = {e["name"]: e.get("value") for e in container(job["spec"]["template"])["env"]}
    assert env["PET_MASTER_PORT"] == "29500"


def test_s3_keys_reach_the_pods_only_by_secret_reference():
    (js,) = manifests(submission())
    env = container(pods_of(js)[0])["env"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env if "valueFrom" in e}
    assert refs["AWS_ACCESS_KEY_ID"] == {"name": "s3-keys", "key": "AWS_ACCESS_KEY_ID"}
    assert refs["AWS_SECRET_ACCESS_KEY"] == {"name": "s3-keys", "key": "AWS_SECRET_ACCESS_KEY"}
    assert refs["AWS_SESSION_TOKEN"]["optional"] is True
    assert all("valueFrom" in e for e in env if e["name"].startswith("AWS_") and e["name"] != "AWS_ENDPOINT_URL")
    leaky = submission().model_copy(update={"env": {"AWS_SECRET_ACCESS_KEY": "hunter2"}})
    with pytest.raises(FrenzyError, match="AWS_SECRET_ACCESS_KEY would be a plain value .*storage_secret") as caught:
        manifests(leaky)
    assert "hunter2" not in str(caught.value)


def test_names_and_owned_pod_fields_are_checked():
    long_name = object_name("x" * 200, RUN_ID)
    assert len(long_name) <= 40 and long_name.endswith("-0b7c6f0e")
    for bad in ("Upper", "-dash", "a" * 64, "under_score", ""):
        with pytest.raises(FrenzyError, match="is not a DNS-1123 label"):
            check_dns_label(bad, "name")
    with pytest.raises(FrenzyError, match="namespace 'Team_A' is not a DNS-1123 label"):
        manifests(submission(namespace="Team_A"))
    with pytest.raises(FrenzyError, match="pod_spec sets containers, restartPolicy, which the launcher writes"):
        s = submission()
        manifests(
            s.model_copy(update={"settings": s.settings.model_copy(update={"pod_spec": {"containers": [], "restartPolicy": "Always"}})})
        )
    with pytest.raises(FrenzyError, match="resources name nvidia.com/gpu"):
        manifests(submission(resources={"limits": {GPU_RESOURCE: 8}}))


def test_the_validator_catches_an_unknown_field_a_wrong_type_and_a_gpu_request_unlike_its_limit():
    """The negative test: each of these the strict check refuses, in a JobSet and a Job."""
    (js,) = manifests(submission())
    svc, job = manifests(submission("job"))

    def broken(obj: dict, change) -> dict:
        out = copy.deepcopy(obj)
        change(out)
        return out

    jobset_spec = lambda o: o["spec"]["replicatedJobs"][0]["template"]["spec"]  # noqa: E731
    cases = {
        "unknown JobSet field": broken(js, lambda o: o["spec"].update(replicatedJob=[])),
        "unknown field deep in a JobSet's pod": broken(js, lambda o: container(jobset_spec(o)["template"]).update(resourcez={})),
        "wrong type in a JobSet": broken(js, lambda o: o["spec"]["replicatedJobs"][0].update(replicas="2")),
        "wrong type in a JobSet's job": broken(js, lambda o: jobset_spec(o).update(completions="two")),
        "typo in JobSet metadata": broken(js, lambda o: o["metadata"].update(label={})),
        "GPU request != limit in a JobSet": broken(
            js, lambda o: container(jobset_spec(o)["template"])["resources"]["requests"].update({GPU_RESOURCE: 1})
        ),
        "unknown Job field": broken(job, lambda o: o["spec"].update(completion=2)),
        "wrong type in a Job": broken(job, lambda o: o["spec"].update(parallelism="two")),
        "GPU request != limit in a Job": broken(
            job, lambda o: container(o["spec"]["template"])["resources"]["limits"].update({GPU_RESOURCE: 4})
        ),
        "restartPolicy Always in a Job": broken(job, lambda o: o["spec"]["template"]["spec"].update(restartPolicy="Always")),
        "a name too long": broken(job, lambda o: o["metadata"].update(name="j" * 64)),
        "unknown Service field": broken(svc, lambda o: o["spec"].update(clusterIp="None")),
    }
    for what, obj in cases.items():
        for version in VERSIONS:
            with pytest.raises(Invalid):
                validate(obj, version)
                pytest.fail(f"{what} passed the strict check for Kubernetes {version}")


def test_gpu_products_map_to_the_catalog_by_model_and_memory():
    from frenzy_prefect.launch.kubernetes_inventory import catalog_product
    from frenzy_prefect.spec.catalog import GPU_CATALOG

    expected = {
        ("NVIDIA-A10", None): "A10",
        ("Tesla-T4", None): "T4",
        ("NVIDIA-A100-SXM4-80GB", 81920): "A100-80GB",
        ("NVIDIA-A100-PCIE-40GB", 40960): "A100-40GB",
        ("NVIDIA-A100-SXM4", 40960): "A100-40GB",  # the model alone, the memory label decides
        ("NVIDIA-H100-80GB-HBM3", 81559): "H100",
        ("NVIDIA-GeForce-RTX-4090", None): "RTX-4090",
        ("Tesla-V100-SXM2-16GB", None): "V100-16GB",
    }
    assert {k: catalog_product(*k, GPU_CATALOG) for k in expected} == expected
    assert catalog_product("AMD-Instinct-MI300X", None, GPU_CATALOG) is None
    assert catalog_product("NVIDIA-A100-SXM4", None, GPU_CATALOG) is None  # 40 or 80 GB: not guessed


def test_discovery_reads_allocatable_gpus_and_refuses_unknown_products_naming_them():
    from frenzy_prefect.launch.kubernetes_inventory import cluster_from_kubernetes, node_of

    nodes = [
        node_of(n)
        for n in (kube_node("a1", 4, "NVIDIA-A10"), kube_node("h1", 8, "NVIDIA-H100-80GB-HBM3", 81559), kube_node("cpu", 0, None))
    ]
    spec = cluster_from_kubernetes(nodes, "k8s")
    assert [(n.name, n.gpu_type, n.gpu_count) for n in spec.nodes] == [("a1", "A10", 4), ("h1", "H100", 8)]
    with pytest.raises(FrenzyError, match=r"GPU product\(s\) AMD-Instinct-MI300X match no known GPU type .*--gpu-types"):
        cluster_from_kubernetes([node_of(kube_node("m1", 8, "AMD-Instinct-MI300X"))], "k8s")
    with pytest.raises(FrenzyError, match="GPU nodes x1 have no nvidia.com/gpu.product label"):
        cluster_from_kubernetes([node_of(kube_node("x1", 2, None))], "k8s")
    with pytest.raises(FrenzyError, match="no Kubernetes node has allocatable nvidia.com/gpu"):
        cluster_from_kubernetes([node_of(kube_node("cpu", 0, None))], "k8s")


def test_free_gpus_are_allocatable_minus_running_pods_requests_whoever_owns_them():
    from frenzy_prefect.launch.kubernetes_inventory import free_counts, node_of
    from frenzy_prefect.launch.slurm_inventory import narrow_to_slurm

    nodes = [
        node_of(n)
        for n in (kube_node("a1", 4, "NVIDIA-A10"), kube_node("a2", 4, "NVIDIA-A10"), kube_node("a3", 4, "NVIDIA-A10", cordoned=True))
    ]
    pods = [kube_pod("a1", 1), kube_pod("a1", 2, limit_only=True), kube_pod("a2", 4, phase="Succeeded"), kube_pod("a2", 1, phase="Pending")]
    counts = free_counts(nodes, pods)
    assert counts == {"a1": 1, "a2": 3, "a3": 0}
    assert narrow_to_slurm({"a1": [0, 1, 2, 3], "a2": [2, 3], "a3": [0]}, counts) == {"a1": [0], "a2": [2, 3], "a3": []}


def failed_pod(**status) -> dict:
    return {"metadata": {"name": "frenzy-x-g0-1-abcde"}, "spec": {"nodeName": "gpu-b"}, "status": {"phase": "Failed", **status}}


def test_a_failed_pod_is_named_with_its_node_reason_and_rank():
    from frenzy_prefect.launch.failure import describe
    from frenzy_prefect.launch.kubernetes import failure_report, pod_problem

    oom = failed_pod(containerStatuses=[{"name": "trainer", "state": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}}])
    assert describe("?", failure_report(oom, pod_problem(oom))) == "pod frenzy-x-g0-1-abcde on gpu-b failed (OOMKilled, exit code 137)"
    message = '{"rank": 3, "local_rank": 1, "pid": 4242, "exitcode": -9, "attempt": 0}'
    killed = failed_pod(containerStatuses=[{"state": {"terminated": {"reason": "Error", "exitCode": 1, "message": message}}}])
    report = failure_report(killed, pod_problem(killed))
    assert report["rank"] == 3
    assert describe("?", report) == "pod frenzy-x-g0-1-abcde (rank 3, pid 4242 was killed by SIGKILL) on gpu-b failed (Error, exit code 1)"
    evicted = failed_pod(reason="Evicted", message="The node was low on resource: memory.")
    assert pod_problem(evicted) == "failed (Evicted: The node was low on resource: memory.)"
    pulling = {
        "status": {
            "phase": "Pending",
            "containerStatuses": [{"state": {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}}],
        }
    }
    assert pod_problem(pulling) == "cannot start (ImagePullBackOff: no such image)"
    assert pod_problem({"status": {"phase": "Running"}}) is None
