"""A training run as Kubernetes objects: one pod per allocated node, torchrun in each.

The allocator's nodes, in rank order, are cut into groups of consecutive nodes with the same GPU
count and product; each group is one Indexed Job (``completions`` = its nodes), so a pod's node
rank is its group's offset plus its completion index (JOB_COMPLETION_INDEX, which the Job
controller sets). With the JobSet API (``jobset.x-k8s.io/v1alpha2``, what Kubeflow Trainer v2
builds on) the groups are the JobSet's replicated jobs and JobSet makes the headless Service;
without it they are plain Jobs beside a headless Service of our own. Either way every pod is
reachable by DNS from the first pod on, ready or not (publishNotReadyAddresses), and the static
rendezvous is at group 0's index 0: ``<name>-g0-0-0.<name>`` (JobSet), ``<name>-g0-0.<name>``
(Job).

Each pod asks for exactly its node's GPUs (``nvidia.com/gpu``, request = limit: the device plugin
hands out whole GPUs) and is pinned by required node affinity to its group's nodes
(``kubernetes.io/hostname``) and their GPU product (``nvidia.com/gpu.product``, GPU feature
discovery's label), one pod per node (pod anti-affinity on the hostname). Pods never restart
(``restartPolicy: Never``, ``backoffLimit: 0``): torchrun restarts the ranks in place
(``--max-restarts``), and a failed pod fails the run, named by the launcher. S3 and Prefect keys
reach the pods only as ``secretKeyRef`` (a value in a manifest is readable by whoever can read
the object). Every object carries labels naming the flow run. Pure: no Prefect, no client.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.launch.kubernetes_pod import TERMINATION_LOG_ENV
from frenzy_prefect.launch.torchrun import MASTER_PORT_ENV

GPU_RESOURCE = "nvidia.com/gpu"
PRODUCT_LABEL = "nvidia.com/gpu.product"  # GPU feature discovery (NVIDIA GPU operator)
MEMORY_LABEL = "nvidia.com/gpu.memory"  # MiB per GPU, GPU feature discovery
HOSTNAME_LABEL = "kubernetes.io/hostname"
RUN_ID_LABEL = "prefect.io/flow-run-id"  # prefect-kubernetes' labels
RUN_NAME_LABEL = "prefect.io/flow-run-name"
JOB_LABEL = "frenzy.prefect.io/job"  # the run's objects: the Service's selector, the anti-affinity
GROUP_LABEL = "frenzy.prefect.io/group"
MANAGED_BY = {"app.kubernetes.io/managed-by": "frenzy-prefect"}
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
CONTAINER = "trainer"
TERMINATION_LOG = "/dev/termination-log"  # where the pod writes its failure's account (the kubelet puts it in the pod's status)
MAX_NAME = 40  # a pod's hostname <name>-g<i>-<j>-<k> stays within a DNS label's 63 characters
# Never a plain value in a manifest: each comes from a Secret (secretKeyRef) or not at all.
SECRET_ENV = frozenset({"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "PREFECT_API_KEY", "PREFECT_API_AUTH_STRING"})
STORAGE_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")  # the storage Secret's keys (the token optional)
# Pod-spec fields the launcher writes itself; pod_spec may add any other.
OWNED_POD_FIELDS = frozenset({"containers", "restartPolicy", "affinity", "subdomain", "hostname", "serviceAccountName", "nodeName"})
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


class KubernetesSettings(BaseModel):
    """The pool's Kubernetes variables."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    image: str = Field(min_length=1, description="An image with frenzy-prefect (and torch) installed.")
    namespace: str = "default"
    service_account: str | None = None
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    python: str = Field(default="python", description="The interpreter with frenzy-prefect in the image.")
    env: dict[str, str] = Field(default_factory=dict, description="Plain environment of the pods (no secrets).")
    resources: dict[str, dict[str, str | int]] = Field(
        default_factory=dict, description="The container's requests and limits besides its GPUs, e.g. {requests: {cpu: '8'}}."
    )
    pod_spec: dict[str, Any] = Field(default_factory=dict, description="Further pod-spec fields: tolerations, volumes, nodeSelector, ...")
    api: Literal["auto", "jobset", "job"] = Field(
        default="auto", description="jobset, job (Indexed Jobs + a headless Service), or auto: jobset where the cluster serves it."
    )
    storage_secret: str | None = Field(default=None, description="Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for S3.")
    api_key_secret: str | None = Field(default=None, description="Secret whose key 'key' is the Prefect API key, when one is needed.")
    ttl_seconds_after_finished: NonNegativeInt = 3600
    rendezvous_port: int = Field(default=29500, ge=1, le=65535)


