"""What Prefect shows of a training run while its ranks train: events, a progress bar and the
loss table, from the notifications of rank 0's trainer (``training.trainer.train``'s ``notify``).

Every notification but the per-step one becomes an event ``frenzy.training.<what>`` about the
training flow run (its resource; label ``frenzy.run``: the train-llm run it belongs to; label
``frenzy.generation``: the generation of the run's attempts that sent it, training.fence), so
that automations and the UI's event feed see the run start, checkpoint, survive failures,
complete or fail. An event that follows a decision of the storage (a claim, a commit) occurred
when that decision was asked for: an older generation's commit, accepted before a newer one's
claim, occurred before that claim. The steps update a progress artifact and the live loss table, at most every UPDATE_S (and at
the last step), from a thread of their own: the training never waits for the API, and an API
that is down (a server restarting) costs it nothing but late pictures."""

from __future__ import annotations

import contextvars
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from uuid import UUID

from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.events import emit_event
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

from frenzy_prefect.spec.plan import TrainingJob

UPDATE_S = 2.0
FAILING_CLOSE_S = 2.0
TABLE_ROWS = 40  # the live table keeps this many steps, evenly spread, and the last


class TrainingReporter:
    """``notify(what, details)`` for the ranks of ``job``, run by flow run ``flow_run_id``;
    ``close()`` publishes what is still queued."""

    def __init__(self, flow_run_id: UUID, job: TrainingJob) -> None:
        self.flow_run_id, self.job = flow_run_id, job
        self.generation = 1  # of the run's attempts (training.fence): the last one its events named
        self.progress: UUID | None = None
        self.losses: list[tuple[int, float]] = []
        self.updated = 0.0
        self.queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        context = contextvars.copy_context()  # the flow run's: the artifacts belong to it
        self.publisher = threading.Thread(target=self._publish, args=(context,), name="frenzy-progress", daemon=True)
        self.publisher.start()

    def __call__(self, what: str, details: dict) -> None:
        if what == "step":
            self._step(details)
            return
        details = dict(details)
        decided = details.pop("decided_at", None)  # the storage decision the event follows (training.fence)
        occurred = datetime.fromisoformat(decided) if decided else None
        self.generation = details.pop("generation", self.generation)
        resource = {"prefect.resource.id": f"prefect.flow-run.{self.flow_run_id}", "frenzy.run": self.job.run}
        emit_event(
            event=f"frenzy.training.{what}",
            resource=resource | {"frenzy.generation": str(self.generation)},
            occurred=occurred,
            payload=details,
        )
        if what == "started":
            done = 100.0 * (details["step"] - 1) / details["steps"]
            self.queue.put(lambda: self._start_progress(done))

    def close(self, timeout_s: float = 30.0) -> None:
        """Publish what is queued, waiting up to ``timeout_s``; FAILING_CLOSE_S when called
        while an exception propagates (the run is failing: its report comes first, its last
        pictures are worth no more of the ranks' time)."""
        self.queue.put(None)
        failing = sys.exc_info()[0] is not None
        self.publisher.join(min(timeout_s, FAILING_CLOSE_S) if failing else timeout_s)

    def _start_progress(self, done: float) -> None:
        if self.progress is None:
            self.progress = create_progress_artifact(done, key="training-progress", description="Optimizer steps done (%)")

    def _step(self, details: dict) -> None:
        self.losses.append((details["step"], details["loss"]))
        last = details["step"] == details["steps"]
        if time.monotonic() - self.updated < UPDATE_S and not last:
            return
        self.updated = time.monotonic()
        stride = max(1, len(self.losses) // TABLE_ROWS)
        kept = [(s, loss) for i, (s, loss) in enumerate(self.losses) if i % stride == 0 or s == details["step"]]
        rows = [{"step": str(s), "loss": f"{loss:.4f}"} for s, loss in kept]
        self.queue.put(lambda: self._publish_step(details["step"], details["steps"], rows))

    def _publish_step(self, step: int, steps: int, rows: list[dict[str, str]]) -> None:
        if self.progress is not None:
            update_progress_artifact(self.progress, 100.0 * step / steps)
        create_table_artifact(rows, key="live-loss", description=f"Training loss so far (step {step} of {steps})")

    def _publish(self, context: contextvars.Context) -> None:
        context.run(self._publish_queued)

    def _publish_queued(self) -> None:
        # Each call tried once: a picture the server missed is replaced by the next, and retries
        # of a server that is away would hold the publisher, and a closing run, for a minute.
        with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 0}):
            while (action := self.queue.get()) is not None:
                try:
                    action()
                except Exception as exc:  # the UI's pictures are best effort; the training goes on
                    logging.getLogger("frenzy_prefect.flows.reporting").warning(f"could not update the run's progress artifacts: {exc}")
