"""Deploy the package's flows to a `frenzy` work pool (module entrypoints: any machine with the
package installed can run them, no source checkout needed)."""

from __future__ import annotations

from uuid import UUID

from prefect import deploy
from prefect.types.entrypoint import EntrypointType

from frenzy_prefect.flows import distributed_train, train_llm


def deploy_flows(pool: str) -> list[UUID]:
    """`train-llm/frenzy` and `distributed-train/frenzy` on ``pool``."""
    return deploy(
        train_llm.to_deployment(name="frenzy", entrypoint_type=EntrypointType.MODULE_PATH),
        distributed_train.to_deployment(name="frenzy", entrypoint_type=EntrypointType.MODULE_PATH),
        work_pool_name=pool,
        build=False,
        push=False,
        print_next_steps_message=False,
    )
