"""The `frenzy` pool on a Kubernetes cluster (``launcher: kubernetes``): the pool's Kubernetes
variables as the launcher's settings, a training run as one JobSet (launch.kubernetes), the
cluster connection from prefect-kubernetes' KubernetesClusterConfig block (or in-cluster), and
the pods' GPU requests in what the pool's queue hands out (a GPU a pod that is not ours holds is
free to no run of the pool)."""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from prefect.events import emit_event

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.launch.command import Launch
from frenzy_prefect.launch.kubernetes import PHASE_LINE, SUBMITTED, delete_run_objects, kubernetes_launch
from frenzy_prefect.launch.kubernetes_client import api_client
from frenzy_prefect.launch.kubernetes_inventory import free_counts, products, read_cluster
from frenzy_prefect.launch.kubernetes_manifest import SECRET_ENV, KubernetesSettings, KubernetesSubmission, NodePods, object_name
from frenzy_prefect.launch.slurm_inventory import narrow_to_slurm
from frenzy_prefect.spec.cluster import ClusterSpec
from frenzy_prefect.spec.plan import JOB_ENV, TrainingJob

FreeNarrowing = Callable[[ClusterSpec, dict[str, list[int]]], Awaitable[dict[str, list[int]]]]
KUBERNETES_JOB_LABEL = "frenzy.kubernetes-job"  # the run's JobSet (or Jobs') name


async def load_cluster_config_async(block: str) -> tuple[dict[str, Any], str | None]:
    """The kubeconfig dict and context of a KubernetesClusterConfig block; FrenzyError naming it when there is none."""
    from prefect_kubernetes.credentials import KubernetesClusterConfig

    try:
        found = await KubernetesClusterConfig.aload(block)
    except ValueError:
        raise FrenzyError(f"no KubernetesClusterConfig block named {block!r} (the pool's cluster_config)") from None
    return found.config, found.context_name


def load_cluster_config(block: str) -> tuple[dict[str, Any], str | None]:
    import asyncio

    return asyncio.run(load_cluster_config_async(block))


def kubernetes_settings(configuration: Any) -> KubernetesSettings:
    if not configuration.image:
        raise FrenzyError("the kubernetes launcher needs the pool's image set: an image with frenzy-prefect installed")
    return KubernetesSettings(
        image=configuration.image,
        namespace=configuration.namespace,
        service_account=configuration.service_account_name,
        image_pull_policy=configuration.image_pull_policy,
        python=configuration.node_python or "python",
        resources=configuration.resources or {},
        pod_spec=configuration.pod_spec or {},
        api=configuration.kubernetes_api,
        storage_secret=configuration.storage_secret,
        api_key_secret=configuration.api_key_secret,
        ttl_seconds_after_finished=configuration.ttl_seconds_after_finished,
        rendezvous_port=configuration.rendezvous_port,
    )


def pod_env(configuration: Any, extra: dict[str, str]) -> dict[str, str]:
    """The pods' plain environment: the run's job configuration's (Prefect's settings for the
    flow run, the pool's env), never the worker's own; the Prefect API key only through
    api_key_secret (FrenzyError when it would otherwise be a plain value)."""
    env = {k: v for k, v in {**configuration.env, **extra}.items() if v is not None}
    if env.pop("PREFECT_API_KEY", None) and not configuration.api_key_secret:
        raise FrenzyError("the worker's Prefect API key would be a plain value in the run's pods; set the pool's api_key_secret")
    if leaked := sorted(SECRET_ENV & env.keys()):
        raise FrenzyError(f"the pool's env sets {', '.join(leaked)}; give S3 keys as its storage_secret (a Kubernetes Secret)")
    return env


def kubernetes_launches(
    configuration: Any,
    job: TrainingJob,
    env: dict[str, str],
    kubeconfig: tuple[dict[str, Any], str | None] | None,
    gpu_products: dict[str, str],
) -> list[Launch]:
    """The run's one launched command: the watcher of its JobSet (named after the flow run);
    ``env``: what the worker adds to the pods' environment (the cluster block's name)."""
    run_id = configuration.env.get("PREFECT__FLOW_RUN_ID", "")
    missing = [p.node for p in job.allocation.placements if p.node not in gpu_products]
    if missing:
        raise FrenzyError(
            f"Kubernetes has no GPU node {', '.join(missing)}: name the nodes as it does (frenzy cluster discover --kubernetes)"
        )
    submission = KubernetesSubmission(
        settings=kubernetes_settings(configuration),
        name=object_name(configuration.name or "run", run_id),
        flow_run_id=run_id,
        flow_run_name=configuration.name or "",
        nodes=[NodePods(node=p.node, gpus=len(p.gpus), product=gpu_products[p.node]) for p in job.allocation.placements],
        max_restarts=job.request.max_restarts,
        env=pod_env(configuration, {**env, JOB_ENV: job.model_dump_json()}),
    )
    config, context = kubeconfig if kubeconfig else (None, None)
    return [kubernetes_launch(submission, config, context, gpus=job.allocation.plan.gpus)]


