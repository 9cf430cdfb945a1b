"""What Prefect shows of a training run while its ranks train: events, a progress bar and the
loss table, from the notifications of rank 0's trainer (``training.trainer.train``'s ``notify``).

Every notification but the per-step one becomes an event ``frenzy.training.<what>`` about the
training flow run (its resource; label ``frenzy.run``: the train-llm run it belongs to), so that
automations and the UI's event feed see the run start, checkpoint, survive failures, complete or
fail. The steps update a progress artifact and the live loss table, at most every UPDATE_S (and at
the last step): one API call per step would slow fast steps down."""

from __future__ import annotations

import time
from uuid import UUID

from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.events import emit_event

from frenzy_prefect.spec.plan import TrainingJob

UPDATE_S = 2.0
TABLE_ROWS = 40  # the live table keeps this many steps, evenly spread, and the last


class TrainingReporter:
    """``notify(what, details)`` for the ranks of ``job``, run by flow run ``flow_run_id``."""

    def __init__(self, flow_run_id: UUID, job: TrainingJob) -> None:
        self.flow_run_id, self.job = flow_run_id, job
        self.progress: UUID | None = None
        self.losses: list[tuple[int, float]] = []
        self.updated = 0.0

    def __call__(self, what: str, details: dict) -> None:
        if what == "step":
            self._step(details)
            return
        emit_event(
            event=f"frenzy.training.{what}",
            resource={"prefect.resource.id": f"prefect.flow-run.{self.flow_run_id}", "frenzy.run": self.job.run},
            payload=details,
        )
        if what == "started" and self.progress is None:
            done = 100.0 * (details["step"] - 1) / details["steps"]
            self.progress = create_progress_artifact(done, key="training-progress", description="Optimizer steps done (%)")

    def _step(self, details: dict) -> None:
        self.losses.append((details["step"], details["loss"]))
        last = details["step"] == details["steps"]
        if time.monotonic() - self.updated < UPDATE_S and not last:
            return
        self.updated = time.monotonic()
        if self.progress is not None:
            update_progress_artifact(self.progress, 100.0 * details["step"] / details["steps"])
        stride = max(1, len(self.losses) // TABLE_ROWS)
        rows = [
            {"step": str(s), "loss": f"{loss:.4f}"} for i, (s, loss) in enumerate(self.losses) if i % stride == 0 or s == details["step"]
        ]
        create_table_artifact(rows, key="live-loss", description=f"Training loss so far (step {details['step']} of {details['steps']})")
