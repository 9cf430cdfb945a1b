"""The `frenzy` command line. Subcommands and their --json output are a contract (DESIGN.md 4).
Bad input prints one line on stderr and exits 2; no traceback."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from pydantic import ValidationError

from frenzy_prefect.errors import FrenzyError, describe_validation_error
from frenzy_prefect.spec.plan import MemoryEstimate, ParallelPlan
from frenzy_prefect.spec.request import TrainingRequest
from frenzy_prefect.units import gib

app = typer.Typer(help="Memory-aware LLM training on heterogeneous GPU clusters.", no_args_is_help=True, pretty_exceptions_enable=False)
cluster_app = typer.Typer(help="Cluster inventories (FrenzyCluster blocks).", no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")


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


def _request(model: str, global_batch: int, seq_len: int, precision: str, optimizer: str) -> TrainingRequest:
    """The workload a command describes, validated as a training request (it names no dataset),
    so that bad values get the same one-line errors as in a flow."""
    return TrainingRequest(
        model=model, dataset="-", global_batch=global_batch, seq_len=seq_len, steps=1,
        precision=precision, optimizer={"name": optimizer},
    )  # fmt: skip


def memory_json(estimate: MemoryEstimate, plan: ParallelPlan) -> dict[str, Any]:
    """The estimate/measure schema: peak over ranks, then every rank with its stage's breakdown."""
    per_rank = []
    for rank in range(plan.gpus):
        stage = rank // (plan.dp * plan.tp)  # ranks numbered stage-major, tp innermost
        b = estimate.per_stage[stage]
        per_rank.append(
            {
                "rank": rank,
                "stage": stage,
                "peak_bytes": b.total,
                "breakdown": b.model_dump(),
            }
        )
    return {"peak_bytes": estimate.peak_bytes, "per_rank": per_rank, "plan": plan.model_dump()}


@app.command()
def estimate(
    model: str = typer.Argument(..., help="Preset name or path/URI of an HF-style config.json."),
    dp: int = typer.Option(1, "--dp"),
    tp: int = typer.Option(1, "--tp"),
    pp: int = typer.Option(1, "--pp"),
    micro_batch: int = typer.Option(1, "--micro-batch"),
    global_batch: Optional[int] = typer.Option(None, "--global-batch", help="Default: dp * micro-batch."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Default: the model's max_seq_len."),
    zero: int = typer.Option(0, "--zero", help="ZeRO stage 0-3."),
    recompute: str = typer.Option("none", "--recompute", help="none, selective or full."),
    precision: str = typer.Option("bf16", "--precision", help="fp32, bf16 or fp16."),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw, adam or sgd."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU type (adds its runtime overhead; default none)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Predicted per-GPU peak memory of one plan."""
    from frenzy_prefect.memory import estimate as predict
    from frenzy_prefect.profiling.model import resolve_model
    from frenzy_prefect.spec.catalog import GPU_CATALOG

    def body() -> None:
        spec = resolve_model(model, seq_len=seq_len)
        plan = ParallelPlan(dp=dp, tp=tp, pp=pp, micro_batch=micro_batch, zero=zero, recompute=recompute)
        request = _request(model, global_batch or plan.dp * plan.micro_batch, seq_len or spec.max_seq_len, precision, optimizer)
        if gpu is not None and gpu not in GPU_CATALOG:
            raise FrenzyError(f"unknown GPU type {gpu!r}; known: {', '.join(GPU_CATALOG)}")
        result = predict(
            spec,
            plan,
            global_batch=request.global_batch,
            seq_len=request.seq_len,
            precision=request.precision,
            optimizer_bytes_per_param=request.optimizer.state_bytes_per_parameter,
            gpu=GPU_CATALOG[gpu] if gpu else None,
        )
        out = memory_json(result, plan) | {"model": spec.name, "parameters": spec.parameters, "seq_len": request.seq_len}
        if as_json:
            typer.echo(json.dumps(out))
        else:
            typer.echo(f"{spec.name} ({spec.parameters:,} parameters), {plan.label()}: peak {gib(result.peak_bytes)} GiB per GPU")
            for stage, b in enumerate(result.per_stage):
                typer.echo(
                    f"  stage {stage}: params {gib(b.params)}  grads {gib(b.grads)}  optimizer {gib(b.optimizer)}"
                    f"  activations {gib(b.activations)}  other {gib(b.other)}  GiB"
                )

    _guarded(body)


@app.command()
def plan(
    model: str = typer.Argument(..., help="Preset name or path/URI of an HF-style config.json."),
    global_batch: int = typer.Option(..., "--global-batch"),
    seq_len: int = typer.Option(..., "--seq-len"),
    cluster: Path = typer.Option(..., "--cluster", help="Cluster file (YAML or JSON)."),
    precision: str = typer.Option("bf16", "--precision", help="fp32, bf16 or fp16."),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw, adam or sgd."),
    top: int = typer.Option(10, "--top", help="How many ranked plans to show."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Ranked feasible plans for a job on a cluster, and the chosen placement."""
    from frenzy_prefect import allocator
    from frenzy_prefect.profiling.model import resolve_model
    from frenzy_prefect.spec.cluster import ClusterSpec, ClusterState

    def body() -> None:
        spec = resolve_model(model, seq_len=seq_len)
        request = _request(model, global_batch, seq_len, precision, optimizer)
        state = ClusterState.idle(ClusterSpec.from_file(cluster))
        candidates = allocator.candidate_plans(spec, request, state.cluster)
        chosen = allocator.allocate(candidates, state)
        ranked = [c for c in candidates if c.fits][:top]
        if as_json:
            typer.echo(
                json.dumps(
                    {
                        "plans": [
                            {"gpu_type": c.gpu_type, "gpus": c.plan.gpus, "plan": c.plan.model_dump(), "peak_bytes": c.memory.peak_bytes, "step_time_s": c.step_time_s}
                            for c in ranked
                        ],
                        "chosen": chosen.model_dump(mode="json"),
                    }
                )
            )
            return
        for c in ranked:
            typer.echo(f"{c.plan.gpus:>3} x {c.gpu_type:<10} {c.plan.label():<48} {gib(c.memory.peak_bytes):>8} GiB  {c.step_time_s:.4g} s/step")
        placed = ", ".join(f"{p.node}{p.gpus}" for p in chosen.placements)
        typer.echo(f"chosen: {chosen.plan.gpus} x {chosen.gpu_type}, {chosen.plan.label()} on {placed}")

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


if __name__ == "__main__":
    sys.exit(app())
