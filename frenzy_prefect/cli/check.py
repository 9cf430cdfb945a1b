"""`frenzy cluster check`: the smoke check a user runs once the cluster, the pool, a worker and the
deployments are set up. One tiny dispatch per node through the pool (its queue, GPU take and
launcher, as a training run goes), each node's result in a row: its state, the GPUs its ranks
saw, how long it took from submission, and what it found (flows/node_check.py)."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import typer

from frenzy_prefect.cli.common import echo_json, plain_table, print_table
from frenzy_prefect.cli.server import prefect_server
from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.spec.cluster import ClusterSpec, Node
from frenzy_prefect.units import duration

POLL_S = 2.0  # how often the runs' states are read


def cluster_check(
    cluster: str = typer.Argument(..., help="FrenzyCluster block whose nodes to check."),
    nodes: str | None = typer.Option(None, "--nodes", help="Only these nodes, comma-separated; default: every node of the cluster."),
    name: str = typer.Option("frenzy", "--name", help="The deployments' name: runs node-check/NAME (`frenzy deploy --name`)."),
    timeout_s: float = typer.Option(600.0, "--timeout-s", min=1, help="Seconds to wait for every node; a run still waiting is cancelled."),
    allow_cpu: bool = typer.Option(
        False, "--allow-cpu", help="Pass nodes whose ranks see no CUDA device (a cluster of emulated GPUs, as blocks/local-hetero.yaml)."
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Check every node of CLUSTER through the pool: one run per node (node-check/NAME), pinned to
    it, one rank per GPU; each rank reports its host, CUDA devices and free memory, writes a GiB on
    its GPU and joins a timed all-reduce. Exit 1 if any node fails or is still waiting at the timeout."""
    from prefect.client.orchestration import get_client

    from frenzy_prefect.blocks import load_cluster
    from frenzy_prefect.flows.node_check import check_job

    chosen_names = _node_names(nodes)
    server = prefect_server("the node checks' flow runs")
    spec = load_cluster(cluster).cluster
    chosen = _chosen(spec, chosen_names)
    with get_client(sync_client=True) as client:
        deployment = _deployment(client, f"node-check/{name}", server)
        submitted = {
            node.name: client.create_flow_run_from_deployment(
                deployment.id,
                parameters={"job": check_job(spec, node).model_dump(mode="json"), "allow_cpu": allow_cpu},
                name=f"check-{node.name}",
            ).id
            for node in chosen
        }
        if not as_json:
            typer.echo(
                f"checking {len(chosen)} node(s) of cluster {cluster!r} through node-check/{name} on work pool "
                f"{deployment.work_pool_name!r} (Prefect server {server}); waiting up to {duration(timeout_s)}"
            )
        runs = _wait(client, list(submitted.values()), timeout_s)
        rows = [_row(client, node, runs[submitted[node.name]], deployment.work_pool_name, timeout_s) for node in chosen]
    passed = sum(r["passed"] for r in rows)
    if as_json:
        echo_json({"cluster": cluster, "deployment": f"node-check/{name}", "server": server, "passed": passed, "nodes": rows})
    else:
        _print(rows, passed)
    if passed < len(rows):
        raise typer.Exit(1)


def _node_names(nodes: str | None) -> list[str] | None:
    if nodes is None:
        return None
    names = [n.strip() for n in nodes.split(",")]
    if not all(names):
        raise FrenzyError(f"--nodes takes node names separated by commas (e.g. gpu-1,gpu-2), got {nodes!r}")
    return names


def _chosen(spec: ClusterSpec, names: list[str] | None) -> list[Node]:
    if names is None:
        return list(spec.nodes)
    from frenzy_prefect.spec.names import did_you_mean

    known = [n.name for n in spec.nodes]
    for wanted in names:
        if wanted not in known:
            raise FrenzyError(f"cluster {spec.name!r} has no node {wanted!r}{did_you_mean(wanted, known)}; its nodes: {', '.join(known)}")
    return [n for n in spec.nodes if n.name in names]


