"""The `frenzy` command line. Subcommands and their --json output are a contract (DESIGN.md 4).
Bad input prints one line on stderr and exits 2; no traceback."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from collections.abc import Callable
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table
from pydantic import ValidationError

from frenzy_prefect.errors import FrenzyError, describe_validation_error
from frenzy_prefect.spec.plan import MemoryBreakdown, ParallelPlan
from frenzy_prefect.spec.request import TrainingRequest
from frenzy_prefect.units import gib

app = typer.Typer(help="Memory-aware LLM training on heterogeneous GPU clusters.", no_args_is_help=True, pretty_exceptions_enable=False)
cluster_app = typer.Typer(help="Cluster inventories (FrenzyCluster blocks).", no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")
recycle_app = typer.Typer(help="ReCycle: training through failures by re-routing micro-batches (simulate a trace, plan a failure case).", no_args_is_help=True)
app.add_typer(recycle_app, name="recycle")


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _guarded(fn):
    """Run a command body, turning user-facing errors into one stderr line."""
    try:
        return fn()
    except ValidationError as exc:
        _fail(describe_validation_error(exc))
    except FrenzyError as exc:
        _fail(str(exc))


def _print_metrics(title: str, rows: list[tuple[str, str]]) -> None:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def _request(model: str, global_batch: int, seq_len: int, precision: str, optimizer: str) -> TrainingRequest:
    """The workload a command describes, validated as a training request (it names no dataset),
    so that bad values get the same one-line errors as in a flow."""
    return TrainingRequest(
        model=model, dataset="-", global_batch=global_batch, seq_len=seq_len, steps=1,
        precision=precision, optimizer={"name": optimizer},
    )  # fmt: skip


def memory_json(plan: ParallelPlan, per_rank: list[tuple[int, MemoryBreakdown]]) -> dict[str, Any]:
    """The estimate/measure schema: the peak over ranks, then every rank (with its stage) and its breakdown."""
    ranks = [
        {"rank": rank, "stage": plan.coordinates(rank)[0], "peak_bytes": b.total, "breakdown": b.model_dump()}
        for rank, b in per_rank
    ]
    return {"peak_bytes": max(r["peak_bytes"] for r in ranks), "per_rank": ranks, "plan": plan.model_dump()}


def _gpu_type(name: str):
    from frenzy_prefect.spec.catalog import GPU_CATALOG

    if name not in GPU_CATALOG:
        raise FrenzyError(f"unknown GPU type {name!r}; known: {', '.join(GPU_CATALOG)}")
    return GPU_CATALOG[name]


class _Workload:
    """The options ``estimate`` and ``measure`` share, validated once (DESIGN.md 4: same options, same schema)."""

    def __init__(self, model, dp, tp, pp, micro_batch, global_batch, seq_len, zero, recompute, precision, optimizer, gpu):
        from frenzy_prefect.profiling.model import resolve_model

        self.spec = resolve_model(model, seq_len=seq_len)
        self.plan = ParallelPlan(dp=dp, tp=tp, pp=pp, micro_batch=micro_batch, zero=zero, recompute=recompute)
        self.request = _request(model, global_batch or self.plan.dp * self.plan.micro_batch, seq_len or self.spec.max_seq_len, precision, optimizer)
        self.gpu = _gpu_type(gpu) if gpu else None  # the plan itself is checked by estimate/measure

    def header(self) -> str:
        return f"{self.spec.name} ({self.spec.parameters:,} parameters), {self.plan.label()}, {self.request.precision}"

    def emit(self, per_rank: list[tuple[int, MemoryBreakdown]], as_json: bool) -> None:
        out = memory_json(self.plan, per_rank) | {"model": self.spec.name, "parameters": self.spec.parameters, "seq_len": self.request.seq_len}
        if as_json:
            typer.echo(json.dumps(out))
            return
        typer.echo(f"{self.header()}: peak {gib(out['peak_bytes'])} GiB per GPU")
        for rank, b in per_rank:
            typer.echo(
                f"  rank {rank} (stage {self.plan.coordinates(rank)[0]}): params {gib(b.params)}  grads {gib(b.grads)}"
                f"  optimizer {gib(b.optimizer)}  activations {gib(b.activations)}  other {gib(b.other)}  GiB"
            )


MODEL_ARG = typer.Argument(..., help="Preset name or path/URI of an HF-style config.json.")
DP = typer.Option(1, "--dp", help="Data-parallel replicas.")
TP = typer.Option(1, "--tp", help="Tensor-parallel ranks (must divide heads, hidden and ffn).")
PP = typer.Option(1, "--pp", help="Pipeline stages (1F1B), at most the number of layers.")
MICRO_BATCH = typer.Option(1, "--micro-batch")
GLOBAL_BATCH = typer.Option(None, "--global-batch", help="Default: dp * micro-batch.")
SEQ_LEN = typer.Option(None, "--seq-len", help="Default: the model's max_seq_len.")
ZERO = typer.Option(0, "--zero", help="ZeRO stage 0-3.")
RECOMPUTE = typer.Option("none", "--recompute", help="none, selective or full.")
PRECISION = typer.Option("bf16", "--precision", help="fp32, bf16 or fp16.")
OPTIMIZER = typer.Option("adamw", "--optimizer", help="adamw, adam or sgd.")
GPU = typer.Option(None, "--gpu", help="GPU type: estimate adds its calibrated overhead (default: tensors only); measure only checks the name.")
JSON = typer.Option(False, "--json")


def _memory_command(name: str, per_rank: Callable[[_Workload], list[tuple[int, MemoryBreakdown]]], doc: str) -> None:
    """Register ``estimate`` or ``measure``: the same options and the same schema (DESIGN.md 4)."""

    def command(
        model: str = MODEL_ARG, dp: int = DP, tp: int = TP, pp: int = PP, micro_batch: int = MICRO_BATCH,
        global_batch: Optional[int] = GLOBAL_BATCH, seq_len: Optional[int] = SEQ_LEN, zero: int = ZERO,
        recompute: str = RECOMPUTE, precision: str = PRECISION, optimizer: str = OPTIMIZER, gpu: Optional[str] = GPU,
        as_json: bool = JSON,
    ) -> None:  # fmt: skip
        def body() -> None:
            w = _Workload(model, dp, tp, pp, micro_batch, global_batch, seq_len, zero, recompute, precision, optimizer, gpu)
            w.emit(per_rank(w), as_json)

        _guarded(body)

    command.__doc__ = doc
    app.command(name)(command)


def _estimated(w: _Workload) -> list[tuple[int, MemoryBreakdown]]:
    from frenzy_prefect.memory import estimate

    r = w.request
    result = estimate(
        w.spec, w.plan, global_batch=r.global_batch, seq_len=r.seq_len, precision=r.precision,
        optimizer_bytes_per_param=r.optimizer.state_bytes_per_parameter, gpu=w.gpu,
    )  # fmt: skip
    return [(rank, result.per_stage[w.plan.coordinates(rank)[0]]) for rank in range(w.plan.gpus)]


def _measured(w: _Workload) -> list[tuple[int, MemoryBreakdown]]:
    from frenzy_prefect.training.measure import Workload, measure

    r = w.request
    ranks = measure(Workload(model=w.spec, plan=w.plan, global_batch=r.global_batch, seq_len=r.seq_len, precision=r.precision, optimizer=r.optimizer))
    return [(m.rank, m.breakdown) for m in ranks]


_memory_command("estimate", _estimated, "Predicted per-GPU peak memory of one plan, per rank and by category.")
_memory_command(
    "measure",
    _measured,
    """The same plan executed here by the training engine (one process per GPU, three steps), with
    each rank's measured peak by category (MemTracker; on CUDA also the allocator's peaks).""",
)


# What `frenzy calibrate` runs on one GPU: sizes from a few hundred MB to tens of GB, both
# precisions, with and without recomputation, so the fit sees overhead and fragmentation apart.
CALIBRATION_RUNS = [
    ("gpt2-small", 4, 1024, "fp32", "none"),
    ("gpt2-small", 8, 1024, "bf16", "none"),
    ("gpt2-small", 16, 1024, "bf16", "full"),
    ("gpt2-medium", 4, 1024, "bf16", "none"),
    ("gpt2-medium", 8, 1024, "bf16", "selective"),
    ("gpt2-large", 4, 1024, "bf16", "full"),
]


@app.command()
def calibrate(
    gpu: str = typer.Option(..., "--gpu", help="The GPU type this machine has (a catalog name)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Calibration file to update; default: $FRENZY_CALIBRATION or the packaged one."),
) -> None:
    """Measure this machine's GPU on a fixed set of runs, fit its overhead and fragmentation, and
    store them in the calibration file the estimator loads; prints the error before and after."""
    from frenzy_prefect.memory import peak_bytes
    from frenzy_prefect.memory.calibration import ENV, PACKAGED, Calibration, GpuConstants, fit, save
    from frenzy_prefect.profiling.model import resolve_model

    def body() -> None:
        import torch

        from frenzy_prefect.training.measure import Workload, measure as run

        gpu_type = _gpu_type(gpu)
        if not torch.cuda.is_available():
            raise FrenzyError("calibration measures a GPU and this machine has no CUDA device; the constants stay documented assumptions")
        path = out or os.environ.get(ENV) or PACKAGED
        current = Calibration.load(path) if Path(path).exists() else Calibration()
        runs, measured = [], []
        for model, batch, seq_len, precision, recompute in CALIBRATION_RUNS:
            spec, plan_ = resolve_model(model, seq_len=seq_len), ParallelPlan(micro_batch=batch, recompute=recompute)
            (rank,) = run(Workload(model=spec, plan=plan_, global_batch=batch, seq_len=seq_len, precision=precision, optimizer={"name": "adamw"}))
            runs.append((spec, plan_, dict(global_batch=batch, seq_len=seq_len, precision=precision, optimizer_bytes_per_param=8, gpu=gpu_type)))
            measured.append(rank.device_peak)
            typer.echo(f"{model} mb={batch} seq={seq_len} {precision} recompute={recompute}: device peak {gib(rank.device_peak)} GiB")

        def predicted(calibration: Calibration) -> list[int]:
            return [peak_bytes(spec, plan_, **kwargs, calibration=calibration) for spec, plan_, kwargs in runs]

        tensors = predicted(Calibration(gpus={gpu: GpuConstants()}))
        constants = fit(tensors, measured, note=f"{len(measured)} runs of `frenzy calibrate` on {torch.cuda.get_device_name()}")
        save(current.model_copy(update={"gpus": current.gpus | {gpu: constants}}), path)
        for label, calibration in (("before (catalog assumption)", Calibration()), ("after (fitted)", Calibration(gpus={gpu: constants}))):
            errors = sorted(abs(p - m) / m for p, m in zip(predicted(calibration), measured, strict=True))
            typer.echo(f"{label}: median error {errors[len(errors) // 2]:.2%}, worst {errors[-1]:.2%}")
        typer.echo(f"{gpu}: overhead {gib(constants.overhead_bytes)} GiB, fragmentation x{constants.fragmentation:.4f} -> {path}")

    _guarded(body)


@app.command()
def plan(
    model: str = typer.Argument(..., help="Preset name or path/URI of an HF-style config.json."),
    global_batch: int = typer.Option(..., "--global-batch"),
    seq_len: int = typer.Option(..., "--seq-len"),
    cluster: Path = typer.Option(..., "--cluster", help="Cluster file (YAML or JSON)."),
    precision: str = typer.Option("bf16", "--precision", help="fp32, bf16 or fp16."),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw, adam or sgd."),
    space: str = typer.Option("engine", "--space", help="engine: plans training runs today (data parallel, recompute); full: tp, pp and ZeRO too."),
    top: int = typer.Option(10, "--top", help="How many ranked plans to show."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """HAS on an idle cluster: the ranked feasible plans (MARP) and the chosen placement."""
    from frenzy_prefect import allocator
    from frenzy_prefect.profiling.model import resolve_model
    from frenzy_prefect.spec.cluster import ClusterSpec, ClusterState

    def body() -> None:
        if space not in ("engine", "full"):
            raise FrenzyError(f"--space must be engine or full, not {space!r}")
        spec = resolve_model(model, seq_len=seq_len)
        request = _request(model, global_batch, seq_len, precision, optimizer)
        state = ClusterState.idle(ClusterSpec.from_file(cluster))
        candidates = allocator.candidate_plans(spec, request, state.cluster, space)  # type: ignore[arg-type]
        chosen = allocator.allocate(candidates, state)
        ranked = [c for c in candidates if c.fits][:top]
        if as_json:
            plans = [
                {"gpu_type": c.gpu_type, "gpus": c.plan.gpus, "plan": c.plan.model_dump(), "peak_bytes": c.memory.peak_bytes, "step_time_s": c.step_time_s}
                for c in ranked
            ]
            typer.echo(json.dumps({"plans": plans, "chosen": chosen.model_dump(mode="json")}))
            return
        table = Table(title=f"{model}, global batch {global_batch} x {seq_len} tokens, on {state.cluster.name}")
        for column in ("#", "GPUs", "type", "dp", "tp", "pp", "mb", "ZeRO", "recompute", "peak GiB", "of GiB", "step s"):
            table.add_column(column, justify="left" if column in ("type", "recompute") else "right")
        for i, c in enumerate(ranked, 1):
            p = c.plan
            table.add_row(
                *map(str, (i, p.gpus, c.gpu_type, p.dp, p.tp, p.pp, p.micro_batch, p.zero, p.recompute, gib(c.memory.peak_bytes), gib(c.gpu_memory_bytes))),
                f"{c.step_time_s:.4g}",
            )
        console = Console()
        console.print(table)
        placed = ", ".join(f"{p.node} GPUs {p.gpus}" for p in chosen.placements)
        console.print(f"chosen: {chosen.plan.gpus} x {chosen.gpu_type}, {chosen.plan.label()} on {placed}")

    _guarded(body)


@app.command()
def simulate(
    trace: Path = typer.Option(..., "--trace", help="ElasticFlow job trace CSV."),
    cluster: Path = typer.Option(..., "--cluster", help="Alibaba v2023 node-list CSV, or a cluster file (YAML/JSON)."),
    policy: str = typer.Option("frenzy", "--policy", help="frenzy, first-fit, fastest-type or ilp."),
    gpu_types: Optional[Path] = typer.Option(None, "--gpu-types", help="YAML declaring GPU types the catalog lacks (e.g. Alibaba's G2, G3)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Replay a job trace on a cluster under one scheduling policy."""
    from frenzy_prefect.scheduling.inputs import load_cluster, load_trace
    from frenzy_prefect.scheduling.jobs import sim_jobs
    from frenzy_prefect.scheduling.policies import make_policy
    from frenzy_prefect.scheduling.simulator import simulate as run

    def body() -> None:
        chosen = make_policy(policy)
        result = run(sim_jobs(load_trace(trace)), load_cluster(cluster, gpu_types), chosen)
        if as_json:
            typer.echo(result.model_dump_json())
            return
        hours = lambda s: "-" if s is None else f"{s / 3600:.2f} h"  # noqa: E731
        rows = [
            ("jobs completed", f"{result.jobs_completed} / {result.jobs_total}"),
            ("unschedulable", str(result.jobs_unschedulable)),
            ("out-of-memory restarts", str(result.out_of_memory_restarts)),
            ("average JCT", hours(result.avg_jct_s)),
            ("p50 JCT", hours(result.p50_jct_s)),
            ("p99 JCT", hours(result.p99_jct_s)),
            ("makespan", hours(result.makespan_s)),
            ("GPU utilisation", f"{result.gpu_utilization:.1%}"),
            ("decision latency p50 / p99", f"{result.decision_latency_ms.p50:.3f} / {result.decision_latency_ms.p99:.3f} ms"),
        ]
        _print_metrics(f"{trace.name} on {cluster.name} ({result.cluster_gpus} GPUs), policy {result.policy}", rows)

    _guarded(body)


