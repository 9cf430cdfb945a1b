"""Adaptive (beyond both papers): at every change, weigh re-routing on the original grid (ReCycle)
against re-forming the fastest grid the nodes allow (Oobleck's templates: pipelines of k and k+1
stages, at ``oobleck_reconfigure_s``), and take whichever completes more iterations before the
next expected change, net of its cost -- over this gap and the next, so the mode's cost per later
change counts too: re-routing pays ``detection_s`` and redoes the interrupted iteration (as the
runtime does), a re-formed grid re-forms again and loses it too (counted as half an iteration).

The expected gap is ``Knobs.expected_gap_s``, or learnt from the trace as it arrives: the time
since the job started over the changes seen so far (the maximum-likelihood mean gap of a Poisson
process), with no prior constant; before any change, only the steady-state speeds are compared.

Once some outage has ended (``recycle.outages``: a lost slot filled again), a failure is weighed
over the expected outage instead -- the time until the lost slot is back, learnt the same way:
each option's switch now, its speed for the outage, and the switch that takes the returning node
in (a state copy on the grid, a re-form from a re-formed grid). Short outages favour re-routing,
long ones re-forming. When nodes join a re-formed grid, keeping it as it is (Oobleck's choice) is
a third option. If a stage's state is lost, both options are restarts from the last checkpoint."""

from __future__ import annotations

import math
from typing import ClassVar

from frenzy_prefect.recycle.knobs import Knobs
from frenzy_prefect.recycle.outages import OutageHistory
from frenzy_prefect.recycle.policies.base import Decision, Layout, View, from_layout, grid_label, joined_only, reform
from frenzy_prefect.recycle.policies.recycle import on_grid


def expected_gap_s(view: View) -> float:
    """The knob, or the observed mean gap between changes since the start (inf: none yet)."""
    if view.knobs.expected_gap_s:
        return view.knobs.expected_gap_s
    changes = sum(t > view.start_s for t in view.slot_change_times)
    return (view.now - view.start_s) / changes if changes else math.inf


class Adaptive:
    name: ClassVar[str] = "adaptive"

    def __init__(self) -> None:
        self.layout: Layout | None = None  # None: on the original grid
        self.iteration_s: float | None = None
        self.outages = OutageHistory()

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
        return on_grid(view)

    def _score(self, decision: Decision | None, gap: float, on_grid: bool, knobs: Knobs, outage: float = math.inf) -> float:
        """Iterations the option completes. Over a failure's expected ``outage`` when one is known:
        the switch now, then the switch that takes the node back. Else over this gap and the next:
        the switch's cost now, then the mode's cost per change (re-routing pays detection, a
        re-formed grid re-forms again; both redo the interrupted iteration). Without either: the
        steady-state rate alone."""
        if decision is None or decision.iteration_s is None:
            return float("-inf")
        lost_in_flight = 0.0 if decision.keep_in_flight or self.iteration_s is None else self.iteration_s / 2
        if math.isfinite(outage):
            back = knobs.state_copy_s if on_grid else knobs.oobleck_reconfigure_s
            return max(0.0, outage - decision.pause_s - lost_in_flight - back) / decision.iteration_s
        if math.isinf(gap):
            return 1 / decision.iteration_s
        now = max(0.0, gap - decision.pause_s - lost_in_flight)
        per_change = knobs.detection_s if on_grid else knobs.oobleck_reconfigure_s
        later = max(0.0, gap - per_change - decision.iteration_s / 2)
        return (now + later) / decision.iteration_s

    def _stays(self, view: View, gap: float, grid: Decision | None, reformed: Decision) -> bool:
        """Nodes joined a re-formed grid: is keeping it (no pause, nothing lost) worth more than
        taking them in?"""
        assert self.layout is not None
        stay = Decision("reconfigure", self.layout.iteration_s, self.layout.label, keep_in_flight=True)
        score = self._score(stay, gap, False, view.knobs)
        return score >= self._score(reformed, gap, False, view.knobs) and score >= self._score(grid, gap, True, view.knobs)

    def react(self, view: View) -> Decision | None:
        self.outages.observe(view.now, view.changes)
        if not view.slot_changes:
            return None
        m, knobs = view.membership, view.knobs
        if self.layout is not None and not self.layout.uses(view.lost) and not any(c.kind == "filled" for c in view.slot_changes):
            return None
        state_lost = bool(m.lost_stages()) if self.layout is None else self.layout.layers_lost(view.lost)
        gap = expected_gap_s(view)
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
                pause_s=knobs.oobleck_reconfigure_s,
                rollback=False,
                note="re-formed: faster than re-routing over the expected gap or outage",
            )
        if self.layout is not None and joined_only(view) and self._stays(view, gap, grid, reformed):
            return None  # the new nodes wait for the next change, as Oobleck's do
        outage = self.outages.expected_s(view.now) if view.lost else math.inf
        if grid is not None and self._score(grid, gap, True, knobs, outage) >= self._score(reformed, gap, False, knobs, outage):
            chosen, self.layout = grid, None
        else:
            chosen, self.layout = reformed, layout
        self.iteration_s = chosen.iteration_s
        return chosen
