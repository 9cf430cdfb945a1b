"""A `frenzy` work pool's defaults: the FrenzyCluster block its `train-llm` runs allocate on (a
run's `cluster` parameter overrides it), and any other job variables (the launcher and its
settings, as examples/ssh/, examples/slurm/ and examples/kubernetes/ give them), kept in the
pool's base job template as the variables' defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from frenzy_prefect.errors import FrenzyError, describe_validation_error


def set_pool_cluster(pool: str, cluster: str, variables: dict[str, Any] | None = None) -> bool:
    """Make block ``cluster`` the default cluster of work pool ``pool`` (and ``variables`` the
    defaults of those job variables, as ``job_variables`` reads them from a file), creating the
    pool (type frenzy) when there is none. True when it was created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    from frenzy_prefect.blocks import load_cluster
    from frenzy_prefect.pool.worker import FrenzyWorker

    load_cluster(cluster)  # refused now, not at the pool's first run
    defaults = {**(variables or {}), "cluster": cluster}
    with get_client(sync_client=True) as client:
        try:
            existing = client.read_work_pool(pool)
        except ObjectNotFound:
            template = _with_defaults(FrenzyWorker.get_default_base_job_template(), defaults)
            client.create_work_pool(WorkPoolCreate(name=pool, type=FrenzyWorker.type, base_job_template=template))
            return True
        if existing.type != FrenzyWorker.type:
            raise FrenzyError(f"work pool {pool!r} is of type {existing.type!r}; its runs cannot allocate on a cluster (type frenzy can)")
        client.update_work_pool(pool, WorkPoolUpdate(base_job_template=_with_defaults(existing.base_job_template, defaults)))
        return False


def job_variables(path: Path, cluster: str) -> dict[str, Any]:
    """The job variables of a YAML file (examples/*/job-variables.yaml), each a variable of the
    pool's type and of its type; one line naming what is wrong otherwise. A ``cluster`` it sets
    must be the one named beside it."""
    from frenzy_prefect.pool.worker import FrenzyJobConfiguration, FrenzyWorker
    from frenzy_prefect.spec.names import did_you_mean

    try:
        variables = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise FrenzyError(f"cannot read job variables file {path}: {' '.join(str(exc).split())}") from None
    if not isinstance(variables, dict):
        raise FrenzyError(f"job variables file {path} must be a mapping of the pool's variables (launcher: ssh, ssh_user: ...)")
    known = FrenzyWorker.get_default_base_job_template()["variables"]["properties"]
    for name in variables:
        if name not in known:
            raise FrenzyError(
                f"job variables file {path}: {name!r} is not a variable of a frenzy pool{did_you_mean(str(name), known)}; "
                f"its variables: {', '.join(known)}"
            )
    if variables.get("cluster", cluster) != cluster:
        raise FrenzyError(
            f"job variables file {path} sets cluster {variables['cluster']!r}, and the command names {cluster!r}: leave it out of the file"
        )
    try:
        FrenzyJobConfiguration.model_validate(variables)
    except ValidationError as exc:
        raise FrenzyError(f"job variables file {path}: {describe_validation_error(exc)}") from None
    return variables


def _with_defaults(template: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``template`` with each of ``defaults`` as its variable's default (a pool created before a
    variable existed gets the variable and its place in the job configuration)."""
    from frenzy_prefect.pool.worker import FrenzyWorker

    default = FrenzyWorker.get_default_base_job_template()
    variables = template.setdefault("variables", {}).setdefault("properties", {})
    for name, value in defaults.items():
        variables[name] = {**default["variables"]["properties"][name], **variables.get(name, {}), "default": value}
        template.setdefault("job_configuration", {}).setdefault(name, default["job_configuration"][name])
    return template
