"""`frenzy discover`, `cluster save` and `deploy`: nodes, cluster blocks and deployments on a Prefect server."""

from __future__ import annotations

from pathlib import Path

import typer
import yaml

from frenzy_prefect.cli.common import echo_json
from frenzy_prefect.cli.server import prefect_server
from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.units import gib


def discover(
    node: str | None = typer.Option(None, "--node", help="Node name; default: this machine's hostname."),
    host: str | None = typer.Option(None, "--host", help="Where its ranks run; default: this machine's hostname."),
    save: str | None = typer.Option(None, "--save", help="Add or update the node in this FrenzyCluster block (created if missing)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """This machine's GPUs through NVML, as a cluster node (optionally saved into a cluster block)."""
    import socket

    from frenzy_prefect.profiling.nodes import node_of, read_gpus

    server = prefect_server(f"FrenzyCluster block {save!r}") if save else None
    name = node or socket.gethostname()
    gpus = read_gpus()
    found = node_of(name, host or socket.gethostname(), gpus)
    if save:
        from frenzy_prefect.blocks import save_node

        save_node(save, found)
    if as_json:
        echo_json({"node": found.model_dump(), "gpus": [g.model_dump() for g in gpus], "saved_to": save})
        return
    for g in gpus:
        link = f"{g.nvlinks} NVLink links" if g.nvlinks else f"PCIe gen {g.pcie_generation} x{g.pcie_width}"
        typer.echo(f"GPU {g.index}: {g.name}, {gib(g.memory_bytes)} GiB, {link}")
    typer.echo(
        f"node {found.name} (host {found.host}): {found.gpu_count} x {found.gpu_type}"
        + (f"; saved to block {save!r} on Prefect server {server}" if save else "")
    )


def deploy(
    pool: str = typer.Option("frenzy", "--pool", help="A work pool of type frenzy."),
    name: str = typer.Option("frenzy", "--name", help="Deployment name of both flows."),
    on_new_data: str | None = typer.Option(
        None, "--on-new-data", help="Also train on every new version of the raw dataset under this prefix (needs --request)."
    ),
    request: Path | None = typer.Option(None, "--request", help="With --on-new-data: a YAML/JSON TrainingRequest, its dataset left out."),
    settle_s: float = typer.Option(60.0, "--settle-s", min=0, help="With --on-new-data: seconds a new version's files must stand still."),
    every_s: float = typer.Option(60.0, "--every-s", min=1, help="With --on-new-data: seconds between looks at the prefix."),
    approve: bool = typer.Option(
        False, "--approve", help="With --on-new-data: each run pauses with its ranked plans until a person approves one (the UI's Resume)."
    ),
) -> None:
    """Create the train-llm/NAME and distributed-train/NAME deployments on POOL (and, with
    --on-new-data, a watch-datasets deployment and a train-llm one its events trigger)."""
    from frenzy_prefect.spec.request import TrainingRequest

    if approve and on_new_data is None:
        raise FrenzyError(
            "--approve goes with --on-new-data: the triggered runs pause for approval (a run of your own: train-llm's approve)"
        )
    if (on_new_data is None) != (request is None):
        raise FrenzyError("--on-new-data and --request go together: the prefix to watch and what to train on each new version")
    fields = {**_request_fields(request), "dataset": on_new_data} if request else {}
    if fields:
        TrainingRequest.model_validate(fields)  # refused now, not at the first landing
    server = prefect_server(f"the deployments on work pool {pool!r}")
    # Prefect's deployment machinery and the flows take seconds to import: only once the arguments are good.
    from frenzy_prefect.flows.deployments import deploy_flows, deploy_on_new_data

    try:
        deploy_flows(pool, name)
        typer.echo(
            f"deployed train-llm/{name} and distributed-train/{name} (and node-check/{name}, for `frenzy cluster check`) "
            f"to work pool {pool!r} on Prefect server {server}"
        )
        if on_new_data is not None:
            watcher, trainer = deploy_on_new_data(pool, on_new_data, fields, name, settle_s, every_s, approve)
            typer.echo(f"deployed {watcher} (every {every_s:g} s) and {trainer}, run on each frenzy.dataset.landed of {on_new_data}")
    except ValueError as exc:
        raise FrenzyError(str(exc)) from None


def _request_fields(path: Path) -> dict:
    try:
        fields = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise FrenzyError(f"cannot read request file {path}: {exc}".replace("\n", " ")) from None
    if not isinstance(fields, dict):
        raise FrenzyError(f"request file {path} must be a mapping of TrainingRequest fields (model, global_batch, seq_len, steps, ...)")
    return fields


def pool_cluster(
    cluster: str = typer.Argument(..., help="FrenzyCluster block the pool's train-llm runs allocate on."),
    pool: str = typer.Option("frenzy", "--pool", help="Work pool (type frenzy), created when there is none."),
    job_variables: Path | None = typer.Option(
        None,
        "--job-variables",
        help="YAML of the pool's job variables to make its defaults too: the launcher and its settings "
        "(examples/ssh/, examples/slurm/, examples/kubernetes/job-variables.yaml).",
    ),
) -> None:
    """Make CLUSTER the default cluster of a frenzy work pool (its base job template's `cluster`
    variable; a run's `cluster` parameter still overrides it), and with --job-variables the
    defaults of those variables too."""
    from frenzy_prefect.pool.template import job_variables as read_variables
    from frenzy_prefect.pool.template import set_pool_cluster

    variables = read_variables(job_variables, cluster) if job_variables else {}
    server = prefect_server(f"work pool {pool!r}")
    created = set_pool_cluster(pool, cluster, variables)
    others = [name for name in variables if name != "cluster"]
    typer.echo(
        f"{'created' if created else 'updated'} work pool {pool!r} (type frenzy) on Prefect server {server}: "
        f"its runs allocate on cluster {cluster!r}" + (f"; job variables set: {', '.join(others)}" if others else "")
    )


def cluster_save(
    file: Path = typer.Argument(..., help="Cluster file (YAML or JSON)."),
    name: str | None = typer.Option(None, "--name", help="Block name; default: the cluster's name."),
) -> None:
    """Save a cluster file as a FrenzyCluster block (overwriting one of the same name)."""
    from frenzy_prefect.blocks import FrenzyCluster

    block = FrenzyCluster.from_file(file)
    block_name = name or block.cluster.name
    server = prefect_server(f"FrenzyCluster block {block_name!r}")
    block.save(block_name, overwrite=True)
    typer.echo(f"saved FrenzyCluster block {block_name!r} ({len(block.cluster.nodes)} nodes) on Prefect server {server}")


def cluster_discover(
    slurm: bool = typer.Option(False, "--slurm", help="Read the nodes from Slurm (scontrol), its source of truth."),
    kubernetes: bool = typer.Option(False, "--kubernetes", help="Read the nodes from Kubernetes (allocatable nvidia.com/gpu, GPU labels)."),
    partition: str | None = typer.Option(None, "--partition", help="Only this Slurm partition's nodes."),
    cluster_config: str | None = typer.Option(
        None, "--cluster-config", help="With --kubernetes: a KubernetesClusterConfig block; default: in-cluster, else KUBECONFIG."
    ),
    name: str | None = typer.Option(None, "--name", help="The cluster's name (and its block's, unless --save names another)."),
    gpu_types: Path | None = typer.Option(
        None, "--gpu-types", help="YAML declaring GPU types the catalog lacks, named as Slurm or the GPU product label names them."
    ),
    save: str | None = typer.Option(None, "--save", help="Save the cluster as this FrenzyCluster block (overwriting one of that name)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """A cluster's nodes and their typed GPUs, as the cluster manager knows them (with --slurm:
    Slurm's nodes and GPU GRES; with --kubernetes: the nodes' allocatable GPUs and GPU feature
    discovery labels; their types mapped to the catalog by name) and how many are free now."""
    from frenzy_prefect.scheduling.inputs import load_gpu_types

    if slurm == kubernetes:
        raise FrenzyError(
            "say where to discover the cluster: --slurm (Slurm's nodes) or --kubernetes (the cluster's nodes); "
            "`frenzy discover` adds this machine's GPUs"
        )
    server = prefect_server(f"FrenzyCluster block {save!r}") if save else None
    declared = load_gpu_types(gpu_types) if gpu_types else None
    if slurm:
        spec, free = _from_slurm(save or name or "slurm", partition, declared)
    else:
        spec, free = _from_kubernetes(save or name or "kubernetes", cluster_config, declared)
    if save:
        from frenzy_prefect.blocks import FrenzyCluster

        FrenzyCluster(cluster=spec).save(save, overwrite=True)
    if as_json:
        echo_json({"cluster": spec.model_dump(mode="json"), "free_gpus": {n.name: free[n.name] for n in spec.nodes}, "saved_to": save})
        return
    for n in spec.nodes:
        typer.echo(f"node {n.name} (host {n.host}): {n.gpu_count} x {n.gpu_type}, {free[n.name]} free now")
    typer.echo(
        f"cluster {spec.name!r}: {len(spec.nodes)} nodes" + (f"; saved to block {save!r} on Prefect server {server}" if save else "")
    )


def _from_slurm(name: str, partition: str | None, declared):
    from frenzy_prefect.launch.slurm_inventory import cluster_from_slurm, free_counts, read_nodes

    nodes = read_nodes()
    return cluster_from_slurm(nodes, name, partition, declared), free_counts(nodes)


def _from_kubernetes(name: str, cluster_config: str | None, declared):
    import asyncio

    from frenzy_prefect.launch.kubernetes_client import api_client
    from frenzy_prefect.launch.kubernetes_inventory import cluster_from_kubernetes, free_counts, read_cluster

    kubeconfig, context = None, None
    if cluster_config:
        from frenzy_prefect.pool.kubernetes import load_cluster_config

        kubeconfig, context = load_cluster_config(cluster_config)

    async def read():
        import aiohttp
        from kubernetes_asyncio.client import ApiException

        try:
            async with api_client(kubeconfig, context) as api:
                return await read_cluster(api)
        except ApiException as exc:
            raise FrenzyError(f"the Kubernetes API answered {exc.status} {exc.reason} listing nodes and pods") from None
        except aiohttp.ClientError as exc:
            raise FrenzyError(f"the Kubernetes API did not answer: {' '.join(str(exc).split())}") from None

    nodes, pods = asyncio.run(read())
    return cluster_from_kubernetes(nodes, name, declared), free_counts(nodes, pods)
