"""`frenzy discover`, `cluster save` and `deploy`: nodes, cluster blocks and deployments on a Prefect server."""

from __future__ import annotations

from pathlib import Path

import typer

from frenzy_prefect.cli.common import echo_json
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
        f"node {found.name} (host {found.host}): {found.gpu_count} x {found.gpu_type}" + (f"; saved to block {save!r}" if save else "")
    )


def deploy(
    pool: str = typer.Option("frenzy", "--pool", help="A work pool of type frenzy."),
    name: str = typer.Option("frenzy", "--name", help="Deployment name of both flows."),
) -> None:
    """Create the train-llm/NAME and distributed-train/NAME deployments on POOL."""
    from frenzy_prefect.deployments import deploy_flows

    try:
        deploy_flows(pool, name)
    except ValueError as exc:
        raise FrenzyError(str(exc)) from None
    typer.echo(f"deployed train-llm/{name} and distributed-train/{name} to work pool {pool!r}")


def cluster_save(
    file: Path = typer.Argument(..., help="Cluster file (YAML or JSON)."),
    name: str | None = typer.Option(None, "--name", help="Block name; default: the cluster's name."),
) -> None:
    """Save a cluster file as a FrenzyCluster block (overwriting one of the same name)."""
    from frenzy_prefect.blocks import FrenzyCluster

    block = FrenzyCluster.from_file(file)
    block_name = name or block.cluster.name
    block.save(block_name, overwrite=True)
    typer.echo(f"saved FrenzyCluster block {block_name!r} ({len(block.cluster.nodes)} nodes)")