async def cluster_connection(configuration: Any) -> tuple[dict[str, Any], str | None] | None:
    return await load_cluster_config_async(configuration.cluster_config) if configuration.cluster_config else None


async def gpu_products(kubeconfig: tuple[dict[str, Any], str | None] | None) -> dict[str, str]:
    async with api_client(*(kubeconfig or (None, None))) as api:
        nodes, _ = await read_cluster(api)
    return products(nodes)


def kubernetes_free_narrowing(kubeconfig: tuple[dict[str, Any], str | None] | None) -> FreeNarrowing:
    """What the pool's queue calls on the GPUs its reservations leave free: cut to what the
    nodes' allocatable GPUs leave once every running pod's requests are counted."""

    async def narrow(cluster: ClusterSpec, free: dict[str, list[int]]) -> dict[str, list[int]]:
        async with api_client(*(kubeconfig or (None, None))) as api:
            nodes, pods = await read_cluster(api)
        # (our own running runs' pods are counted by the reservations and by Kubernetes both: the
        # smaller of the two is what is free)
        return narrow_to_slurm(free, free_counts(nodes, pods))

    return narrow


def kubernetes_log_forwarder(
    logger: logging.LoggerAdapter, label: Callable[[dict[str, str]], Awaitable[None]], flow_run: Any, pool: str, pool_id: Any
) -> Callable[[str], Awaitable[None]]:
    """The watcher's lines into the run's log; its JobSet's name into the run's labels; each
    pod's phase change as a ``prefect.kubernetes.pod.<phase>`` event (pod_event)."""
    namespace = ""

    async def forward(line: str) -> None:
        nonlocal namespace
        logger.info(line)
        if line.startswith(SUBMITTED):
            head, _, tail = line.removeprefix(SUBMITTED).partition(" in namespace ")
            namespace = tail.split()[0] if tail else ""
            await label({KUBERNETES_JOB_LABEL: head.split()[-1]})
        elif found := PHASE_LINE.match(line):
            pod_event(found, namespace, flow_run, pool, pool_id)

    return forward


def pod_event(phase: re.Match[str], namespace: str, flow_run: Any, pool: str, pool_id: Any) -> None:
    """prefect-kubernetes' pod event (its observer's names: ``prefect.kubernetes.pod.running``,
    ...; the resource ``prefect.kubernetes.pod.<name>``, where the observer uses the pod's uid,
    which the watcher's line does not carry: a run's pod names are its own), related to the flow
    run and the work pool, so automations written for prefect-kubernetes' pods match ours."""
    resource = {
        "prefect.resource.id": f"prefect.kubernetes.pod.{phase['pod']}",
        "prefect.resource.name": phase["pod"],
        "kubernetes.namespace": namespace,
        "kubernetes.node": phase["node"],
    }
    if phase["reason"]:
        resource["kubernetes.reason"] = phase["reason"]
    related = [
        {
            "prefect.resource.id": f"prefect.flow-run.{flow_run.id}",
            "prefect.resource.role": "flow-run",
            "prefect.resource.name": flow_run.name,
        },
        {"prefect.resource.id": f"prefect.work-pool.{pool_id}", "prefect.resource.role": "work-pool", "prefect.resource.name": pool},
    ]
    emit_event(event=f"prefect.kubernetes.pod.{phase['phase'].lower()}", resource=resource, related=related)


async def delete_objects_of_lost_run(worker: Any, run: Any) -> list[str]:
    """What is left in the cluster of a run whose worker (and with it, the watcher that would
    have deleted them) is gone, deleted with foreground propagation, so that its pods do not
    train on GPUs its reclaimed reservation no longer holds: ``Kind/name`` of each. The cluster
    and namespace are the run's own job configuration's (the pool's template, the deployment's
    and the run's variables)."""
    name = run.labels.get(KUBERNETES_JOB_LABEL)
    if not name:
        return []
    variables = dict((await worker.client.read_deployment(run.deployment_id)).job_variables or {}) if run.deployment_id else {}
    variables |= run.job_variables or {}
    configuration = await worker.job_configuration.from_template_and_values(
        base_job_template=worker.work_pool.base_job_template, values=variables, client=worker.client
    )
    async with api_client(*(await cluster_connection(configuration) or (None, None))) as api:
        return await delete_run_objects(api, configuration.namespace, name)
