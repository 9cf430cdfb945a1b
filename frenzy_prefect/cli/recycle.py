"""`frenzy recycle simulate` and `recycle plan`: training through failures by re-routing micro-batches."""

from __future__ import annotations

from pathlib import Path

import typer

from frenzy_prefect.cli.common import echo_json, plain_table, print_metrics, print_table
from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.units import duration, gib


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
    policy: str = typer.Option(
        "recycle",
        "--policy",
        help="recycle, checkpoint_restart, drop_pipeline, oobleck, bamboo or adaptive; ceiling: free switches, what no policy exceeds.",
    ),
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
        ("window", f"{duration(result.horizon_s)} from t={duration(result.start_s)}, {result.workers_at_start} workers at start"),
        ("recovery events", ", ".join(f"{k} {n}" for k, n in result.counts.items() if k != "start") or "none"),
        ("downtime / stalled", f"{duration(result.downtime_s)} / {duration(result.stalled_s)}"),
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
    step_s: float = typer.Option(
        1.0,
        "--step-s",
        help="Iteration time without failures in seconds, of the planner's own schedule (the costs follow from it; F, B, W cost 1:1:1).",
    ),
    memory_bound: int | None = typer.Option(
        None, "--memory-bound", help="Most micro-batches a worker may hold in flight (F done, W not); default: unbounded."
    ),
    actions: bool = typer.Option(False, "--actions", help="Also print every worker's action list."),
    model: str | None = typer.Option(
        None, "--model", help="Also predict each live worker's peak memory for this model (a preset or config)."
    ),
    micro_batch: int = typer.Option(1, "--micro-batch", min=1, help="With --model: sequences per micro-batch."),
    seq_len: int | None = typer.Option(None, "--seq-len", help="With --model: tokens per sequence (default: the model's longest)."),
    precision: str = typer.Option("bf16", "--precision", help="With --model: fp32, bf16 or fp16."),
    gpu: str | None = typer.Option(None, "--gpu", help="With --model: a catalog GPU type, to add what it holds around the tensors."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Plan one failure case: per stage the live workers, micro-batches each and bubble share; the
    iteration time and throughput relative to the planner's schedule without failures; the planner's
    time; with --model, each live worker's predicted peak memory under the case's schedule."""
    from frenzy_prefect.recycle.case_summary import plan_case

    memory = _worker_memory(model, dp, microbatches, micro_batch, seq_len, precision, gpu) if model else None
    out = plan_case(
        dp,
        pp,
        microbatches,
        _failed_stages(fail),
        planner_name=planner_name,
        step_s=step_s,
        memory_bound=memory_bound,
        actions=actions,
        memory=memory,
    )
    if as_json:
        echo_json(out)
        return
    print_case(out)


def _worker_memory(model: str, dp: int, microbatches: int, micro_batch: int, seq_len: int | None, precision: str, gpu: str | None):
    from frenzy_prefect.cli.common import gpu_type
    from frenzy_prefect.profiling.model import resolve_model
    from frenzy_prefect.recycle.case_summary import WorkerMemory
    from frenzy_prefect.spec.workload import Workload

    spec = resolve_model(model, seq_len)
    work = Workload(global_batch=dp * microbatches * micro_batch, seq_len=seq_len or spec.max_seq_len, precision=precision)
    return WorkerMemory(spec, work, micro_batch, gpu_type(gpu) if gpu else None)


def print_case(out: dict) -> None:
    """`recycle plan`'s table and summary, from its JSON."""
    table = plain_table()
    peaks = "memory" in out
    for column in ("stage", "live", "micro-batches each", "bubble", *(["peak each, GiB"] if peaks else [])):
        table.add_column(column, justify="right")
    for st in out["stages"]:
        counts = ", ".join(map(str, st["microbatches_per_worker"]))
        row = [str(st["stage"]), str(st["live_workers"]), counts, f"{st['bubble_fraction']:.1%}"]
        fits = st.get("fits_per_worker", [True] * st["live_workers"])
        cells = [gib(b) + ("" if fit else " (over)") for b, fit in zip(st.get("peak_bytes_per_worker", []), fits, strict=False)]
        table.add_row(*row, *([", ".join(cells)] if peaks else []))
    title = f"dp={out['dp']} pp={out['pp']} microbatches={out['microbatches']}, failures per stage {out['failures_per_stage']}"
    console = print_table(f"{title}, planner {out['planner']}", table)
    gap = f", gap {out['mip_gap']:.2%}" if out["mip_gap"] is not None else ""
    console.print(
        f"iteration {duration(out['iteration_s'])} against {duration(out['fault_free_s'])} without failures (the same planner's "
        f"schedule): {out['relative_throughput']:.1%} of its throughput; "
        f"planned in {duration(out['planner_wall_s'])} ({out['status']}{gap})"
    )
    console.print(
        f"back to back (staggered optimizer steps): {duration(out['steady_state_period_s'])} per iteration, "
        f"{out['steady_state_relative_throughput']:.1%} of the same without failures"
    )
    if over := _over_the_gpu(out):
        console.print(over)
    for worker, program in out.get("actions", {}).items():
        console.print(f"({worker}): {program}", soft_wrap=True)


def _over_the_gpu(out: dict) -> str | None:
    """With --model and --gpu: the line saying how many live workers' peaks exceed the GPU, if any do."""
    fits = [fit for st in out["stages"] for fit in st.get("fits_per_worker", [])]
    if all(fits):
        return None
    memory = out["memory"]
    return (
        f"{fits.count(False)} of {len(fits)} live workers exceed {memory['gpu']}'s usable {gib(memory['usable_bytes'], 1)} GiB "
        f"({gib(memory['gpu_memory_bytes'], 1)} GiB less the default margin): lower --micro-batch or --seq-len, add stages (--pp) "
        "or bound the micro-batches in flight (--memory-bound)"
    )
