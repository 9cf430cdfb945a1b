"""Prefect tasks: thin wrappers over the core, each leaving what it decided in the Prefect UI."""

from __future__ import annotations

import base64
import json

from prefect import get_client, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.deployments import run_deployment
from prefect.logging import get_run_logger
from prefect.utilities.asyncutils import run_coro_as_sync

from frenzy_prefect import allocator
from frenzy_prefect.allocator.across import allocate_across
from frenzy_prefect.allocator.learning import Learned, applied, record_of
from frenzy_prefect.allocator.mixed import across_types_hint
from frenzy_prefect.blocks import load_cluster, save_node
from frenzy_prefect.datasets.prepare import Prepared
from frenzy_prefect.datasets.prepare import prepare as _prepare
from frenzy_prefect.errors import ClusterBusy, FrenzyError, NoFeasiblePlan
from frenzy_prefect.flows.charts import loss_curve_png
from frenzy_prefect.memory.run_records import CalibrationStore, RunRecord
from frenzy_prefect.pool.reservations import GpuReservations
from frenzy_prefect.profiling.dataset import profile_dataset as _profile_dataset
from frenzy_prefect.profiling.model import resolve_model
from frenzy_prefect.profiling.nodes import node_of, read_gpus
from frenzy_prefect.spec.cluster import ClusterSpec, ClusterState
from frenzy_prefect.spec.dataset import DatasetInfo, Preparation
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import Allocation, MemoryBreakdown, PlanCandidate, TrainingJob
from frenzy_prefect.spec.request import TrainingRequest
from frenzy_prefect.spec.result import TrainingReport, TrainingResult
from frenzy_prefect.storage import exists, open_uri, write_bytes
from frenzy_prefect.units import duration, gib, usd

ARTIFACT_ROWS = 25


def _breakdown_row(b: MemoryBreakdown) -> dict[str, str]:
    return {
        "params GiB": gib(b.params),
        "grads GiB": gib(b.grads),
        "optimizer GiB": gib(b.optimizer),
        "activations GiB": gib(b.activations),
        "other GiB": gib(b.other),
        "peak GiB": gib(b.total),
    }


@task
def profile_model(request: TrainingRequest) -> ModelSpec:
    spec = resolve_model(request.model, seq_len=request.seq_len)
    get_run_logger().info(f"Model {spec.name}: {spec.parameters:,} parameters, {spec.layers} layers, hidden {spec.hidden}")
    return spec


@task
def prepare_dataset(source: str, options: Preparation) -> Prepared:
    """Raw text under ``source`` -> token shards and a manifest, or the ones an earlier run left for the same content."""
    prepared = _prepare(source, options)
    m = prepared.manifest
    what = f"{m.documents:,} documents, {m.tokens:,} tokens in {len(m.shards)} shard(s) ({m.format}, vocabulary {m.vocab_size:,})"
    get_run_logger().info(f"{'Found' if prepared.cached else 'Prepared'} {source} as {what} at {prepared.manifest_uri}")
    create_markdown_artifact(
        key="dataset-preparation",
        markdown=(
            f"## Dataset {'found prepared' if prepared.cached else 'prepared'}\n\n"
            f"- source: `{source}` ({len(m.files)} file(s))\n- content hash: `{m.content_hash}`\n- {what}\n"
            f"- manifest: `{prepared.manifest_uri}`\n"
        ),
        description="The token shards training reads",
    )
    return prepared


@task
def profile_dataset(request: TrainingRequest, model: ModelSpec, uri: str | None = None) -> DatasetInfo:
    """The token data at ``uri`` (default: the request's dataset), checked against the request and model."""
    info = _profile_dataset(uri or request.dataset, request.seq_len, model.vocab_size)
    get_run_logger().info(f"Dataset {info.uri}: {info.tokens:,} tokens ({info.format})")
    return info


@task
def profile_cluster(cluster: str) -> ClusterState:
    """The cluster's state now: the FrenzyCluster block named ``cluster``, less the GPUs other
    runs hold (the reservations the `frenzy` workers share)."""
    spec = load_cluster(cluster).cluster
    gpus = ", ".join(f"{n.name}: {n.gpu_count} x {n.gpu_type}" for n in spec.nodes)
    state = run_coro_as_sync(_live_state(spec))
    busy = sum(n.gpu_count - len(state.free_gpus[n.name]) for n in spec.nodes)
    get_run_logger().info(f"Cluster {spec.name}: {gpus}; {busy} GPU(s) held by other runs")
    return state


