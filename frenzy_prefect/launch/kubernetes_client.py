"""A kubernetes_asyncio ApiClient for a cluster: from a kubeconfig dict (what prefect-kubernetes'
KubernetesClusterConfig block holds), else the pod's own service account (in-cluster), else the
default kubeconfig (KUBECONFIG or ~/.kube/config)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from frenzy_prefect.errors import FrenzyError


@asynccontextmanager
async def api_client(kubeconfig: dict[str, Any] | None = None, context: str | None = None) -> AsyncIterator[Any]:
    from kubernetes_asyncio import client, config

    configuration = client.Configuration()
    try:
        if kubeconfig is not None:
            await config.load_kube_config_from_dict(kubeconfig, context=context, client_configuration=configuration)
        else:
            try:
                config.load_incluster_config(client_configuration=configuration)
            except config.ConfigException:
                await config.load_kube_config(context=context, client_configuration=configuration)
    except (config.ConfigException, OSError, KeyError, TypeError) as exc:
        raise FrenzyError(f"no usable Kubernetes configuration: {' '.join(str(exc).split())}") from None
    async with client.ApiClient(configuration) as api:
        yield api
