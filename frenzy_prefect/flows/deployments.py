"""Deploy the package's flows to a `frenzy` work pool (module entrypoints: any machine with the
package installed can run them, no source checkout needed)."""

from __future__ import annotations

import re
from uuid import UUID

from prefect import deploy
from prefect.events import DeploymentEventTrigger
from prefect.types.entrypoint import EntrypointType

from frenzy_prefect.flows.datasets import watch_datasets
from frenzy_prefect.flows.node_check import node_check
from frenzy_prefect.flows.training import distributed_train, train_llm

DEFAULT_NAME = "frenzy"


def deploy_flows(pool: str, name: str = DEFAULT_NAME) -> list[UUID]:
    """`train-llm/NAME` and `distributed-train/NAME` on ``pool``, the first submitting its
    training to the second, and `node-check/NAME`, which `frenzy cluster check` runs on each node."""
    return deploy(
        train_llm.to_deployment(
            name=name, entrypoint_type=EntrypointType.MODULE_PATH, parameters={"training_deployment": f"distributed-train/{name}"}
        ),
        distributed_train.to_deployment(name=name, entrypoint_type=EntrypointType.MODULE_PATH),
        node_check.to_deployment(name=name, entrypoint_type=EntrypointType.MODULE_PATH),
        work_pool_name=pool,
        build=False,
        push=False,
        print_next_steps_message=False,
    )


def deploy_on_new_data(
    pool: str,
    prefix: str,
    request: dict,
    name: str = DEFAULT_NAME,
    settle_s: float = 60.0,
    every_s: float = 60.0,
    approve: bool = False,
    paused: bool = False,
) -> tuple[str, str]:
    """`watch-datasets/NAME-<prefix>`, polling ``prefix`` every ``every_s`` (its schedule left
    ``paused`` if asked), and `train-llm/NAME-<prefix>`, which a trigger runs on each
    `frenzy.dataset.landed` event of that prefix: ``request`` (a TrainingRequest's fields) with the
    event's prefix as its dataset, trained through `distributed-train/NAME`, after a person's
    approval of the plans if ``approve``. Returns the two deployments' names."""
    slug = f"{name}-" + re.sub(r"[^a-z0-9]+", "-", prefix.lower().split("://", 1)[-1]).strip("-")[:60]
    landed = DeploymentEventTrigger(
        name=f"train when {prefix} lands",
        expect={"frenzy.dataset.landed"},
        match={"prefect.resource.id": f"frenzy.dataset.{prefix}"},
        parameters={
            "request": {**request, "dataset": "{{ event.payload.prefix }}"},
            "training_deployment": f"distributed-train/{name}",
            "approve": approve,
        },
    )
    deploy(
        watch_datasets.to_deployment(
            name=slug,
            entrypoint_type=EntrypointType.MODULE_PATH,
            interval=every_s,
            paused=paused,
            parameters={"prefix": prefix, "settle_s": settle_s},
        ),
        train_llm.to_deployment(name=slug, entrypoint_type=EntrypointType.MODULE_PATH, triggers=[landed]),
        work_pool_name=pool,
        build=False,
        push=False,
        print_next_steps_message=False,
    )
    return f"watch-datasets/{slug}", f"train-llm/{slug}"