class NodePods(BaseModel):
    """One allocated node: its pod asks for ``gpus`` GPUs of ``product``."""

    model_config = ConfigDict(frozen=True)

    node: str
    gpus: PositiveInt
    product: str


class KubernetesSubmission(BaseModel):
    model_config = ConfigDict(frozen=True)

    settings: KubernetesSettings
    name: str = Field(description="The objects' name, a DNS-1123 label of at most MAX_NAME characters.")
    flow_run_id: str
    flow_run_name: str = ""
    nodes: list[NodePods] = Field(min_length=1, description="The allocator's nodes, in rank order.")
    max_restarts: NonNegativeInt = 0
    env: dict[str, str] = Field(default_factory=dict, description="The ranks' plain environment (the job, the Prefect API URL).")


def check_dns_label(value: str, what: str, limit: int = 63) -> str:
    """``value`` when it is a DNS-1123 label of at most ``limit`` characters; else FrenzyError."""
    if len(value) > limit or not _DNS_LABEL.match(value):
        raise FrenzyError(
            f"{what} {value!r} is not a DNS-1123 label: lower-case letters, digits and '-', starting and ending alphanumeric, "
            f"at most {limit} characters"
        )
    return value


def object_name(flow_run_name: str, flow_run_id: str) -> str:
    """``frenzy-<run name>-<first 8 of its id>``, cut to MAX_NAME: a DNS label unique to the run."""
    slug = re.sub(r"[^a-z0-9]+", "-", flow_run_name.lower()).strip("-")
    tail = re.sub(r"[^a-z0-9]", "", flow_run_id.lower())[:8] or "run"
    head = f"frenzy-{slug}"[: MAX_NAME - len(tail) - 1].rstrip("-")
    return check_dns_label(f"{head}-{tail}", "object name", MAX_NAME)


