"""Stage 2 of HAS: bin-pack a job's GPUs onto nodes of its GPU type."""

from __future__ import annotations

from frenzy_prefect.spec.cluster import Node
from frenzy_prefect.spec.plan import Placement


def place(gpus: int, free: list[tuple[Node, list[int]]], group: int = 1) -> list[Placement] | None:
    """A node whose free GPUs fit exactly; else the fitting node with the least free capacity;
    else a greedy split over the nodes with the most free GPUs. Each node's share is a multiple
    of ``group`` (a tensor-parallel group never spans nodes). None if the GPUs are not there."""
    usable = [(node, idx[: len(idx) // group * group]) for node, idx in free]
    usable = [(node, idx) for node, idx in usable if idx]
    exact = [(n, idx) for n, idx in usable if len(idx) == gpus]
    fitting = sorted(((n, idx) for n, idx in usable if len(idx) > gpus), key=lambda x: (len(x[1]), x[0].name))
    if exact or fitting:
        node, idx = (exact or fitting)[0]
        return [Placement(node=node.name, host=node.host, gpus=idx[:gpus])]
    placements, needed = [], gpus
    for node, idx in sorted(usable, key=lambda x: (-len(x[1]), x[0].name)):
        take = idx[:needed]
        placements.append(Placement(node=node.name, host=node.host, gpus=take))
        needed -= len(take)
        if needed == 0:
            return placements
    return None
