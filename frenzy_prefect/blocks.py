"""Prefect blocks: the cluster inventory that flows and the worker read."""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar

from prefect.blocks.core import Block
from pydantic import Field

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.spec.cluster import ClusterSpec, Node

# The `frenzy` worker sets this in a run's environment from its pool's `cluster` variable: the
# FrenzyCluster block train-llm allocates on when the run does not name one.
CLUSTER_ENV = "FRENZY_CLUSTER"


class FrenzyCluster(Block):
    """The nodes of a GPU cluster (name, host, GPU type, count, memory), for the Frenzy allocator."""

    _block_type_name: ClassVar[str] = "Frenzy Cluster"
    _block_type_slug: ClassVar[str] = "frenzy-cluster"
    _description: ClassVar[str] = "A GPU cluster inventory for frenzy-prefect: nodes with their host, GPU type, GPU count and memory."

    cluster: ClusterSpec = Field(description="Nodes, extra GPU types and the network between nodes.")

    @classmethod
    def from_file(cls, path: str | Path) -> FrenzyCluster:
        return cls(cluster=ClusterSpec.from_file(path))


def load_cluster(block_name: str) -> FrenzyCluster:
    """The FrenzyCluster block ``block_name``, or one line saying how to create it."""
    try:
        return FrenzyCluster.load(block_name)
    except ValueError:
        raise FrenzyError(
            f"no FrenzyCluster block named {block_name!r}; create one with `frenzy cluster save FILE --name {block_name}`"
        ) from None


def save_node(block_name: str, node: Node) -> ClusterSpec:
    """Add ``node`` to the FrenzyCluster block ``block_name``, or replace the node of that name
    (creating the block if there is none); the cluster as saved."""
    try:
        spec = FrenzyCluster.load(block_name).cluster
        nodes = [n for n in spec.nodes if n.name != node.name] + [node]
        spec = ClusterSpec.model_validate({**spec.model_dump(), "nodes": [n.model_dump() for n in nodes]})
    except ValueError:  # no such block yet
        spec = ClusterSpec(name=block_name, nodes=[node])
    FrenzyCluster(cluster=spec).save(block_name, overwrite=True)
    return spec


def cluster_block_name(parameter: str | None) -> str:
    """The FrenzyCluster block a run allocates on: its ``cluster`` parameter, else the pool's
    ``cluster`` variable (CLUSTER_ENV)."""
    name = parameter or os.environ.get(CLUSTER_ENV)
    if not name:
        raise FrenzyError(
            "no cluster block named: pass train-llm's `cluster` parameter (a FrenzyCluster block) "
            "or set the `cluster` variable of the frenzy work pool the run is on"
        )
    return name
