"""Node discovery: this machine's GPUs as NVML (nvidia-ml-py) reports them, and the cluster
node they make. Without an NVIDIA driver NVML cannot load; discovery then says so, and the
cluster can always be declared by hand in a cluster file."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.spec.catalog import GPU_CATALOG
from frenzy_prefect.spec.cluster import Node
from frenzy_prefect.units import GIB


class GpuInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    index: int
    name: str
    memory_bytes: int
    nvlinks: int  # active NVLink links
    pcie_generation: int | None
    pcie_width: int | None


# NVML's product names (e.g. "NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-16GB", "NVIDIA GeForce
# RTX 4090") -> catalog types; where one name covers two memory sizes, the size decides.
_PATTERNS: list[tuple[str, str | tuple[str, str]]] = [
    (r"\bH200\b", "H200"),
    (r"\bH100\b", "H100"),
    (r"\bA100\b", ("A100-40GB", "A100-80GB")),
    (r"\bA10\b", "A10"),
    (r"\bL4\b", "L4"),
    (r"\bV100\b", ("V100-16GB", "V100-32GB")),
    (r"\bT4\b", "T4"),
    (r"\bP100\b", "P100"),
    (r"\bRTX 3090\b", "RTX-3090"),
    (r"\bRTX 4090\b", "RTX-4090"),
]


def catalog_type(nvml_name: str, memory_bytes: int) -> str:
    for pattern, match in _PATTERNS:
        if re.search(pattern, nvml_name.upper().replace("-", " ")):
            if isinstance(match, str):
                return match
            small, large = match
            return large if memory_bytes > GPU_CATALOG[small].memory_bytes * 1.25 else small
    raise FrenzyError(
        f"GPU {nvml_name!r} is not in the catalog ({', '.join(GPU_CATALOG)}); declare its type under gpu_types in a cluster file"
    )


def read_gpus() -> list[GpuInfo]:
    """Every GPU NVML sees here; FrenzyError if NVML cannot be used."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise FrenzyError(
            f"NVML is not available on this machine ({exc}): is the NVIDIA driver installed? "
            "Without it, declare the node in a cluster file (and save that as a FrenzyCluster block)"
        ) from None
    try:
        return [_gpu(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()


def _gpu(pynvml, index: int) -> GpuInfo:  # noqa: ANN001 - the pynvml module
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def optional(call, *args):  # noqa: ANN001, ANN202 - NVML raises for what a GPU does not support
        try:
            return call(handle, *args)
        except pynvml.NVMLError:
            return None

    name = pynvml.nvmlDeviceGetName(handle)
    links = sum(
        optional(pynvml.nvmlDeviceGetNvLinkState, link) == pynvml.NVML_FEATURE_ENABLED for link in range(pynvml.NVML_NVLINK_MAX_LINKS)
    )
    return GpuInfo(
        index=index,
        name=name.decode() if isinstance(name, bytes) else name,
        memory_bytes=pynvml.nvmlDeviceGetMemoryInfo(handle).total,
        nvlinks=links,
        pcie_generation=optional(pynvml.nvmlDeviceGetCurrPcieLinkGeneration),
        pcie_width=optional(pynvml.nvmlDeviceGetCurrPcieLinkWidth),
    )


def node_of(name: str, host: str, gpus: list[GpuInfo]) -> Node:
    """The cluster node these GPUs make (a node holds one GPU type)."""
    if not gpus:
        raise FrenzyError(f"NVML found no GPU on node {name!r}; a node without GPUs is not part of a training cluster")
    types = {catalog_type(g.name, g.memory_bytes) for g in gpus}
    if len(types) > 1:
        raise FrenzyError(f"node {name!r} mixes GPU types ({', '.join(sorted(types))}); declare it as one node per type in a cluster file")
    return Node(
        name=name, host=host, gpu_type=types.pop(), gpu_count=len(gpus), gpu_memory_gib=round(min(g.memory_bytes for g in gpus) / GIB, 2)
    )
