"""Which of a cluster's waiting runs start now: first come first served per GPU type, with
backfill by the allocator's predicted run times, as Slurm's backfill scheduler does.

A type's oldest waiting run that does not fit its free GPUs is the head of that type's line.
It gets a reservation: the earliest time enough of its GPUs free up, from the predicted ends of
the runs holding them (when they took their GPUs + the allocator's predicted time of all their
steps), and the GPUs it would get then. A younger run of the type may start now on free GPUs
only if it cannot delay that: it is predicted to end by the reservation, or it takes only GPUs
the reservation does not. Runs without a prediction never backfill, and a type whose busy GPUs
are held by a run without one (or by a run nobody knows) is served strictly first come first
served: with no reservation time, nothing can be shown not to delay the head.

Predictions are wrong. A backfilled run that overruns its predicted end is never stopped for
it: it keeps its GPUs, and the head waits longer than its reservation said. A holder past its
predicted end is taken to end now (its end is unknown, but no earlier), so nothing backfills on
the GPUs the head needs behind it. Only the head holds a reservation (EASY backfilling): a run
second in line may be passed by a backfilled one it would have followed, never the head.

A run pinned to its nodes (a node's check: `frenzy cluster check`) is placed on those only; while
they are busy it waits without heading its type's line, so a check never holds up a training run.
"""

from __future__ import annotations

import math
from itertools import groupby
from typing import NamedTuple

from frenzy_prefect.allocator.placement import place, place_by_type
from frenzy_prefect.spec.cluster import Node
from frenzy_prefect.spec.plan import Placement, TrainingJob

Gpu = tuple[str, int]  # (node, index)


class Want(NamedTuple):
    """A waiting run, as far as the queue decides on it."""

    gpu_type: str  # its line: one type, or the types of a plan across them (``A10+T4``)
    gpus: int
    group: int = 1  # its tensor-parallel width: a node's share is a multiple of it
    predicted_s: float | None = None  # the allocator's predicted time of all its steps
    across: tuple[tuple[str, int], ...] = ()  # a plan across types: GPUs of each, in rank order
    nodes: tuple[str, ...] = ()  # pinned to these nodes (a node's check); empty: any node of its type

    @classmethod
    def of(cls, job: TrainingJob) -> Want:
        a = job.allocation
        pinned = tuple(p.node for p in a.placements) if job.pinned else ()
        return cls(a.gpu_type, a.plan.gpus, a.plan.tp, a.total_time_s, tuple(a.plan.gpus_by_type().items()), pinned)

    def usable(self, nodes: list[Node]) -> list[Node]:
        """The nodes it may be placed on."""
        return [n for n in nodes if n.name in self.nodes] if self.nodes else nodes

    @property
    def parts(self) -> tuple[tuple[str, int], ...]:
        """GPUs of each type it needs."""
        return self.across or ((self.gpu_type, self.gpus),)


class Holder(NamedTuple):
    """GPUs a run holds, and when it is predicted to let them go (None: no prediction)."""

    gpus: frozenset[Gpu]
    ends_at: float | None


class Reservation(NamedTuple):
    """When a blocked head is predicted to start, and on which GPUs."""

    at: float
    gpus: frozenset[Gpu]


class Start(NamedTuple):
    placements: list[Placement]
    ends_at: float | None  # predicted
    passed: Reservation | None = None  # the head's reservation, when this run went ahead of it


class Wait(NamedTuple):
    position: int  # in its type's line: 1 is the head
    free: int  # GPUs of its type free at its turn
    reservation: Reservation | None  # the head's (None: no backfill behind it)