def label_value(value: str) -> str:
    """``value`` as a label value (at most 63 characters of [A-Za-z0-9-_.], alphanumeric at the ends)."""
    cut = re.sub(r"[^A-Za-z0-9_.-]+", "-", value)[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", cut)


def run_labels(sub: KubernetesSubmission) -> dict[str, str]:
    labels = {**MANAGED_BY, JOB_LABEL: sub.name, RUN_ID_LABEL: label_value(sub.flow_run_id)}
    if name := label_value(sub.flow_run_name):
        labels[RUN_NAME_LABEL] = name
    return labels


def node_groups(nodes: list[NodePods]) -> list[list[NodePods]]:
    """Consecutive nodes of the same GPU count and product: one Indexed Job each."""
    groups: list[list[NodePods]] = []
    for n in nodes:
        if groups and (groups[-1][0].gpus, groups[-1][0].product) == (n.gpus, n.product):
            groups[-1].append(n)
        else:
            groups.append([n])
    return groups


def rendezvous_host(sub: KubernetesSubmission) -> str:
    """The DNS name of the first node's pod (group 0, index 0) within the namespace."""
    pod = f"{sub.name}-g0-0" if sub.settings.api == "job" else f"{sub.name}-g0-0-0"
    return f"{pod}.{sub.name}"


def _secret_ref(secret: str, key: str, optional: bool = False) -> dict[str, Any]:
    ref: dict[str, Any] = {"name": secret, "key": key}
    if optional:
        ref["optional"] = True
    return {"valueFrom": {"secretKeyRef": ref}}


def container_env(sub: KubernetesSubmission) -> list[dict[str, Any]]:
    """The pods' environment: the plain values, then each secret by reference. FrenzyError when
    a secret's name carries a plain value."""
    plain = {**sub.settings.env, **sub.env}
    if leaked := sorted(SECRET_ENV & plain.keys()):
        raise FrenzyError(
            f"{', '.join(leaked)} would be a plain value in the run's manifests; give S3 keys as the pool's storage_secret "
            "and the Prefect API key as its api_key_secret (Kubernetes Secrets)"
        )
    plain |= {MASTER_PORT_ENV: str(sub.settings.rendezvous_port), TERMINATION_LOG_ENV: TERMINATION_LOG}
    env = [{"name": k, "value": v} for k, v in sorted(plain.items())]
    if secret := sub.settings.storage_secret:
        env += [{"name": k, **_secret_ref(secret, k, optional=k == "AWS_SESSION_TOKEN")} for k in STORAGE_KEYS]
    if secret := sub.settings.api_key_secret:
        env.append({"name": "PREFECT_API_KEY", **_secret_ref(secret, "key")})
    return env


def pod_argv(sub: KubernetesSubmission, group: list[NodePods], offset: int) -> list[str]:
    """The pod's command: its node's torchrun agent (launch.kubernetes_pod adds its completion index to ``offset``)."""
    return [
        sub.settings.python,
        "-m",
        "frenzy_prefect.launch.kubernetes_pod",
        f"--nnodes={len(sub.nodes)}",
        f"--node-rank-offset={offset}",
        f"--nproc-per-node={group[0].gpus}",
        f"--master-addr={rendezvous_host(sub)}",
        f"--max-restarts={sub.max_restarts}",
    ]


def resources(settings: KubernetesSettings, gpus: int) -> dict[str, dict[str, str | int]]:
    """The pool's requests and limits with the node's GPUs in both (an extended resource's request must equal its limit)."""
    if GPU_RESOURCE in {**settings.resources.get("requests", {}), **settings.resources.get("limits", {})}:
        raise FrenzyError(f"the pool's resources name {GPU_RESOURCE}; the launcher sets it to each node's allocated GPUs")
    out = copy.deepcopy(settings.resources)
    for kind in ("requests", "limits"):
        out[kind] = {**out.get(kind, {}), GPU_RESOURCE: gpus}
    return out


def affinity(sub: KubernetesSubmission, group: list[NodePods]) -> dict[str, Any]:
    """Required: one of the group's nodes, with the group's GPU product, no other pod of the run there."""
    expressions = [
        {"key": HOSTNAME_LABEL, "operator": "In", "values": [n.node for n in group]},
        {"key": PRODUCT_LABEL, "operator": "In", "values": [group[0].product]},
    ]
    spread = {"labelSelector": {"matchLabels": {JOB_LABEL: sub.name}}, "topologyKey": HOSTNAME_LABEL}
    return {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": expressions}]}},
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [spread]},
    }


def pod_template(sub: KubernetesSubmission, index: int, group: list[NodePods], offset: int) -> dict[str, Any]:
    s = sub.settings
    if owned := sorted(OWNED_POD_FIELDS & s.pod_spec.keys()):
        raise FrenzyError(f"the pool's pod_spec sets {', '.join(owned)}, which the launcher writes itself; leave them out")
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": s.image,
        "command": pod_argv(sub, group, offset),
        "env": container_env(sub),
        "resources": resources(s, group[0].gpus),
        "ports": [{"name": "rendezvous", "containerPort": s.rendezvous_port, "protocol": "TCP"}],
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if s.image_pull_policy:
        container["imagePullPolicy"] = s.image_pull_policy
    spec: dict[str, Any] = {
        **copy.deepcopy(s.pod_spec),
        "restartPolicy": "Never",
        "containers": [container],
        "affinity": affinity(sub, group),
    }
    if s.service_account:
        spec["serviceAccountName"] = s.service_account
    if s.api == "job":
        spec["subdomain"] = sub.name  # the headless Service: <job>-<index>.<service>
    return {"metadata": {"labels": {**run_labels(sub), GROUP_LABEL: f"g{index}"}}, "spec": spec}


