"""Nodes, a cluster inventory, and which of its GPUs are free now (GPU types: ``spec.gpu``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat, model_validator

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.spec.catalog import GPU_CATALOG, catalog_type, type_key
from frenzy_prefect.spec.gpu import GpuType, MemoryMargin
from frenzy_prefect.spec.names import did_you_mean
from frenzy_prefect.units import GIB

MAX_NODE_GPUS = 1024  # beyond any node's (or NVLink domain's) GPU count; the node's free-GPU list is this long


class Node(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    host: str = Field(min_length=1, description="Where its ranks run: 127.0.0.1 for the local launcher.")
    gpu_type: str
    gpu_count: int = Field(gt=0, le=MAX_NODE_GPUS, description="GPUs in the node (one NVLink domain holds at most a few hundred).")
    gpu_memory_gib: PositiveFloat | None = Field(default=None, description="Per-GPU memory; defaults to the GPU type's.")


class ClusterSpec(BaseModel):
    """A cluster inventory: from a YAML/JSON file, a FrenzyCluster block, or node discovery."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "cluster"
    nodes: list[Node] = Field(min_length=1)
    gpu_types: dict[str, GpuType] = Field(default_factory=dict, description="Types the built-in catalog lacks (or overrides).")
    network_gbps: PositiveFloat = Field(default=3.125, description="Bandwidth between nodes, GB/s (25 Gb/s).")
    memory_margin: MemoryMargin = Field(
        default_factory=MemoryMargin, description="GPU memory every plan leaves unused beyond its predicted peak."
    )
    prices: dict[str, NonNegativeFloat] = Field(
        default_factory=dict, description="What a GPU-hour of each type costs in US dollars: plans then show their cost."
    )

    @model_validator(mode="before")
    @classmethod
    def _known_names(cls, data: Any) -> Any:
        """Node types and price keys spelled as Slurm and Kubernetes discovery read them (``h100``,
        ``a100_80gb``: case and punctuation ignored) are the known type's name, where exactly one
        known type matches; any other name is left for ``_check`` to refuse."""
        if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
            return data
        declared = data.get("gpu_types") if isinstance(data.get("gpu_types"), dict) else {}
        known = {**GPU_CATALOG, **declared}

        def name(raw: Any) -> Any:
            return (catalog_type(raw, known) or raw) if isinstance(raw, str) else raw

        nodes = [{**n, "gpu_type": name(n.get("gpu_type"))} if isinstance(n, dict) and "gpu_type" in n else n for n in data["nodes"]]
        prices = data.get("prices")
        if isinstance(prices, dict):
            prices = {name(k): v for k, v in prices.items()}
        return {**data, "nodes": nodes, **({"prices": prices} if "prices" in data else {})}

    @model_validator(mode="after")
    def _check(self) -> ClusterSpec:
        names = [n.name for n in self.nodes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"node names must be unique; repeated: {', '.join(dupes)}")
        known = self.known_gpu_types()
        unknown = sorted(set(self.prices) - known.keys())
        if unknown:
            hint = did_you_mean(unknown[0], known, key=type_key) if len(unknown) == 1 else ""
            raise ValueError(f"prices name unknown GPU types {', '.join(unknown)}{hint}; known types: {', '.join(sorted(known))}")
        for node in self.nodes:
            if node.gpu_type not in known:
                raise ValueError(
                    f"node {node.name!r} has unknown gpu_type {node.gpu_type!r}{did_you_mean(node.gpu_type, known, key=type_key)}; "
                    f"known types: {', '.join(sorted(known))} "
                    "(declare it under gpu_types, in the cluster or in a GPU types file given with it)"
                )
        return self

    def known_gpu_types(self) -> dict[str, GpuType]:
        return {**GPU_CATALOG, **self.gpu_types}

    def gpu_of(self, node: Node) -> GpuType:
        """The node's GPU type, with the node's own memory size where it declares one."""
        gpu = self.known_gpu_types()[node.gpu_type]
        if node.gpu_memory_gib is None:
            return gpu
        return gpu.model_copy(update={"memory_bytes": int(node.gpu_memory_gib * GIB)})

    @classmethod
    def from_file(cls, path: str | Path, gpu_types: dict[str, GpuType] | None = None) -> ClusterSpec:
        """A YAML or JSON cluster file (``gpu_types``: declarations of types it may use beyond
        the catalog's and its own); FrenzyError if it is missing or not a mapping."""
        try:
            data: Any = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError:
            raise FrenzyError(f"cluster file {path} does not exist") from None
        except yaml.YAMLError as exc:
            raise FrenzyError(f"cluster file {path} is not valid YAML/JSON: {exc}".replace("\n", " ")) from None
        if not isinstance(data, dict):
            raise FrenzyError(f"cluster file {path} must be a mapping with 'nodes' (and optional 'name', 'gpu_types')")
        data.setdefault("name", Path(path).stem)
        if gpu_types:
            data["gpu_types"] = {**gpu_types, **(data.get("gpu_types") or {})}
        return cls.model_validate(data)


class ClusterState(BaseModel):
    """The cluster plus the GPU indices free on each node right now."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cluster: ClusterSpec
    free_gpus: dict[str, list[int]]

    @classmethod
    def idle(cls, cluster: ClusterSpec) -> ClusterState:
        return cls(cluster=cluster, free_gpus={n.name: list(range(n.gpu_count)) for n in cluster.nodes})