def decide(
    line: list[Want], nodes: list[Node], free: dict[str, list[int]], holders: list[Holder], now: float, backfill: bool = True
) -> list[Start | Wait]:
    """One decision per run of ``line`` (a cluster's waiting runs, oldest first), given the
    cluster's ``nodes``, its ``free`` GPUs per node and the ``holders`` of the others, at
    ``now`` (seconds, the clock of ``Holder.ends_at``). Without ``backfill``: strict first
    come first served per type. A run across types waits behind the heads of each of its types,
    and while it waits it is the head of each that had none, without a reservation (no backfill
    on them until it starts: a run across types is never passed)."""
    free = {node.name: list(free.get(node.name, [])) for node in nodes}
    holders = list(holders)
    heads: dict[str, Wait] = {}  # GPU type -> its blocked head
    waiting: dict[str, int] = {}
    out: list[Start | Wait] = []
    for want in line:
        ahead = [heads[t] for t, _ in want.parts if t in heads]
        ends_at = None if want.predicted_s is None else now + want.predicted_s
        if not ahead:
            placements = _place(want, nodes, free)
        elif ends_at is None or any(h.reservation is None for h in ahead):
            placements = None
        else:
            claimed = [h.reservation.gpus for h in ahead if h.reservation and ends_at > h.reservation.at]
            placements = _place(want, nodes, free, avoiding=frozenset().union(*claimed))
        if placements:
            for p in placements:
                free[p.node] = [i for i in free[p.node] if i not in p.gpus]
            holders.append(Holder(_gpus(placements), ends_at))
            out.append(Start(placements, ends_at, ahead[0].reservation if ahead else None))
            continue
        n_free = sum(len(free[n.name]) for n in want.usable(nodes) if n.gpu_type in dict(want.parts))
        if want.nodes:  # pinned to a node that is busy: it waits for that node, outside its type's line
            out.append(Wait(1, n_free, None))
            continue
        waiting[want.gpu_type] = waiting.get(want.gpu_type, 0) + 1
        if not ahead:
            reservation = reserve(want, nodes, free, holders, now) if backfill and not want.across else None
            out.append(head := Wait(1, n_free, reservation))
            for t, _ in want.parts:
                heads[t] = head
        else:
            out.append(Wait(waiting[want.gpu_type], n_free, None if want.across else ahead[0].reservation))
            for t, _ in want.parts:  # a run across types blocks each of its types that had no head
                heads.setdefault(t, Wait(1, n_free, None))
    return out


def reserve(want: Want, nodes: list[Node], free: dict[str, list[int]], holders: list[Holder], now: float) -> Reservation | None:
    """The earliest predicted time ``want`` fits its type's GPUs, and the GPUs it gets then;
    None if a busy GPU of the type has no predicted release (or it never fits)."""
    of_type = [n for n in want.usable(nodes) if n.gpu_type == want.gpu_type]
    busy = {(n.name, i) for n in of_type for i in range(n.gpu_count) if i not in free.get(n.name, [])}
    release: dict[Gpu, float] = {}
    for holder in holders:
        for gpu in holder.gpus & busy:
            if holder.ends_at is None:
                return None
            release[gpu] = min(release.get(gpu, math.inf), max(holder.ends_at, now))  # two claims (a hand-over): the earlier
    if busy - release.keys():
        return None
    available = {n.name: set(free.get(n.name, [])) for n in of_type}
    for at, freed in groupby(sorted(release.items(), key=lambda item: (item[1], item[0])), key=lambda item: item[1]):
        for (node, index), _ in freed:
            available[node].add(index)
        placements = place(want.gpus, [(n, sorted(available[n.name])) for n in of_type], group=want.group)
        if placements:
            return Reservation(at, _gpus(placements))
    return None


def _place(want: Want, nodes: list[Node], free: dict[str, list[int]], avoiding: frozenset[Gpu] = frozenset()) -> list[Placement] | None:
    usable = {name: [i for i in idx if (name, i) not in avoiding] for name, idx in free.items()} if avoiding else free
    return place_by_type(want.parts, want.usable(nodes), usable, group=want.group)


def _gpus(placements: list[Placement]) -> frozenset[Gpu]:
    return frozenset((p.node, i) for p in placements for i in p.gpus)