async def _live_state(spec: ClusterSpec) -> ClusterState:
    async with get_client() as client:
        return await GpuReservations(client, spec).state()


@task
def discover_node(node: str, host: str, cluster: str) -> ClusterSpec:
    """Run on a GPU node (through a worker there): its GPUs through NVML, added to or updated in
    the FrenzyCluster block ``cluster``."""
    found = node_of(node, host, read_gpus())
    spec = save_node(cluster, found)
    get_run_logger().info(f"Node {found.name}: {found.gpu_count} x {found.gpu_type}, saved to cluster block {cluster!r}")
    return spec


def read_store(uri: str, cluster: str) -> CalibrationStore:
    """The store at ``uri``; a new one where there is none, or (saying so) where it cannot be read."""
    try:
        return CalibrationStore.load(uri) if exists(uri) else CalibrationStore(cluster=cluster)
    except FrenzyError as exc:
        get_run_logger().warning(f"{exc}; planning without it")
        return CalibrationStore(cluster=cluster)


def _last_run(record: RunRecord) -> str:
    """A run's predicted against measured peak and step, in a line."""
    rank = record.worst_rank
    held = f"the GPU held {gib(rank.device_bytes)} GiB" if rank.device_bytes else "memory not measured (CPU)"
    step = f"step {duration(record.predicted_step_s)} predicted" if record.predicted_step_s else "step"
    measured = f"{duration(record.measured_step_s)} measured" if record.measured_step_s else "not measured"
    return (
        f"`{record.source}` ({record.plan.label()}): tensors {gib(rank.predicted_tensors_bytes)} GiB predicted, {held}; {step}, {measured}"
    )


def _calibration_markdown(learned: list[Learned], uri: str) -> str:
    lines = [f"## What this cluster's runs taught\n\nStore: `{uri}`\n"]
    for result in learned:
        lines.append(f"- **{result.gpu.name}**: {result.summary()}")
        if result.last is not None:
            lines.append(f"  - last run {_last_run(result.last)}")
    return "\n".join(lines) + "\n"


@task
def estimate_memory(model: ModelSpec, request: TrainingRequest, state: ClusterState, store_uri: str | None = None) -> list[PlanCandidate]:
    """MARP: predicted per-GPU peak memory and step time of every plan on every GPU type, with
    what the cluster's measured runs taught (the calibration store at ``store_uri``)."""
    store = read_store(store_uri, state.cluster.name) if store_uri else CalibrationStore(cluster=state.cluster.name)
    cluster, calibration, learned = applied(store, state.cluster)
    if store_uri:
        create_markdown_artifact(
            key="calibration", markdown=_calibration_markdown(learned, store_uri), description="Learned from measured runs"
        )
    candidates = allocator.candidate_plans(model, request, cluster, calibration)
    fitting = sum(c.fits for c in candidates)
    rows = [
        {
            "#": str(rank),
            "gpu": c.gpu_type,
            "gpus": str(c.plan.gpus),
            "plan": c.plan.label(),
            **_breakdown_row(c.memory.peak_stage),
            "GPU memory GiB": gib(c.gpu_memory_bytes),
            "margin GiB": gib(c.margin_bytes),
            "spare GiB": gib(c.spare_bytes),
            "fits": "yes" if c.fits else "no",
            "step time (predicted)": duration(c.step_time_s),
            "total time (predicted)": duration(c.total_time_s),
            "cost (predicted)": usd(c.cost),
        }
        for rank, c in enumerate(candidates[:ARTIFACT_ROWS], 1)
    ]
    create_table_artifact(
        key="memory-estimates",
        table=rows,
        description=(
            f"Predicted per-GPU peak memory: {fitting} of {len(candidates)} plans fit; first {len(rows)} in priority order. "
            + "; ".join(r.summary() for r in learned)
        ),
    )
    get_run_logger().info(f"{fitting} of {len(candidates)} candidate plans fit their GPU type")
    if not fitting and (hint := across_types_hint(model, request.workload, cluster)):
        get_run_logger().warning(f"no plan on one GPU type fits; {hint}")
    return candidates


