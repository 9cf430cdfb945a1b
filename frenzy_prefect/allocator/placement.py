"""Stage 2 of HAS: bin-pack a job's GPUs onto nodes of its GPU type (of each, for a plan across types)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from frenzy_prefect.spec.cluster import Node
from frenzy_prefect.spec.plan import Placement


def place(gpus: int, free: list[tuple[Node, list[int]]], group: int = 1) -> list[Placement] | None:
    """A node whose free GPUs fit exactly; else the fitting node with the least free capacity;
    else a greedy split over the nodes with the most free GPUs. Each node's share is a multiple
    of ``group`` (a tensor-parallel group never spans nodes). None if the GPUs are not there."""
    if group > 1:
        free = [(node, idx[: len(idx) // group * group]) for node, idx in free]
    # One pass without sorting for the common cases: this runs for every plan HAS tries. Each
    # Placement is validated: pydantic 2.14 validates one faster than model_construct builds it
    # (2.3 against 3.5 us), and a job of thousands of GPUs has hundreds.
    tightest: tuple[Node, list[int]] | None = None
    for node, idx in free:
        n = len(idx)
        if n == gpus:
            return [Placement(node=node.name, host=node.host, gpus=idx)]
        if n > gpus and (tightest is None or (n, node.name) < (len(tightest[1]), tightest[0].name)):
            tightest = (node, idx)
    if tightest:
        node, idx = tightest
        return [Placement(node=node.name, host=node.host, gpus=idx[:gpus])]
    placements, needed = [], gpus
    for node, idx in sorted(((n, idx) for n, idx in free if idx), key=lambda x: (-len(x[1]), x[0].name)):
        take = idx[:needed]
        placements.append(Placement(node=node.name, host=node.host, gpus=take))
        needed -= len(take)
        if needed == 0:
            return placements
    return None


def place_by_type(
    parts: Iterable[tuple[str, int]], nodes: list[Node], free: Mapping[str, list[int]], group: int = 1
) -> list[Placement] | None:
    """``place`` for each (GPU type, GPUs) of ``parts`` on that type's nodes, in order (a plan
    across types: rank order), all or nothing; ``free``: each node's free GPU indices."""
    placements: list[Placement] = []
    for gpu_type, gpus in parts:
        part = place(gpus, [(n, free.get(n.name, [])) for n in nodes if n.gpu_type == gpu_type], group=group)
        if part is None:
            return None
        placements += part
    return placements
