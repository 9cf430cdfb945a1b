"""Oobleck (SOSP'23): on every change of the nodes, re-instantiate pipelines from precomputed
templates for the surviving node count -- pipelines of k and k+1 stages that use every node --
at a pause of ``reconfigure_s`` (the in-flight iteration is redone). States come from surviving
replicas; if some layer lost every replica (see ``Layout.layers_lost``), it restarts from the
last checkpoint instead."""

from __future__ import annotations

from typing import ClassVar

from frenzy_prefect.recycle.policies.base import Decision, Layout, View, from_layout, reform


class Oobleck:
    name: ClassVar[str] = "oobleck"

    def __init__(self) -> None:
        self.layout: Layout | None = None

    def react(self, view: View) -> Decision | None:
        if not view.slot_changes:
            return None
        if self.layout is not None and self.layout.layers_lost(view.lost):
            self.layout = reform(view, heterogeneous=True)
            return from_layout(
                "checkpoint-restart", self.layout, pause_s=view.knobs.restart_s, rollback=True, note="a layer lost every replica"
            )
        self.layout = reform(view, heterogeneous=True)
        return from_layout(
            "reconfigure", self.layout, pause_s=view.knobs.reconfigure_s, rollback=False, note="pipelines re-instantiated from templates"
        )
