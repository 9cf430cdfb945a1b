"""ReCycle: a failed worker's micro-batches go to its stage's live peers in other pipelines
(iteration time from ``IterationModel.rerouted_s``, the planner's plans once wired).

The interrupted iteration, as the live runtime does it: on a death the survivors detect it,
re-form their process groups in-process and look up the adapted schedule (``detection_s``), then
REDO the interrupted iteration from its start -- no micro-batch of it is salvaged, and no
optimizer step of it was taken, as every iteration ends at a commit point before any stage
steps. A replacement node starts up (``join_delay_s``, as for every policy) while the others keep
training; at the next iteration boundary the job pauses while a live peer of its stage sends it weights and
optimizer state (``state_copy_s``), then the fault-free schedule resumes: nothing is lost.

When a stage loses every replica re-routing cannot help: restart from the last checkpoint. After
the restart every occupied slot loads its stage, so if every stage still has a worker the job
stays on the original grid and re-routes around the vacant slots; otherwise it re-forms the
fastest homogeneous grid the nodes allow (layers re-partitioned over fewer stages or pipelines)
and returns to the original grid, at a reconfiguration's cost, once every stage has a worker again.
"""

from __future__ import annotations

from typing import ClassVar

from frenzy_prefect.recycle.policies.base import Decision, Layout, View, from_layout, grid_label, reform


def on_grid(view: View) -> Decision:
    """Re-route on the original grid after a death (redo the interrupted iteration), or take a
    started replacement in at an iteration boundary (nothing lost)."""
    m, knobs = view.membership, view.knobs
    f = m.failures_per_stage()
    iteration_s = view.model.rerouted_s(f)
    grid, note = grid_label(view.model.dp, view.model.pp), f"failures per stage {f}"
    if view.lost:
        return Decision("reroute", iteration_s, grid, pause_s=knobs.detection_s, keep_in_flight=False, note=note)
    return Decision("rejoin", iteration_s, grid, pause_s=knobs.state_copy_s, keep_in_flight=True, at_boundary=True, note=note)


class ReCycle:
    name: ClassVar[str] = "recycle"

    def __init__(self) -> None:
        self.layout: Layout | None = None  # None: on the original grid

    def react(self, view: View) -> Decision | None:
        if not view.slot_changes:
            return None
        m, knobs = view.membership, view.knobs
        grid = grid_label(view.model.dp, view.model.pp)
        if self.layout is not None:
            if not self.layout.uses(view.lost) and not [c for c in view.slot_changes if c.kind == "filled"]:
                return None
            if self.layout.layers_lost(view.lost):
                return self._restart(view, "a stage of the re-formed grid lost every replica")
            if min(m.live_per_stage()) > 0:
                self.layout = None
                f = m.failures_per_stage()
                return Decision(
                    "reconfigure",
                    view.model.rerouted_s(f),
                    grid,
                    pause_s=knobs.reconfigure_s,
                    keep_in_flight=False,
                    restore_state=True,
                    note=f"back to the original grid, failures per stage {f}",
                )
            self.layout = reform(view, heterogeneous=False)
            return from_layout(
                "reconfigure", self.layout, pause_s=knobs.reconfigure_s, rollback=False, note="re-formed grid follows the nodes"
            )
        lost = m.lost_stages()
        if lost:
            return self._restart(view, f"stage(s) {lost} lost every replica")
        return on_grid(view)

    def _restart(self, view: View, why: str) -> Decision:
        m = view.membership
        if min(m.live_per_stage()) > 0:
            self.layout = None
            f = m.failures_per_stage()
            return Decision(
                "checkpoint-restart",
                view.model.rerouted_s(f),
                grid_label(view.model.dp, view.model.pp),
                pause_s=view.knobs.restart_s,
                keep_in_flight=False,
                rollback=True,
                restore_state=True,
                note=f"{why}; original grid, failures per stage {f}",
            )
        self.layout = reform(view, heterogeneous=False)
        return from_layout("checkpoint-restart", self.layout, pause_s=view.knobs.restart_s, rollback=True, note=f"{why}; re-formed grid")
