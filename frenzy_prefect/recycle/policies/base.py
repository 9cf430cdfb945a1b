"""The interface every resilience policy implements, what it decides, and the grid re-forming
every policy shares (so none gets a better re-partitioning than another)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal, Protocol

from frenzy_prefect.recycle.iteration import IterationModel
from frenzy_prefect.recycle.knobs import Knobs
from frenzy_prefect.recycle.membership import Change, Membership

Kind = Literal["start", "reroute", "rejoin", "reconfigure", "checkpoint-restart", "drop-pipeline", "failover", "stall"]


@dataclass(frozen=True)
class Decision:
    """What the job runs from now on. ``iteration_s`` None: nothing can run (stalled).

    The switch: the previous configuration keeps running ``delay_s`` (a joining node starting
    up), and then, with ``at_boundary``, until its iteration ends; then nobody trains for
    ``pause_s``; then this configuration runs. ``keep_in_flight`` (every policy states it): the
    iteration interrupted by the switch survives with its progress -- only true where the real
    system salvages it or the switch waits for a boundary -- else it is redone from its start.
    rollback: back to the last checkpoint; restore_state: every occupied slot holds its stage's
    state afterwards."""

    kind: Kind
    iteration_s: float | None
    grid: str
    pause_s: float = 0.0
    delay_s: float = 0.0
    keep_in_flight: bool = field(kw_only=True)
    at_boundary: bool = False
    rollback: bool = False
    restore_state: bool = False
    note: str = ""


@dataclass
class View:
    now: float
    membership: Membership
    model: IterationModel
    knobs: Knobs
    changes: list[Change]
    first: bool
    slot_change_times: list[float] = field(default_factory=list)
    start_s: float = 0.0  # when the replayed trace (and the job) started

    @property
    def lost(self) -> set[str]:
        return {c.node for c in self.changes if c.kind == "lost"}

    @property
    def slot_changes(self) -> list[Change]:
        return [c for c in self.changes if c.kind in ("lost", "filled")]


class Policy(Protocol):
    name: ClassVar[str]

    def react(self, view: View) -> Decision | None:
        """After the events of one instant (and at the start, with every initial node as a change):
        the new configuration, or None when nothing changes."""
        ...


def grid_label(dp: int, pp: int) -> str:
    return f"{dp}x{pp}"


@dataclass(frozen=True)
class Layout:
    """The pipelines a re-formed job runs: node names per pipeline, stage order."""

    pipelines: tuple[tuple[str, ...], ...]
    iteration_s: float

    @property
    def label(self) -> str:
        sizes = sorted({len(p) for p in self.pipelines})
        return f"{len(self.pipelines)}x{'/'.join(map(str, sizes))}"

    def layers_lost(self, lost: set[str]) -> bool:
        """Equal-length pipelines: some stage lost in every pipeline. Unequal (Oobleck templates
        split layers differently): lost unless some pipeline is intact -- layer coverage across
        different splits is not tracked, so this errs towards a restart."""
        if len({len(p) for p in self.pipelines}) == 1:
            stages = len(self.pipelines[0])
            return any(all(p[s] in lost for p in self.pipelines) for s in range(stages))
        return all(any(n in lost for n in p) for p in self.pipelines)

    def uses(self, nodes: set[str]) -> bool:
        return any(n in nodes for p in self.pipelines for n in p)


def occupied_nodes(membership: Membership) -> list[str]:
    return [h for h in membership.holders if h is not None]


def reform(view: View, *, heterogeneous: bool, nodes: list[str] | None = None) -> Layout | None:
    """The fastest grid the occupied slots allow: at most dp pipelines of min_stages..pp stages
    (layers re-partitioned), fewest-numbered slots first, timed by ``IterationModel.layout_s``.
    Heterogeneous (Oobleck's templates): pipelines of k and k+1 stages use every node. ``nodes``:
    the nodes to use (default every occupied slot's). None: too few nodes for one pipeline, or no
    layout the step times say can run."""
    model = view.model
    nodes = occupied_nodes(view.membership) if nodes is None else nodes
    floor = view.knobs.stages_floor(model.pp)
    best: Layout | None = None
    for pipelines in range(1, model.dp + 1):
        if heterogeneous:
            base, extra = divmod(len(nodes), pipelines)
            sizes = [base + 1] * extra + [base] * (pipelines - extra)
            if base < floor or max(sizes) > model.pp:
                continue
        else:
            stages = min(model.pp, len(nodes) // pipelines)
            if stages < floor:
                continue
            sizes = [stages] * pipelines
        iteration_s = model.layout_s(sizes)
        if iteration_s is None:
            continue
        split, start = [], 0
        for k in sizes:
            split.append(tuple(nodes[start : start + k]))
            start += k
        layout = Layout(tuple(split), iteration_s)
        if best is None or layout.iteration_s < best.iteration_s:
            best = layout
    return best


def stalled(note: str) -> Decision:
    return Decision("stall", None, "-", keep_in_flight=False, note=note)


def joined_only(view: View) -> bool:
    """Nodes came (started up: the replay delivers an addition ``join_delay_s`` late) and none left."""
    return not view.lost and any(c.kind == "filled" for c in view.slot_changes)


def from_layout(kind: Kind, layout: Layout | None, *, pause_s: float, rollback: bool, note: str) -> Decision:
    """Re-formed pipelines: the interrupted iteration is lost (the layers it ran on moved)."""
    if layout is None:
        return stalled(f"{note}; too few nodes for one pipeline (or none the step times can run)")
    return Decision(
        kind,
        layout.iteration_s,
        layout.label,
        pause_s=pause_s,
        keep_in_flight=False,
        rollback=rollback,
        restore_state=True,
        note=note,
    )
