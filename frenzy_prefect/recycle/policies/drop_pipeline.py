"""Drop the pipeline: a failed worker's pipeline stops and data parallelism shrinks (the global
batch is kept, so the surviving pipelines accumulate more micro-batches). The interrupted
iteration is redone on the survivors (its global batch was split over the old pipelines, and the
dead pipeline's gradients never arrive). When returning nodes complete more pipelines than are
running, the job pauses ``drop_reform_s`` to re-form them, copying states from the survivors
(the interrupted iteration is redone). A stage that lost every replica forces a restart from the
last checkpoint."""

from __future__ import annotations

from typing import ClassVar

from frenzy_prefect.recycle.policies.base import Decision, View, grid_label, stalled


class DropPipeline:
    name: ClassVar[str] = "drop_pipeline"

    def __init__(self) -> None:
        self.running: set[int] = set()

    def react(self, view: View) -> Decision | None:
        if not view.slot_changes:
            return None
        m, model, knobs = view.membership, view.model, view.knobs
        complete = {p for p in range(model.dp) if m.pipeline_complete(p)}
        if view.first or m.lost_stages():
            self.running = complete
            if not complete:
                return stalled("no complete pipeline")
            return Decision(
                "checkpoint-restart",
                model.fault_free_s(len(complete), model.pp),
                grid_label(len(complete), model.pp),
                pause_s=knobs.restart_s,
                keep_in_flight=False,
                rollback=True,
                restore_state=True,
                note="a stage lost every replica",
            )
        hit = {c.slot // model.pp for c in view.changes if c.kind == "lost" and c.slot is not None} & self.running
        if len(complete) > len(self.running - hit):
            self.running = complete
            return Decision(
                "reconfigure",
                model.fault_free_s(len(complete), model.pp),
                grid_label(len(complete), model.pp),
                pause_s=knobs.drop_reform_s,
                keep_in_flight=False,
                restore_state=True,
                note=f"{len(complete)} complete pipelines re-formed",
            )
        if not hit:
            return None
        self.running -= hit
        if not self.running:
            return stalled("every pipeline lost a worker")
        return Decision(
            "drop-pipeline",
            model.fault_free_s(len(self.running), model.pp),
            grid_label(len(self.running), model.pp),
            pause_s=knobs.detection_s,
            keep_in_flight=False,
            note=f"dropped pipeline(s) {sorted(hit)}",
        )
