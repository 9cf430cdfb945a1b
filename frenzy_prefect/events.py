"""The plugin's Prefect events, ``frenzy.training.<what>``, each about a training flow run (its
resource) and naming the train-llm run it belongs to: automations and the UI's event feed see a
run's failures survived and rejoins as they happen."""

from __future__ import annotations

from collections.abc import Callable
from uuid import UUID

from prefect.events import emit_event

from frenzy_prefect.spec.plan import TrainingJob


def training_events(flow_run_id: UUID, job: TrainingJob) -> Callable[[str, dict], None]:
    """``notify(what, details)`` for the ranks of ``job``, run by flow run ``flow_run_id``."""

    def notify(what: str, details: dict) -> None:
        emit_event(
            event=f"frenzy.training.{what}",
            resource={"prefect.resource.id": f"prefect.flow-run.{flow_run_id}", "frenzy.run": job.run},
            payload=details,
        )

    return notify
