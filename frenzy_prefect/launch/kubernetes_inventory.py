"""Kubernetes as the source of truth for a cluster's GPUs: its nodes' allocatable
``nvidia.com/gpu`` and GPU feature discovery labels, and what the pods running there already
requested (pods that are not ours are respected).

A node's ``nvidia.com/gpu.product`` label (``NVIDIA-A100-SXM4-80GB``, ``Tesla-T4``) is mapped to a
GPU type of the catalog (or of the cluster's declared ``gpu_types``) by name, the way Slurm's GRES
types are (slurm_inventory.catalog_type: case and punctuation ignored), once the vendor and
form-factor words are dropped; where the model alone leaves a choice (A100 40GB or 80GB), the
``nvidia.com/gpu.memory`` label (MiB) decides. A product that matches none is refused, naming it.
The functions over nodes and pods take them as the API's JSON (camelCase dicts); read_cluster
lists them through kubernetes_asyncio. No Prefect.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.launch.kubernetes_manifest import GPU_RESOURCE, HOSTNAME_LABEL, MEMORY_LABEL, PRODUCT_LABEL
from frenzy_prefect.launch.slurm_inventory import catalog_type
from frenzy_prefect.spec.catalog import GPU_CATALOG
from frenzy_prefect.spec.cluster import ClusterSpec, Node
from frenzy_prefect.spec.gpu import GpuType
from frenzy_prefect.units import GIB

# Words of a GPU product label that name the vendor, brand or form factor, not the model.
_NOT_THE_MODEL = re.compile(r"^(nvidia|tesla|geforce|quadro|sxm\d*|pcie|pci|hbm\d*e?|nvl|nvlink|mig.*)$", re.IGNORECASE)
_DONE = {"Succeeded", "Failed"}  # a pod in these phases holds no GPU


@dataclass(frozen=True)
class KubeNode:
    name: str
    product: str | None  # nvidia.com/gpu.product
    memory_mib: int | None  # nvidia.com/gpu.memory
    gpus: int  # allocatable nvidia.com/gpu
    schedulable: bool  # Ready and not cordoned

    @property
    def address(self) -> str:
        return self.name


def quantity(value: Any) -> int:
    """A count quantity (``8``, ``"8"``); FrenzyError for another form (GPUs come whole)."""
    text = str(value)
    if not text.isdigit():
        raise FrenzyError(f"{GPU_RESOURCE} quantity {value!r} is not a whole number")
    return int(text)


def node_of(obj: dict[str, Any]) -> KubeNode:
    meta, status, spec = obj.get("metadata", {}), obj.get("status", {}), obj.get("spec", {})
    labels = meta.get("labels", {}) or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []) or [])
    memory = labels.get(MEMORY_LABEL)
    return KubeNode(
        name=labels.get(HOSTNAME_LABEL) or meta["name"],
        product=labels.get(PRODUCT_LABEL),
        memory_mib=int(memory) if memory and str(memory).isdigit() else None,
        gpus=quantity((status.get("allocatable", {}) or {}).get(GPU_RESOURCE, 0)),
        schedulable=ready and not spec.get("unschedulable", False),
    )


def pod_gpus(pod: dict[str, Any]) -> int:
    """The GPUs a pod holds: its containers' together, or its largest init container's if more
    (the scheduler's effective request); a limit alone is the request."""

    def of(c: dict[str, Any]) -> int:
        res = c.get("resources", {}) or {}
        value = (res.get("requests", {}) or {}).get(GPU_RESOURCE, (res.get("limits", {}) or {}).get(GPU_RESOURCE, 0))
        return quantity(value)

    spec = pod.get("spec", {})
    return max([sum(of(c) for c in spec.get("containers", []) or []), *(of(c) for c in spec.get("initContainers", []) or [])])


def gpus_in_use(pods: list[dict[str, Any]]) -> dict[str, int]:
    """GPUs requested on each node by pods bound there and not finished, whoever's they are."""
    used: dict[str, int] = {}
    for pod in pods:
        node = pod.get("spec", {}).get("nodeName")
        if node and pod.get("status", {}).get("phase") not in _DONE:
            used[node] = used.get(node, 0) + pod_gpus(pod)
    return used


def free_counts(nodes: list[KubeNode], pods: list[dict[str, Any]]) -> dict[str, int]:
    """GPUs free now on each node: allocatable minus what running pods requested (0 on a node not Ready or cordoned)."""
    used = gpus_in_use(pods)
    return {n.name: max(0, n.gpus - used.get(n.name, 0)) if n.schedulable else 0 for n in nodes}


def model_words(product: str) -> list[str]:
    """``NVIDIA-A100-SXM4-80GB`` -> ``[A100, 80GB]``."""
    return [w for w in re.split(r"[-_ ]+", product) if w and not _NOT_THE_MODEL.match(w)]


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def catalog_product(product: str, memory_mib: int | None, known: dict[str, GpuType]) -> str | None:
    """The known GPU type a GPU product label names: by its model words, whole (A100-80GB), else
    by its model (A100: the one type of that model, or the one whose memory is nearest the
    node's label)."""
    words = model_words(product)
    if not words:
        return None
    if exact := catalog_type("-".join(words), known) or catalog_type(product, known):
        return exact
    same_model = [name for name in known if _key(re.split(r"[-_ ]", name)[0]) == _key(words[0])]
    if len(same_model) == 1:
        return same_model[0]
    if same_model and memory_mib:
        return min(same_model, key=lambda n: abs(known[n].memory_bytes - memory_mib * 2**20))
    return None


def cluster_from_kubernetes(nodes: list[KubeNode], name: str, gpu_types: dict[str, GpuType] | None = None) -> ClusterSpec:
    """A ClusterSpec of the nodes with allocatable GPUs; FrenzyError naming the products that
    match no known type, or the GPU nodes without a product label."""
    chosen = [n for n in nodes if n.gpus]
    if not chosen:
        raise FrenzyError(
            f"no Kubernetes node has allocatable {GPU_RESOURCE} (is the NVIDIA device plugin running?); "
            f"found nodes: {', '.join(n.name for n in nodes) or 'none'}"
        )
    unlabelled = [n.name for n in chosen if not n.product]
    if unlabelled:
        raise FrenzyError(
            f"GPU nodes {', '.join(unlabelled)} have no {PRODUCT_LABEL} label; run GPU feature discovery (the NVIDIA GPU operator) "
            "or label them with their GPU product"
        )
    known = {**GPU_CATALOG, **(gpu_types or {})}
    mapped = {n.name: catalog_product(n.product or "", n.memory_mib, known) for n in chosen}
    unknown = sorted({n.product for n in chosen if mapped[n.name] is None})  # type: ignore[misc]
    if unknown:
        raise FrenzyError(
            f"GPU product(s) {', '.join(unknown)} match no known GPU type (known: {', '.join(sorted(known))}); "
            "declare them in a GPU types file (--gpu-types) named as the product label names them"
        )
    return ClusterSpec(
        name=name,
        nodes=[_node(n, mapped[n.name], known) for n in chosen],  # type: ignore[arg-type]
        gpu_types=gpu_types or {},
    )


def _node(n: KubeNode, gpu_type: str, known: dict[str, GpuType]) -> Node:
    memory = n.memory_mib * 2**20 / GIB if n.memory_mib else None
    differs = memory is not None and abs(memory * GIB - known[gpu_type].memory_bytes) > 0.02 * known[gpu_type].memory_bytes
    return Node(name=n.name, host=n.address, gpu_type=gpu_type, gpu_count=n.gpus, gpu_memory_gib=round(memory, 3) if differs else None)


def products(nodes: list[KubeNode]) -> dict[str, str]:
    """Each GPU node's product label (what the pods' node affinity asks for)."""
    return {n.name: n.product for n in nodes if n.product}


async def read_cluster(api: Any) -> tuple[list[KubeNode], list[dict[str, Any]]]:
    """The nodes and every pod, through a kubernetes_asyncio ApiClient ``api``."""
    from kubernetes_asyncio import client

    core = client.CoreV1Api(api)
    nodes = api.sanitize_for_serialization(await core.list_node())
    pods = api.sanitize_for_serialization(await core.list_pod_for_all_namespaces())
    return [node_of(n) for n in nodes.get("items", [])], pods.get("items", [])
