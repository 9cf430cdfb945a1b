"""Adaptive (beyond both papers): at every change, weigh re-routing on the original grid (ReCycle)
against re-forming the fastest grid the nodes allow (Oobleck's templates: pipelines of k and k+1
stages), and take whichever completes more samples before the next expected change, net of its
cost: pause, plus the in-flight iteration (counted as half an iteration) for a re-form -- over
this gap and the next, so the mode's cost per later change counts too (re-routing pays the
detection delay, a re-formed grid re-forms again). The expected gap is ``Knobs.expected_gap_s``
or the mean gap between changes seen so far.
If a stage's state is lost, both options are restarts from the last checkpoint."""

from __future__ import annotations

from typing import ClassVar

from frenzy_prefect.recycle.knobs import Knobs
from frenzy_prefect.recycle.policies.base import Decision, Layout, View, from_layout, grid_label, reform

PRIOR_GAP_S = 3600.0


class Adaptive:
    name: ClassVar[str] = "adaptive"

    def __init__(self) -> None:
        self.layout: Layout | None = None  # None: on the original grid
        self.iteration_s: float | None = None

    def _gap(self, view: View) -> float:
        if view.knobs.expected_gap_s:
            return view.knobs.expected_gap_s
        times = view.slot_change_times
        return (PRIOR_GAP_S + (times[-1] - times[0] if times else 0.0)) / max(1, len(times))

    def _on_grid(self, view: View, state_lost: bool) -> Decision | None:
        m, knobs = view.membership, view.knobs
        if min(m.live_per_stage()) == 0:
            return None
        f = m.failures_per_stage()
        iteration_s = view.model.rerouted_s(f)
        grid, note = grid_label(view.model.dp, view.model.pp), f"failures per stage {f}"
        if state_lost:
            return Decision(
                "checkpoint-restart",
                iteration_s,
                grid,
                pause_s=knobs.restart_s,
                keep_in_flight=False,
                rollback=True,
                restore_state=True,
                note=note,
            )
        if self.layout is not None:
            return Decision(
                "reconfigure",
                iteration_s,
                grid,
                pause_s=knobs.reconfigure_s,
                keep_in_flight=False,
                restore_state=True,
                note="back to the original grid, " + note,
            )
        if view.lost:
            return Decision("reroute", iteration_s, grid, pause_s=knobs.detection_s, note=note)
        return Decision("rejoin", iteration_s, grid, delay_s=knobs.state_copy_s, note=note)

    def _score(self, decision: Decision | None, gap: float, on_grid: bool, knobs: Knobs) -> float:
        """Iterations over this gap and the next: the switch's cost now, then the mode's cost per
        change (re-routing pays detection; a re-formed grid re-forms again)."""
        if decision is None or decision.iteration_s is None:
            return float("-inf")
        lost_in_flight = 0.0 if decision.keep_in_flight or self.iteration_s is None else self.iteration_s / 2
        now = max(0.0, gap - decision.pause_s - lost_in_flight)
        later = max(0.0, gap - (knobs.detection_s if on_grid else knobs.reconfigure_s + decision.iteration_s / 2))
        return (now + later) / decision.iteration_s

    def react(self, view: View) -> Decision | None:
        if not view.slot_changes:
            return None
        m, knobs = view.membership, view.knobs
        if self.layout is not None and not self.layout.uses(view.lost) and not any(c.kind == "filled" for c in view.slot_changes):
            return None
        state_lost = bool(m.lost_stages()) if self.layout is None else self.layout.layers_lost(view.lost)
        gap = self._gap(view)
        grid = self._on_grid(view, state_lost)
        layout = reform(view, heterogeneous=True)
        if state_lost:
            reformed = from_layout(
                "checkpoint-restart", layout, pause_s=knobs.restart_s, rollback=True, note="a stage lost every replica; re-formed"
            )
        else:
            reformed = from_layout(
                "reconfigure",
                layout,
                pause_s=knobs.reconfigure_s,
                rollback=False,
                note="re-formed: faster than re-routing over the expected gap",
            )
        if grid is not None and self._score(grid, gap, True, knobs) >= self._score(reformed, gap, False, knobs):
            chosen, self.layout = grid, None
        else:
            chosen, self.layout = reformed, layout
        self.iteration_s = chosen.iteration_s
        return chosen
