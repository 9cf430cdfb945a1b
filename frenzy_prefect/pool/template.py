"""A `frenzy` work pool's default cluster: the FrenzyCluster block its `train-llm` runs allocate on
(a run's `cluster` parameter overrides it), kept in the pool's base job template as the `cluster`
variable's default."""

from __future__ import annotations

from typing import Any

from frenzy_prefect.errors import FrenzyError


def set_pool_cluster(pool: str, cluster: str) -> bool:
    """Make block ``cluster`` the default cluster of work pool ``pool``, creating the pool (type
    frenzy) when there is none. True when it was created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    from frenzy_prefect.blocks import load_cluster
    from frenzy_prefect.pool.worker import FrenzyWorker

    load_cluster(cluster)  # refused now, not at the pool's first run
    with get_client(sync_client=True) as client:
        try:
            existing = client.read_work_pool(pool)
        except ObjectNotFound:
            template = _with_cluster(FrenzyWorker.get_default_base_job_template(), cluster)
            client.create_work_pool(WorkPoolCreate(name=pool, type=FrenzyWorker.type, base_job_template=template))
            return True
        if existing.type != FrenzyWorker.type:
            raise FrenzyError(f"work pool {pool!r} is of type {existing.type!r}; its runs cannot allocate on a cluster (type frenzy can)")
        client.update_work_pool(pool, WorkPoolUpdate(base_job_template=_with_cluster(existing.base_job_template, cluster)))
        return False


def _with_cluster(template: dict[str, Any], cluster: str) -> dict[str, Any]:
    """``template`` with ``cluster`` as its cluster variable's default (a pool created before the
    variable existed gets the variable and its place in the job configuration)."""
    from frenzy_prefect.pool.worker import FrenzyWorker

    default = FrenzyWorker.get_default_base_job_template()
    variables = template.setdefault("variables", {}).setdefault("properties", {})
    variables["cluster"] = {**default["variables"]["properties"]["cluster"], **variables.get("cluster", {}), "default": cluster}
    template.setdefault("job_configuration", {}).setdefault("cluster", default["job_configuration"]["cluster"])
    return template