@task
def allocate(
    candidates: list[PlanCandidate], state: ClusterState, model: ModelSpec | None = None, request: TrainingRequest | None = None
) -> Allocation:
    """HAS: the first plan the free GPUs can hold, bin-packed onto nodes; with ``model`` and
    ``request``, a plan across two GPU types instead where no single-type plan can start now or
    one across types is predicted MIXED_GAIN faster (``allocator.across``); if other runs hold
    every GPU that would do, the best plan on the idle cluster, whose GPUs the `frenzy` worker
    then waits for. Nothing starts if no plan fits the cluster at all."""
    why: FrenzyError | None = None
    try:
        chosen: Allocation | None = allocator.allocate(candidates, state)
    except (ClusterBusy, NoFeasiblePlan) as single:
        chosen, why = None, single
    waits_for = next((c for c in candidates if c.fits), None) if isinstance(why, ClusterBusy) else None
    across = None if model is None or request is None else allocate_across(model, request, state, chosen, waits_for)
    if across is not None:
        reason = (
            f"{why}" if chosen is None else f"predicted {chosen.step_time_s / across.step_time_s:.2f}x faster than {chosen.plan.label()}"
        )
        get_run_logger().info(f"Across GPU types: {across.plan.label()} ({reason})")
        chosen = across
    elif chosen is None and isinstance(why, ClusterBusy):
        chosen = allocator.allocate(candidates, ClusterState.idle(state.cluster))
        get_run_logger().info(f"{why}; the run will wait for {chosen.plan.gpus} x {chosen.gpu_type}")
    elif why is not None:
        raise why
    breakdown = _breakdown_row(chosen.memory.peak_stage)
    placed = ", ".join(f"{p.node} GPUs {p.gpus}" for p in chosen.placements)
    create_markdown_artifact(
        key="allocation",
        markdown=(
            f"## Allocation\n\n"
            f"**{chosen.plan.gpus} x {chosen.gpu_type}**, {chosen.plan.label()}\n\n"
            f"- placement: {placed}\n"
            f"- {chosen.fit_summary()}\n"
            f"- predicted step time: {duration(chosen.step_time_s)}\n\n"
            + "| "
            + " | ".join(breakdown)
            + " |\n"
            + "|"
            + "---|" * len(breakdown)
            + "\n"
            + "| "
            + " | ".join(breakdown.values())
            + " |\n"
        ),
        description="The plan and placement chosen for this run",
    )
    create_table_artifact(
        key="chosen-plan-memory",
        table=[{"stage": str(stage), **_breakdown_row(b)} for stage, b in enumerate(chosen.memory.per_stage)],
        description=f"Predicted peak memory per GPU of the chosen plan ({chosen.plan.label()} on {chosen.gpu_type}),"
        " itemised per pipeline stage",
    )
    get_run_logger().info(f"Allocated {chosen.plan.gpus} x {chosen.gpu_type} ({chosen.plan.label()}) on {placed}")
    return chosen


class TrainingRunEnded(FrenzyError):
    """The training flow run ended other than Completed; the message is its cause in one line."""


ENDED_MESSAGE_CHARS = 500


def ended_message(name: str, state_name: str, message: str | None) -> str:
    """``training run NAME crashed: CAUSE``: the training run's state message, less Prefect's
    "Flow run encountered an exception: " and all but its first line."""
    lines = (message or "").removeprefix("Flow run encountered an exception: ").strip().splitlines()
    cause = lines[0].strip() if lines else "no reason given"
    return f"training run {name} {state_name.lower()}: {cause}"[:ENDED_MESSAGE_CHARS]


@task
def train(job: TrainingJob, deployment: str) -> tuple[TrainingResult | None, str]:
    """Dispatch the job's ranks through the `frenzy` work pool and wait for them: (the result,
    the training flow run's id), or (None, its name) when that run was cancelled.
    TrainingRunEnded names the cause when it failed or crashed."""
    run = run_deployment(deployment, parameters={"job": job.model_dump(mode="json")}, poll_interval=2)
    if run.state is not None and run.state.is_cancelled():
        get_run_logger().info(f"training run {run.name} was cancelled: {run.state.message or 'no reason given'}")
        return None, run.name
    if run.state is None or not run.state.is_completed():
        state = run.state.name if run.state else "ended in an unknown state"
        raise TrainingRunEnded(ended_message(run.name, state, run.state.message if run.state else None))
    with open_uri(job.metrics_uri, "r") as f:
        return TrainingResult.model_validate_json(f.read()), str(run.id)


