"""`frenzy recycle simulate` and `recycle plan`: training through failures by re-routing micro-batches."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from frenzy_prefect.cli.common import echo_json, print_metrics
from frenzy_prefect.errors import FrenzyError


def _knobs(items: list[str]):
    """``--knob NAME=VALUE`` overrides, validated as simulation constants."""
    from frenzy_prefect.recycle.knobs import Knobs

    overrides = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name.strip() not in Knobs.model_fields:
            raise FrenzyError(f"--knob {item!r}: expected NAME=VALUE with NAME one of {', '.join(Knobs.model_fields)}")
        overrides[name.strip()] = value.strip()
    return Knobs.model_validate(overrides)


def simulate(
    trace: Path = typer.Option(..., "--trace", help="Node trace CSV: time_ms,add|remove,nodeN per line."),
    dp: int = typer.Option(..., "--dp", min=1, help="Data-parallel pipelines."),
    pp: int = typer.Option(..., "--pp", min=1, help="Pipeline stages."),
    microbatches: int = typer.Option(..., "--microbatches", min=1, help="Micro-batches per pipeline per iteration."),
    policy: str = typer.Option("recycle", "--policy", help="recycle, checkpoint_restart, drop_pipeline, oobleck, bamboo or adaptive."),
    step_time_table: Path | None = typer.Option(
        None, "--step-time-table", help='JSON {"alive workers": fault-free step seconds}; default: the throughput model.'
    ),
    samples_per_step: int | None = typer.Option(
        None,
        "--samples-per-step",
        min=1,
        help="Global batch in samples: required with --step-time-table (its steps' batch); default dp * microbatches otherwise.",
    ),
    model: str = typer.Option("gpt2-xl", "--model", help="Throughput model only: preset name or HF config.json."),
    gpu: str = typer.Option("A100-80GB", "--gpu", help="Throughput model only: a catalog GPU type."),
    mapping: Path | None = typer.Option(None, "--mapping", help="nodeN,pipeline,stage lines; default pipeline-major by node number."),
    horizon_s: float | None = typer.Option(None, "--horizon-s", help="Measured window from the first event; default: to the last event."),
    knob: list[str] = typer.Option(
        [], "--knob", help="Override a simulation constant, NAME=VALUE (repeatable), e.g. checkpoint_interval_s=600."
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Throughput of data x pipeline parallel training through a node failure trace, under one policy."""
    from frenzy_prefect.recycle.iteration import from_preset, from_step_time_table, load_step_time_table
    from frenzy_prefect.recycle.membership import load_mapping
    from frenzy_prefect.recycle.policies import make_policy
    from frenzy_prefect.recycle.replay import simulate as replay
    from frenzy_prefect.recycle.traces import load_failure_trace

    if step_time_table is not None and samples_per_step is None:
        raise FrenzyError("--step-time-table needs --samples-per-step: the global batch in samples that one step of the table processes")
    chosen = make_policy(policy)
    knobs = _knobs(knob)
    if step_time_table is not None:
        times = from_step_time_table(load_step_time_table(step_time_table), dp=dp, pp=pp, microbatches=microbatches)
    else:
        times = from_preset(model, gpu, dp=dp, pp=pp, microbatches=microbatches)
    homes = load_mapping(mapping, dp, pp) if mapping else None
    result = replay(
        times,
        load_failure_trace(trace),
        chosen,
        samples_per_iteration=samples_per_step or dp * microbatches,
        knobs=knobs,
        homes=homes,
        horizon_s=horizon_s,
    )
    if as_json:
        typer.echo(result.model_dump_json())
        return
    rows = [
        ("throughput (window)", f"{result.throughput:.2f} samples/s, {result.ratio:.1%} of fault-free"),
        ("throughput (training span)", f"{result.span_throughput:.2f} samples/s, {result.span_ratio:.1%} of fault-free"),
        ("fault-free throughput", f"{result.fault_free_throughput:.2f} samples/s"),
        ("window", f"{result.horizon_s / 3600:.2f} h from t={result.start_s:g} s, {result.workers_at_start} workers at start"),
        ("recovery events", ", ".join(f"{k} {n}" for k, n in result.counts.items() if k != "start") or "none"),
        ("downtime / stalled", f"{result.downtime_s:.0f} s / {result.stalled_s:.0f} s"),
        ("samples lost to rollbacks", str(result.lost_samples)),
        ("stages that lost every replica", str(result.stage_wipeouts)),
        ("nodes outside the grid / spare fills", f"{result.nodes_outside_grid} / {result.spare_fills}"),
    ]
    print_metrics(f"{trace.name}: {dp} x {pp} grid, {microbatches} micro-batches, policy {result.policy}", rows)


def _failed_stages(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise FrenzyError(f"--fail takes 0-based stage numbers separated by commas (e.g. 2,2,5), got {text!r}") from None


def plan(
    dp: int = typer.Option(..., "--dp", help="Data-parallel pipelines (replicas of every stage)."),
    pp: int = typer.Option(..., "--pp", help="Pipeline stages."),
    microbatches: int = typer.Option(..., "--microbatches", help="Micro-batches per pipeline per iteration."),
    fail: str = typer.Option(
        "", "--fail", help="Failed workers' stages, 0-based, comma-separated: 2,2,5 = two failures in stage 2, one in stage 5."
    ),
    planner_name: str = typer.Option("heuristic", "--planner", help="heuristic or milp."),
    step_s: float = typer.Option(1.0, "--step-s", help="Fault-free 1F1B iteration time in seconds (costs follow from it: F:B:W = 1:1:1)."),
    memory_bound: int | None = typer.Option(
        None, "--memory-bound", help="Most micro-batches a worker may hold in flight (F done, W not); default: unbounded."
    ),
    actions: bool = typer.Option(False, "--actions", help="Also print every worker's action list."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Plan one failure case: per stage the live workers, micro-batches each and bubble share; the
    iteration time and throughput relative to fault-free 1F1B; the planner's time."""
    from frenzy_prefect.recycle.case_summary import plan_case

    out = plan_case(
        dp, pp, microbatches, _failed_stages(fail), planner_name=planner_name, step_s=step_s, memory_bound=memory_bound, actions=actions
    )
    if as_json:
        echo_json(out)
        return
    table = Table(
        title=f"dp={dp} pp={pp} microbatches={microbatches}, failures per stage {out['failures_per_stage']}, planner {out['planner']}"
    )
    for column in ("stage", "live", "micro-batches each", "bubble"):
        table.add_column(column, justify="right")
    for st in out["stages"]:
        table.add_row(
            str(st["stage"]), str(st["live_workers"]), ", ".join(map(str, st["microbatches_per_worker"])), f"{st['bubble_fraction']:.1%}"
        )
    console = Console()
    console.print(table)
    gap = f", gap {out['mip_gap']:.2%}" if out["mip_gap"] is not None else ""
    console.print(
        f"iteration {out['iteration_s']:.4g} s (fault-free 1F1B {out['fault_free_s']:.4g} s): "
        f"{out['relative_throughput']:.1%} of fault-free throughput; planned in {out['planner_wall_s'] * 1e3:.1f} ms ({out['status']}{gap})"
    )
    console.print(
        f"back to back (staggered optimizer steps): {out['steady_state_period_s']:.4g} s per iteration, "
        f"{out['steady_state_relative_throughput']:.1%} of fault-free"
    )
    for worker, program in out.get("actions", {}).items():
        console.print(f"({worker}): {program}", soft_wrap=True)