def job_spec(sub: KubernetesSubmission, index: int, group: list[NodePods], offset: int) -> dict[str, Any]:
    spec = {
        "completionMode": "Indexed",
        "completions": len(group),
        "parallelism": len(group),
        "backoffLimit": 0,
        "template": pod_template(sub, index, group, offset),
    }
    if sub.settings.api == "job":
        spec["ttlSecondsAfterFinished"] = sub.settings.ttl_seconds_after_finished
    return spec


def _metadata(sub: KubernetesSubmission, name: str) -> dict[str, Any]:
    return {"name": name, "namespace": sub.settings.namespace, "labels": run_labels(sub)}


def _groups_with_offsets(sub: KubernetesSubmission) -> list[tuple[int, list[NodePods], int]]:
    out, offset = [], 0
    for i, group in enumerate(node_groups(sub.nodes)):
        out.append((i, group, offset))
        offset += len(group)
    return out


def jobset(sub: KubernetesSubmission) -> dict[str, Any]:
    """The run as one JobSet: a replicated job (one replica) per node group; JobSet's own headless Service."""
    replicated = [
        {"name": f"g{i}", "replicas": 1, "template": {"metadata": {"labels": run_labels(sub)}, "spec": job_spec(sub, i, g, off)}}
        for i, g, off in _groups_with_offsets(sub)
    ]
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": _metadata(sub, sub.name),
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": sub.name, "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": 0},  # torchrun restarts ranks in place; a failed pod is the run's failure
            "successPolicy": {"operator": "All"},
            "ttlSecondsAfterFinished": sub.settings.ttl_seconds_after_finished,
            "replicatedJobs": replicated,
        },
    }


def headless_service(sub: KubernetesSubmission) -> dict[str, Any]:
    """DNS names for the run's pods, ready or not (the rendezvous comes before readiness)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(sub, sub.name),
        "spec": {"clusterIP": "None", "selector": {JOB_LABEL: sub.name}, "publishNotReadyAddresses": True},
    }


def indexed_jobs(sub: KubernetesSubmission) -> list[dict[str, Any]]:
    return [
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(sub, f"{sub.name}-g{i}"), "spec": job_spec(sub, i, g, off)}
        for i, g, off in _groups_with_offsets(sub)
    ]


def manifests(sub: KubernetesSubmission) -> list[dict[str, Any]]:
    """Every object of the run, in creation order: [JobSet], or [Service, Job...] without JobSet."""
    check_dns_label(sub.name, "object name", MAX_NAME)
    check_dns_label(sub.settings.namespace, "namespace")
    if sub.settings.service_account:
        check_dns_label(sub.settings.service_account, "service account", 253)
    for secret in (sub.settings.storage_secret, sub.settings.api_key_secret):
        if secret:
            check_dns_label(secret, "secret name", 253)
    if sub.settings.api != "job":  # (auto is resolved by API discovery before: launch.kubernetes)
        return [jobset(sub)]
    return [headless_service(sub), *indexed_jobs(sub)]


def gpu_request_problems(obj: dict[str, Any]) -> list[str]:
    """Containers of ``obj``'s pods (at any depth) whose ``nvidia.com/gpu`` request differs from
    its limit, or is missing from either: the apiserver refuses such a pod (an extended resource
    cannot be overcommitted), and the schemas do not say so."""
    problems: list[str] = []
    for path, container in containers_of(obj):
        res = container.get("resources", {})
        req, lim = res.get("requests", {}).get(GPU_RESOURCE), res.get("limits", {}).get(GPU_RESOURCE)
        if (req is not None or lim is not None) and (lim is None or (req is not None and str(req) != str(lim))):
            problems.append(f"{path}: {GPU_RESOURCE} request {req!r} != limit {lim!r}")
    return problems


def containers_of(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every container of ``node`` at any depth, with its path (``.spec.template.spec.containers[0]``)."""
    if isinstance(node, list):
        return [found for i, item in enumerate(node) for found in containers_of(item, f"{path}[{i}]")]
    if not isinstance(node, dict):
        return []
    found = [(f"{path}.containers[{i}]", c) for i, c in enumerate(node.get("containers", [])) if isinstance(c, dict)]
    return found + [f for k, v in node.items() if k != "containers" for f in containers_of(v, f"{path}.{k}")]