def _survived_rows(result: TrainingResult) -> list[dict[str, str]]:
    def rate(tokens_per_s: float | None) -> str:
        return f"{tokens_per_s:,.0f}" if tokens_per_s is not None else "-"

    return [
        {
            "when": f.at,
            "step": str(f.step),
            "what": f"rank(s) {', '.join(map(str, f.ranks))} {f.kind}"
            + (f" (to fit: at most {f.in_flight} micro-batch(es) in flight per worker)" if f.in_flight is not None else "")
            + (f", on {f.plan}" if f.plan is not None else ""),
            "downtime": f"{f.downtime_s:.2f} s",
            "tokens/s before": rate(f.tokens_per_s_before),
            "tokens/s after": rate(f.tokens_per_s_after),
        }
        for f in result.failures
    ]


@task
def record_run(job: TrainingJob, result: TrainingResult, source: str, store_uri: str) -> None:
    """Add what the run measured to its cluster's calibration store. A record that cannot be
    made or kept is a warning, never the run's failure: the run itself succeeded and reported.
    A run across GPU types is not recorded: each type learns from runs on it alone."""
    if job.allocation.workers:
        get_run_logger().info(f"Not recorded in {store_uri}: a run across GPU types ({job.allocation.gpu_type})")
        return
    try:
        record = record_of(job, result, source)
        store = read_store(store_uri, job.cluster.name).add(record)
        write_bytes(store_uri, store.model_dump_json().encode())
    except Exception as exc:  # noqa: BLE001 (whatever it is, the trained model and its report stand)
        get_run_logger().warning(f"the run's measurements were not added to {store_uri}: {' '.join(str(exc).split())[:200]}")
        return
    get_run_logger().info(f"Recorded in {store_uri} ({len(store.on(record.gpu_type))} runs on {record.gpu_type}): {_last_run(record)}")


@task
def report(job: TrainingJob, result: TrainingResult, training_flow_run: str) -> TrainingReport:
    summary = TrainingReport(
        model=job.model.name,
        parameters=job.model.parameters,
        allocation=job.allocation,
        result=result,
        training_flow_run=training_flow_run,
    )
    write_bytes(job.report_uri, summary.model_dump_json(indent=2).encode())
    stride = max(1, len(result.losses) // 20)
    curve = [
        {"step": str(i + 1), "loss": f"{loss:.4f}"}
        for i, loss in enumerate(result.losses)
        if i % stride == 0 or i + 1 == len(result.losses)
    ]
    create_table_artifact(key="loss-curve", table=curve, description="Training loss (mean over ranks)")
    picture = loss_curve_png(result.losses, f"{summary.model}: training loss")
    picture_uri = f"{job.report_uri.rsplit('/', 1)[0]}/loss-curve.png"
    write_bytes(picture_uri, picture)
    create_markdown_artifact(
        key="loss-curve-picture",
        markdown=f"![training loss](data:image/png;base64,{base64.b64encode(picture).decode()})\n\nAlso at `{picture_uri}`.",
        description="Training loss per step",
    )
    if result.failures:
        create_table_artifact(
            key="failures-survived", table=_survived_rows(result), description="Rank failures trained through, re-plans and rejoins"
        )
    a = job.allocation
    create_markdown_artifact(
        key="training-report",
        markdown=(
            f"## {summary.model} trained\n\n"
            f"- plan: {a.plan.gpus} x {a.gpu_type}, {a.plan.label()}\n"
            f"- predicted peak memory per GPU: {gib(a.memory.peak_bytes)} GiB\n"
            f"- loss: {summary.loss_start:.4f} -> {summary.loss_end:.4f} over {result.steps} steps\n"
            f"- throughput: {result.tokens_per_s:,.0f} tokens/s on {result.world_size} ranks ({result.backend})\n"
            f"- checkpoint: `{result.checkpoint}`\n"
        ),
        description="What the run produced",
    )
    get_run_logger().info(json.dumps({"loss_start": summary.loss_start, "loss_end": summary.loss_end, "checkpoint": result.checkpoint}))
    return summary
