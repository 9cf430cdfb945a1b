"""Deploy the package's flows to a `frenzy` work pool (module entrypoints: any machine with the
package installed can run them, no source checkout needed)."""

from __future__ import annotations

from uuid import UUID

from prefect import deploy
from prefect.types.entrypoint import EntrypointType

from frenzy_prefect.flows import distributed_train, train_llm

DEFAULT_NAME = "frenzy"


def deploy_flows(pool: str, name: str = DEFAULT_NAME) -> list[UUID]:
    """`train-llm/NAME` and `distributed-train/NAME` on ``pool``, the first submitting its
    training to the second."""
    return deploy(
        train_llm.to_deployment(
            name=name, entrypoint_type=EntrypointType.MODULE_PATH, parameters={"training_deployment": f"distributed-train/{name}"}
        ),
        distributed_train.to_deployment(name=name, entrypoint_type=EntrypointType.MODULE_PATH),
        work_pool_name=pool,
        build=False,
        push=False,
        print_next_steps_message=False,
    )
