"""Which node holds which worker slot of the dp x pp grid, and which workers hold their stage's state.

Slots are numbered pipeline-major: slot = pipeline * pp + stage. A node's *home* slot comes from
a mapping file, or by default node k -> pipeline (k-1) // pp, stage (k-1) % pp. Nodes without a
home slot (k > dp * pp, or not in the mapping file) are *outside the grid*: they are counted, and
while ``fill_vacancies`` is on (the default) they wait as spares and take the lowest vacant slot
when one frees up -- what a spot-instance autoscaling group does: a preempted instance is
replaced by a new one with a new name (the shared spot traces never reuse a name). With
``fill_vacancies`` off they never join the job. A node whose home slot is taken when it arrives
also fills a vacancy, or waits.

Mapping file format: one ``nodeN,pipeline,stage`` line per pinned node (0-based pipeline and
stage; ``#`` comments and blank lines skipped); each slot and node at most once.

State: a worker holds its stage's parameters if it held them from the start, copied them from a
live peer of its stage when it took the slot, or loaded them at a restart. A stage with no live
stateful worker has lost every replica: only a checkpoint has its parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.recycle.traces import NODE, NodeEvent, read_fields


@dataclass(frozen=True)
class Change:
    """What one trace event did to the grid: a slot lost or filled, or a spare came or went."""

    kind: Literal["lost", "filled", "spare-added", "spare-lost"]
    node: str
    slot: int | None = None


def load_mapping(path: Path, dp: int, pp: int) -> dict[str, int]:
    """Node name -> slot, from a ``nodeN,pipeline,stage`` file."""
    homes: dict[str, int] = {}
    owner: dict[int, str] = {}
    for where, fields in read_fields(path, "mapping file", "nodeN,pipeline,stage"):
        node, pipeline, stage = fields
        if not NODE.fullmatch(node):
            raise FrenzyError(f"{where}: field 1 (node): {node!r} is not a node name like node7")
        for name, text, bound in (("pipeline", pipeline, dp), ("stage", stage, pp)):
            if not text.isdigit() or int(text) >= bound:
                raise FrenzyError(f"{where}: field {name}: {text!r} is not a whole number in 0..{bound - 1}")
        slot = int(pipeline) * pp + int(stage)
        if node in homes:
            raise FrenzyError(f"{where}: {node} is mapped twice")
        if slot in owner:
            raise FrenzyError(f"{where}: pipeline {pipeline} stage {stage} is already mapped to {owner[slot]}")
        homes[node], owner[slot] = slot, node
    return homes


@dataclass
class Membership:
    dp: int
    pp: int
    homes: dict[str, int] | None = None  # None: pipeline-major by node number
    fill_vacancies: bool = True
    holders: list[str | None] = field(init=False)
    stateful: list[bool] = field(init=False)
    spares: list[str] = field(default_factory=list)
    outside_grid: set[str] = field(default_factory=set)
    spare_fills: int = 0

    def __post_init__(self) -> None:
        self.holders = [None] * (self.dp * self.pp)
        self.stateful = [False] * (self.dp * self.pp)

    def home(self, node: str) -> int | None:
        if self.homes is not None:
            return self.homes.get(node)
        k = int(node[4:])
        return k - 1 if k <= self.dp * self.pp else None

    def apply(self, event: NodeEvent, started: bool) -> list[Change]:
        """Apply one event; before the job starts every filled slot counts as stateful (fresh start)."""
        if event.kind == "add":
            home = self.home(event.node)
            if home is None:
                self.outside_grid.add(event.node)
            if home is not None and self.holders[home] is None:
                return [self._fill(home, event.node, started)]
            vacant = self._vacant()
            if vacant is not None and self.fill_vacancies:
                self.spare_fills += 1
                return [self._fill(vacant, event.node, started)]
            self.spares.append(event.node)
            return [Change("spare-added", event.node)]
        if event.node in self.spares:
            self.spares.remove(event.node)
            return [Change("spare-lost", event.node)]
        slot = self.holders.index(event.node)
        self.holders[slot], self.stateful[slot] = None, False
        changes = [Change("lost", event.node, slot)]
        if self.spares and self.fill_vacancies:
            self.spare_fills += 1
            changes.append(self._fill(slot, self.spares.pop(0), started))
        return changes

    def _vacant(self) -> int | None:
        return next((i for i, h in enumerate(self.holders) if h is None), None)

    def _fill(self, slot: int, node: str, started: bool) -> Change:
        stage = slot % self.pp
        peer = any(self.stateful[p * self.pp + stage] for p in range(self.dp))
        self.holders[slot], self.stateful[slot] = node, peer or not started
        return Change("filled", node, slot)

    def restore_state(self) -> None:
        """Every occupied slot holds its stage's state again (after a checkpoint load or re-form)."""
        self.stateful = [h is not None for h in self.holders]

    @property
    def occupied(self) -> int:
        return sum(h is not None for h in self.holders)

    def live_per_stage(self) -> list[int]:
        """Occupied slots per stage."""
        return [sum(self.holders[p * self.pp + s] is not None for p in range(self.dp)) for s in range(self.pp)]

    def lost_stages(self) -> list[int]:
        """Stages with no live worker holding their state."""
        return [s for s in range(self.pp) if not any(self.stateful[p * self.pp + s] for p in range(self.dp))]

    def failures_per_stage(self) -> tuple[int, ...]:
        return tuple(self.dp - n for n in self.live_per_stage())

    def pipeline_complete(self, pipeline: int) -> bool:
        return all(self.holders[pipeline * self.pp + s] is not None for s in range(self.pp))

    def dead_stages(self, pipeline: int) -> list[int]:
        return [s for s in range(self.pp) if self.holders[pipeline * self.pp + s] is None]
