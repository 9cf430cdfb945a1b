"""Checkpoint-restart (torchrun's elastic agent): any change of the job's nodes restarts every
worker from the last checkpoint -- work since then and the interrupted iteration are lost, and the
restart costs ``restart_s`` -- on the fastest homogeneous grid the alive nodes allow."""

from __future__ import annotations

from typing import ClassVar

from frenzy_prefect.recycle.policies.base import Decision, View, from_layout, reform


class CheckpointRestart:
    name: ClassVar[str] = "checkpoint_restart"

    def react(self, view: View) -> Decision | None:
        if not view.slot_changes:
            return None
        return from_layout(
            "checkpoint-restart",
            reform(view, heterogeneous=False),
            pause_s=view.knobs.restart_s,
            rollback=True,
            note=f"membership changed: {len(view.lost)} lost, {len(view.slot_changes) - len(view.lost)} joined",
        )
