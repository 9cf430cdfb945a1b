"""`frenzy plan`: HAS on an idle cluster, the ranked feasible plans and the chosen placement."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from frenzy_prefect.cli.common import ATTENTION, MASTER_WEIGHTS, echo_json, training_request
from frenzy_prefect.units import gib


def plan(
    model: str = typer.Argument(..., help="Preset name or path/URI of an HF-style config.json."),
    global_batch: int = typer.Option(..., "--global-batch"),
    seq_len: int = typer.Option(..., "--seq-len"),
    cluster: Path = typer.Option(..., "--cluster", help="Cluster file (YAML or JSON)."),
    precision: str = typer.Option("bf16", "--precision", help="fp32, bf16 or fp16."),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw, adam or sgd."),
    attention: str = ATTENTION,
    master_weights: bool = MASTER_WEIGHTS,
    tp: int | None = typer.Option(None, "--tp", help="Pin the tensor-parallel degree (default: the allocator chooses)."),
    pp: int | None = typer.Option(None, "--pp", help="Pin the pipeline depth (default: the allocator chooses)."),
    resilience: str = typer.Option(
        "restart", "--resilience", help="restart or recycle (ReCycle: only the pipeline plans it can keep running through a failure)."
    ),
    steps: int = typer.Option(1, "--steps", min=1, help="Optimizer steps: the plans' total time and cost are for this many."),
    objective: str = typer.Option("time", "--objective", help="time (the fastest plan) or cost (the cheapest: needs prices)."),
    deadline_hours: float | None = typer.Option(None, "--deadline-hours", help="Only plans predicted to finish the steps in time."),
    top: int = typer.Option(10, "--top", min=1, help="How many ranked plans to show."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """HAS on an idle cluster: the ranked feasible plans (MARP) and the chosen placement."""
    from frenzy_prefect import allocator
    from frenzy_prefect.profiling.model import resolve_model
    from frenzy_prefect.spec.cluster import ClusterSpec, ClusterState

    spec = resolve_model(model, seq_len=seq_len)
    pin = {"tp": tp, "pp": pp} if tp is not None or pp is not None else None
    request = training_request(
        model,
        global_batch,
        seq_len,
        precision,
        optimizer,
        attention,
        master_weights,
        pin,
        resilience=resilience,
        steps=steps,
        objective=objective,
        deadline_hours=deadline_hours,
    )
    state = ClusterState.idle(ClusterSpec.from_file(cluster))
    candidates = allocator.candidate_plans(spec, request, state.cluster)
    chosen = allocator.allocate(candidates, state)
    ranked = [c for c in candidates if c.fits][:top]
    if as_json:
        plans = [
            {
                "gpu_type": c.gpu_type,
                "gpus": c.plan.gpus,
                "plan": c.plan.model_dump(),
                "peak_bytes": c.memory.peak_bytes,
                "gpu_memory_bytes": c.gpu_memory_bytes,
                "margin_bytes": c.margin_bytes,
                "spare_bytes": c.spare_bytes,
                "step_time_s": c.step_time_s,
                "total_time_s": c.total_time_s,
                "cost": c.cost,
            }
            for c in ranked
        ]
        echo_json({"plans": plans, "chosen": chosen.model_dump(mode="json")})
        return
    margin = state.cluster.memory_margin
    table = Table(
        title=f"{model}, global batch {global_batch} x {seq_len} tokens, on {state.cluster.name}",
        caption=f"peak: predicted tensors and the GPU around them; spare: what is left after a margin of "
        f"max({margin.fraction:.0%} of the GPU, {gib(margin.floor_bytes, 1)} GiB)",
    )
    columns = (
        "#",
        "GPUs",
        "type",
        "dp",
        "tp",
        "pp",
        "mb",
        "ZeRO",
        "recompute",
        "peak GiB",
        "of GiB",
        "spare GiB",
        "step s",
        "total h",
        "cost",
    )
    for column in columns:
        table.add_column(column, justify="left" if column in ("type", "recompute") else "right")
    for i, c in enumerate(ranked, 1):
        p = c.plan
        table.add_row(
            *map(
                str,
                (
                    i,
                    p.gpus,
                    c.gpu_type,
                    p.dp,
                    p.tp,
                    p.pp,
                    p.micro_batch,
                    p.zero,
                    p.recompute,
                    gib(c.memory.peak_bytes, 2),
                    gib(c.gpu_memory_bytes, 2),
                    gib(c.spare_bytes, 2),
                ),
            ),
            f"{c.step_time_s:.4g}",
            f"{c.total_time_s / 3600:.3g}",
            "-" if c.cost is None else f"{c.cost:.4g}",
        )
    console = Console()
    console.print(table)
    placed = ", ".join(f"{p.node} GPUs {p.gpus}" for p in chosen.placements)
    console.print(f"chosen: {chosen.plan.gpus} x {chosen.gpu_type}, {chosen.plan.label()} on {placed}")
    console.print(
        f"predicted peak {gib(chosen.memory.peak_bytes, 1)} GiB of {gib(chosen.gpu_memory_bytes, 1)} GiB per GPU: fits with "
        f"{gib(chosen.spare_bytes, 1)} GiB to spare (margin {gib(chosen.margin_bytes, 1)} GiB kept)"
    )
