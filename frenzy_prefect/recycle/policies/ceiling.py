"""The ceiling no policy reaches, for reading the others against (not a policy a job could run):
after every change, every occupied slot's node trains in the fastest configuration any policy
could run on them -- re-formed pipelines of k and k+1 stages, or of equal stages, or the original
grid re-routed -- and switching costs nothing, loses nothing and never rolls back.

Every policy reads its iteration times from the same ``IterationModel`` and pays for its switches,
so on a trace none completes more than this (Bamboo's redundancy is slower still). A target of
beating a policy by x% is out of reach on a trace where the ceiling is less than x% above it."""

from __future__ import annotations

from typing import ClassVar

from frenzy_prefect.recycle.policies.base import Decision, Layout, View, grid_label, reform, stalled


class Ceiling:
    name: ClassVar[str] = "ceiling"

    def react(self, view: View) -> Decision | None:
        if not view.slot_changes:
            return None
        options = [(layout.iteration_s, layout.label) for layout in self._layouts(view)]
        m = view.membership
        if min(m.live_per_stage()) > 0:
            rerouted = view.model.rerouted_s(m.failures_per_stage())
            if rerouted is not None:
                options.append((rerouted, grid_label(view.model.dp, view.model.pp)))
        if not options:
            return stalled("too few nodes for one pipeline (or none the step times can run)")
        iteration_s, label = min(options)
        return Decision("reconfigure", iteration_s, label, keep_in_flight=True, restore_state=True, note="free switch")

    @staticmethod
    def _layouts(view: View) -> list[Layout]:
        return [layout for heterogeneous in (True, False) if (layout := reform(view, heterogeneous=heterogeneous)) is not None]
