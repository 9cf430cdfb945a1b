"""Helpers shared by the tests of kubernetes."""

from __future__ import annotations

from frenzy_prefect.launch.kubernetes_manifest import (
    KubernetesSettings,
    KubernetesSubmission,
    NodePods,
    object_name,
)

RUN_ID = "0b7c6f0e-8d3c-4a53-9e55-3f1d2c4b5a69"


def submission(api: str = "jobset", nodes=(("gpu-a", 2), ("gpu-b", 2)), **settings) -> KubernetesSubmission:
    fields = {
        "image": "registry.example.com/frenzy:0.1.0",
        "namespace": "training",
        "service_account": "frenzy-trainer",
        "env": {"AWS_ENDPOINT_URL": "http://minio.storage:9000"},
        "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": "64Gi"}},
        "pod_spec": {
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "priorityClassName": "training",
        },
        "api": api,
        "storage_secret": "s3-keys",
    }
    s = KubernetesSettings(**(fields | settings))
    return KubernetesSubmission(
        settings=s,
        name=object_name("Adorable Cat!", RUN_ID),
        flow_run_id=RUN_ID,
        flow_run_name="Adorable Cat!",
        nodes=[NodePods(node=n, gpus=g, product="NVIDIA-A10") for n, g in nodes],
        max_restarts=1,
        env={"PREFECT_API_URL": "http://prefect.prefect:4200/api", "PREFECT__FLOW_RUN_ID": RUN_ID},
    )


def container(pod: dict) -> dict:
    (c,) = pod["spec"]["containers"]
    return c


def kube_pod(node: str, gpus: int, phase: str = "Running", limit_only: bool = False) -> dict:
    res = {"limits": {"nvidia.com/gpu": gpus}} if limit_only else {"requests": {"nvidia.com/gpu": gpus}, "limits": {"nvidia.com/gpu": gpus}}
    return {"spec": {"nodeName": node, "containers": [{"name": "c", "resources": res}, {"name": "sidecar"}]}, "status": {"phase": phase}}