def _deployment(client, full_name: str, server: str):
    from prefect.exceptions import ObjectNotFound

    try:
        return client.read_deployment_by_name(full_name)
    except ObjectNotFound:
        name = full_name.split("/", 1)[1]
        raise FrenzyError(
            f"no deployment {full_name} on Prefect server {server}: `frenzy deploy --pool POOL --name {name}` creates it "
            "(with train-llm and distributed-train)"
        ) from None


def _wait(client, run_ids: list, timeout_s: float) -> dict:
    """The runs once each is final, or as they are at the timeout."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout_s
    while True:
        runs = {r.id: r for r in client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=run_ids)))}
        if all(r.state is not None and r.state.is_final() for r in runs.values()) or time.monotonic() >= deadline:
            return runs
        time.sleep(min(POLL_S, max(deadline - time.monotonic(), 0)))


def _row(client, node: Node, run, pool: str, timeout_s: float) -> dict:
    """A node's result: its run's final state and message (the verdict, or the crash's cause), or,
    still waiting at the timeout, why, the run then cancelled."""
    state = run.state
    final = state is not None and state.is_final()
    ranks = _ranks(client, run.id) if final else []
    seen = [r for r in ranks if r.get("gpu_name")]
    row = {
        "node": node.name,
        "host": node.host,
        "state": state.name if state else "Unknown",
        "passed": bool(final and state.is_completed()),
        "gpus_seen": len(seen),
        "gpu_names": sorted({r["gpu_name"] for r in seen}),
        "seconds": _seconds(run),
        "message": (state.message or "").strip() if final else _still_waiting(client, run, pool, timeout_s),
        "flow_run": str(run.id),
        "ranks": ranks,
    }
    if not final:
        _cancel(client, run.id)
    return row


def _ranks(client, run_id) -> list[dict]:
    """Every rank's account: the run's node-check artifact (none if the ranks never got that far)."""
    import json

    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    from frenzy_prefect.flows.node_check import ARTIFACT_KEY

    only = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]), key=ArtifactFilterKey(any_=[ARTIFACT_KEY]))
    found = client.read_artifacts(artifact_filter=only)
    if not found:
        return []
    data = found[0].data
    return json.loads(data) if isinstance(data, str) else data


def _seconds(run) -> float:
    """From its submission to its end (or to now, for a run not ended)."""
    end = run.end_time or datetime.now(UTC)
    return max((end - run.created).total_seconds(), 0.0)


def _still_waiting(client, run, pool: str, timeout_s: float) -> str:
    from prefect.client.schemas.objects import StateType

    waited = f"after {duration(timeout_s)}"
    if run.state is None or run.state.type == StateType.SCHEDULED:
        return (
            f"still waiting {waited}: no worker of work pool {pool!r} took the run "
            f"(is `prefect worker start --pool {pool}` running, and polling this server?); cancelled"
        )
    if run.state.type == StateType.PENDING:
        return f"still waiting {waited}: {_last_log(client, run.id) or 'in the pool queue for the node GPUs'}; cancelled"
    return f"still {run.state.name.lower()} {waited}: its ranks had not finished; cancelled"


def _last_log(client, run_id) -> str | None:
    """The run's latest log line (the worker's: why it waits in the pool's queue)."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), limit=1, sort=LogSort.TIMESTAMP_DESC)
    return " ".join(logs[0].message.split()) if logs else None


def _cancel(client, run_id) -> None:
    """As `prefect flow-run cancel` does: the worker holding it stops it, and frees what it took."""
    from prefect.client.schemas.objects import StateType
    from prefect.states import State

    client.set_flow_run_state(run_id, State(type=StateType.CANCELLING, message="frenzy cluster check: timed out"))


def _print(rows: list[dict], passed: int) -> None:
    table = plain_table()
    for column in ("node", "state", "GPUs seen", "time", "result"):
        table.add_column(column, justify="right" if column == "time" else "left")
    for r in rows:
        seen = f"{r['gpus_seen']} x {', '.join(r['gpu_names'])}" if r["gpus_seen"] else ("none (CPU)" if r["ranks"] else "-")
        table.add_row(r["node"], r["state"], seen, duration(r["seconds"]), r["message"])
    print_table(f"{passed} of {len(rows)} node(s) passed", table)