@app.command()
def discover(
    node: Optional[str] = typer.Option(None, "--node", help="Node name; default: this machine's hostname."),
    host: Optional[str] = typer.Option(None, "--host", help="Where its ranks run; default: this machine's hostname."),
    save: Optional[str] = typer.Option(None, "--save", help="Add or update the node in this FrenzyCluster block (created if missing)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """This machine's GPUs through NVML, as a cluster node (optionally saved into a cluster block)."""
    import socket

    from frenzy_prefect.profiling.nodes import node_of, read_gpus

    def body() -> None:
        name = node or socket.gethostname()
        gpus = read_gpus()
        found = node_of(name, host or socket.gethostname(), gpus)
        if save:
            from frenzy_prefect.blocks import save_node

            save_node(save, found)
        if as_json:
            typer.echo(json.dumps({"node": found.model_dump(), "gpus": [g.model_dump() for g in gpus], "saved_to": save}))
            return
        for g in gpus:
            link = f"{g.nvlinks} NVLink links" if g.nvlinks else f"PCIe gen {g.pcie_generation} x{g.pcie_width}"
            typer.echo(f"GPU {g.index}: {g.name}, {gib(g.memory_bytes)} GiB, {link}")
        typer.echo(f"node {found.name} (host {found.host}): {found.gpu_count} x {found.gpu_type}" + (f"; saved to block {save!r}" if save else ""))

    _guarded(body)


@app.command()
def presets() -> None:
    """The model presets and their sizes."""
    from frenzy_prefect.profiling.model import PRESETS

    for name, spec in PRESETS.items():
        typer.echo(f"{name:<12} {spec.parameters / 1e6:10.1f} M params  layers {spec.layers:>3}  hidden {spec.hidden:>5}  heads {spec.heads:>3}  vocab {spec.vocab_size}")


@app.command()
def deploy(pool: str = typer.Option("frenzy", "--pool", help="A work pool of type frenzy.")) -> None:
    """Create the train-llm/frenzy and distributed-train/frenzy deployments on POOL."""
    from frenzy_prefect.deployments import deploy_flows

    def body() -> None:
        try:
            deploy_flows(pool)
        except ValueError as exc:
            raise FrenzyError(str(exc)) from None
        typer.echo(f"deployed train-llm/frenzy and distributed-train/frenzy to work pool {pool!r}")

    _guarded(body)


@recycle_app.command("simulate")
def recycle_simulate(
    trace: Path = typer.Option(..., "--trace", help="Node trace CSV: time_ms,add|remove,nodeN per line."),
    dp: int = typer.Option(..., "--dp", min=1, help="Data-parallel pipelines."),
    pp: int = typer.Option(..., "--pp", min=1, help="Pipeline stages."),
    microbatches: int = typer.Option(..., "--microbatches", min=1, help="Micro-batches per pipeline per iteration."),
    policy: str = typer.Option("recycle", "--policy", help="recycle, checkpoint_restart, drop_pipeline, oobleck, bamboo or adaptive."),
    step_time_table: Optional[Path] = typer.Option(None, "--step-time-table", help='JSON {"alive workers": fault-free step seconds}; default: the throughput model.'),
    samples_per_step: Optional[int] = typer.Option(None, "--samples-per-step", min=1, help="Global batch in samples; needed with --step-time-table (default dp * microbatches)."),
    model: str = typer.Option("gpt2-xl", "--model", help="Throughput model only: preset name or HF config.json."),
    gpu: str = typer.Option("A100-80GB", "--gpu", help="Throughput model only: a catalog GPU type."),
    mapping: Optional[Path] = typer.Option(None, "--mapping", help="nodeN,pipeline,stage lines; default pipeline-major by node number."),
    horizon_s: Optional[float] = typer.Option(None, "--horizon-s", help="Measured window from the first event; default: to the last event."),
    knob: list[str] = typer.Option([], "--knob", help="Override a simulation constant, NAME=VALUE (repeatable), e.g. checkpoint_interval_s=600."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Throughput of data x pipeline parallel training through a node failure trace, under one policy."""
    from frenzy_prefect.recycle.iteration import from_preset, from_step_time_table, load_step_time_table
    from frenzy_prefect.recycle.knobs import Knobs
    from frenzy_prefect.recycle.membership import load_mapping
    from frenzy_prefect.recycle.policies import make_policy
    from frenzy_prefect.recycle.replay import simulate as replay
    from frenzy_prefect.recycle.traces import load_failure_trace

    def body() -> None:
        chosen = make_policy(policy)
        overrides = {}
        for item in knob:
            name, sep, value = item.partition("=")
            if not sep or name.strip() not in Knobs.model_fields:
                raise FrenzyError(f"--knob {item!r}: expected NAME=VALUE with NAME one of {', '.join(Knobs.model_fields)}")
            overrides[name.strip()] = value.strip()
        knobs = Knobs.model_validate(overrides)
        if step_time_table is not None:
            times = from_step_time_table(load_step_time_table(step_time_table), dp=dp, pp=pp, microbatches=microbatches)
        else:
            times = from_preset(model, gpu, dp=dp, pp=pp, microbatches=microbatches)
        homes = load_mapping(mapping, dp, pp) if mapping else None
        result = replay(times, load_failure_trace(trace), chosen, samples_per_iteration=samples_per_step or dp * microbatches,
                        knobs=knobs, homes=homes, horizon_s=horizon_s)
        if as_json:
            typer.echo(result.model_dump_json())
            return
        rows = [
            ("throughput (window)", f"{result.throughput:.2f} samples/s"),
            ("fault-free throughput", f"{result.fault_free_throughput:.2f} samples/s"),
            ("ratio to fault-free", f"{result.ratio:.1%}"),
            ("ratio over the training span", f"{result.span_ratio:.1%}"),
            ("window", f"{result.horizon_s / 3600:.2f} h from t={result.start_s:g} s, {result.workers_at_start} workers at start"),
            ("recovery events", ", ".join(f"{k} {n}" for k, n in result.counts.items() if k != "start") or "none"),
            ("downtime / stalled", f"{result.downtime_s:.0f} s / {result.stalled_s:.0f} s"),
            ("samples lost to rollbacks", str(result.lost_samples)),
            ("stages that lost every replica", str(result.stage_wipeouts)),
            ("nodes outside the grid / spare fills", f"{result.nodes_outside_grid} / {result.spare_fills}"),
        ]
        _print_metrics(f"{trace.name}: {dp} x {pp} grid, {microbatches} micro-batches, policy {result.policy}", rows)

    _guarded(body)


@cluster_app.command("save")
def cluster_save(
    file: Path = typer.Argument(..., help="Cluster file (YAML or JSON)."),
    name: Optional[str] = typer.Option(None, "--name", help="Block name; default: the cluster's name."),
) -> None:
    """Save a cluster file as a FrenzyCluster block (overwriting one of the same name)."""
    from frenzy_prefect.blocks import FrenzyCluster

    def body() -> None:
        block = FrenzyCluster.from_file(file)
        block_name = name or block.cluster.name
        block.save(block_name, overwrite=True)
        typer.echo(f"saved FrenzyCluster block {block_name!r} ({len(block.cluster.nodes)} nodes)")

    _guarded(body)


def _failed_stages(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise FrenzyError(f"--fail takes 0-based stage numbers separated by commas (e.g. 2,2,5), got {text!r}") from None


@recycle_app.command("plan")
def recycle_plan(
    dp: int = typer.Option(..., "--dp", help="Data-parallel pipelines (replicas of every stage)."),
    pp: int = typer.Option(..., "--pp", help="Pipeline stages."),
    microbatches: int = typer.Option(..., "--microbatches", help="Micro-batches per pipeline per iteration."),
    fail: str = typer.Option("", "--fail", help="Failed workers' stages, 0-based, comma-separated: 2,2,5 = two failures in stage 2, one in stage 5."),
    planner_name: str = typer.Option("heuristic", "--planner", help="heuristic or milp."),
    step_s: float = typer.Option(1.0, "--step-s", help="Fault-free 1F1B iteration time in seconds (costs follow from it: F:B:W = 1:1:1)."),
    memory_bound: Optional[int] = typer.Option(None, "--memory-bound", help="Most micro-batches a worker may hold in flight (F done, W not); default: unbounded."),
    actions: bool = typer.Option(False, "--actions", help="Also print every worker's action list."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Plan one failure case: per stage the live workers, micro-batches each and bubble share; the
    iteration time and throughput relative to fault-free 1F1B; the planner's time."""
    from frenzy_prefect.recycle.failures import key_from_stages
    from frenzy_prefect.recycle.fault_free import costs_from_fault_free_step
    from frenzy_prefect.recycle.planners import planner
    from frenzy_prefect.recycle.schedule import one_f_one_b
    from frenzy_prefect.recycle.timeline import run_timeline, steady_state_period_s

    def body() -> None:
        run = planner(planner_name)
        costs = costs_from_fault_free_step(step_s, dp, pp, microbatches)
        key = key_from_stages(dp, pp, _failed_stages(fail))
        result = run(dp, pp, microbatches, key, costs, memory_bound)
        timeline = run_timeline(result.schedule, costs)
        period = steady_state_period_s(result.schedule, costs)
        fault_free_period = steady_state_period_s(one_f_one_b(dp, pp, microbatches), costs)
        stages = []
        for s in range(pp):
            live = result.schedule.live(s)
            stages.append({
                "stage": s, "live_workers": len(live),
                "microbatches_per_worker": [result.schedule.compute_counts((p, s)) for p in live],
                "bubble_fraction": sum(timeline.bubble_fraction((p, s)) for p in live) / len(live),
            })  # fmt: skip
        out = {
            "dp": dp, "pp": pp, "microbatches": microbatches, "failures_per_stage": list(key), "planner": result.planner,
            "status": result.status, "mip_gap": result.mip_gap, "iteration_s": result.iteration_s, "fault_free_s": result.fault_free_s,
            "relative_throughput": result.relative_throughput, "planner_wall_s": result.planner_wall_s, "memory_bound": memory_bound,
            "steady_state_period_s": period, "steady_state_relative_throughput": fault_free_period / period, "stages": stages,
        }  # fmt: skip
        if actions:
            out["actions"] = {f"{p},{s}": result.schedule.render((p, s)) for p, s in sorted(result.schedule.programs)}
        if as_json:
            typer.echo(json.dumps(out))
            return
        table = Table(title=f"dp={dp} pp={pp} microbatches={microbatches}, failures per stage {list(key)}, planner {result.planner}")
        for column in ("stage", "live", "micro-batches each", "bubble"):
            table.add_column(column, justify="right")
        for st in stages:
            table.add_row(str(st["stage"]), str(st["live_workers"]), ", ".join(map(str, st["microbatches_per_worker"])), f"{st['bubble_fraction']:.1%}")
        console = Console()
        console.print(table)
        gap = f", gap {result.mip_gap:.2%}" if result.mip_gap is not None else ""
        console.print(
            f"iteration {result.iteration_s:.4g} s (fault-free 1F1B {result.fault_free_s:.4g} s): "
            f"{result.relative_throughput:.1%} of fault-free throughput; planned in {result.planner_wall_s * 1e3:.1f} ms ({result.status}{gap})"
        )
        console.print(f"back to back (staggered optimizer steps): {period:.4g} s per iteration, {out['steady_state_relative_throughput']:.1%} of fault-free")
        for worker, program in out.get("actions", {}).items():
            console.print(f"({worker}): {program}", soft_wrap=True)

    _guarded(body)


if __name__ == "__main__":
    sys.exit(app())
