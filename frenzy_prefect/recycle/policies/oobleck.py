"""Oobleck (SOSP'23), as its artifact simulator models it (SymbioticLab/Oobleck, branch
sosp23-artifact, tools/simulator/oobleck_simulator.py): every node loss stops training and
re-instantiates pipelines from precomputed templates for the surviving nodes -- pipelines of k and
k+1 stages that use every node -- at a pause of ``oobleck_reconfigure_s``; the interrupted
iteration is lost (its step-complete event is dropped when the rendezvous version changes,
lines 1176-1179). States come from surviving replicas; if some layer lost every replica (see
``Layout.layers_lost``), it restarts from the last checkpoint instead.

Added nodes (usable ``join_delay_s`` after they arrive, like every policy's): while the job runs they
wait to be taken in at the next reconfiguration (the artifact never reconfigures for an
addition: ready nodes only wait, lines 1098-1099, and should_reconfigure returns False, lines
1151-1152); a job stalled for lack of nodes restarts from them once they are up."""

from __future__ import annotations

from typing import ClassVar

from frenzy_prefect.recycle.policies.base import Decision, Layout, View, from_layout, joined_only, reform


class Oobleck:
    name: ClassVar[str] = "oobleck"

    def __init__(self) -> None:
        self.layout: Layout | None = None

    def react(self, view: View) -> Decision | None:
        if not view.slot_changes:
            return None
        knobs = view.knobs
        if joined_only(view) and self.layout is not None and not view.first:
            return None  # the new nodes wait for the next reconfiguration
        if self.layout is not None and self.layout.layers_lost(view.lost):
            self.layout = reform(view, heterogeneous=True)
            return from_layout("checkpoint-restart", self.layout, pause_s=knobs.restart_s, rollback=True, note="a layer lost every replica")
        self.layout = reform(view, heterogeneous=True)
        return from_layout(
            "reconfigure",
            self.layout,
            pause_s=knobs.oobleck_reconfigure_s,
            rollback=False,
            note="pipelines re-instantiated from templates",
        )
