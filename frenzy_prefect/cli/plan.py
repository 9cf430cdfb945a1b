"""`frenzy plan`: HAS on an idle cluster, the ranked feasible plans and the chosen placement."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from frenzy_prefect.cli.common import ATTENTION, MASTER_WEIGHTS, echo_json, plain_table, print_table, training_request
from frenzy_prefect.units import duration, gib, usd

if TYPE_CHECKING:
    from frenzy_prefect.spec.cluster import ClusterSpec
    from frenzy_prefect.spec.plan import Allocation, ParallelPlan, PlanCandidate

if TYPE_CHECKING:  # the core is imported when a command runs, not when the CLI starts
    from frenzy_prefect.spec.plan import Allocation, PlanCandidate


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
    mixed: bool = typer.Option(
        False, "--mixed", help="Also the plans across two GPU types (predicted; HAS chooses one where it is worth it)."
    ),
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
    from frenzy_prefect.allocator.across import allocate_across
    from frenzy_prefect.allocator.mixed import across_types_hint, cluster_candidates
    from frenzy_prefect.errors import NoFeasiblePlan

    state = ClusterState.idle(ClusterSpec.from_file(cluster))
    across = cluster_candidates(spec, request.workload, state.cluster)[:top] if mixed else None
    try:
        candidates = allocator.candidate_plans(spec, request, state.cluster)
    except NoFeasiblePlan:
        if not across:
            raise
        candidates = []
    chosen, nothing = None, None
    if candidates:
        try:
            chosen = allocator.allocate(candidates, state)
        except NoFeasiblePlan as error:  # plans on one type run, and none fits
            nothing = error
    single_s = chosen.step_time_s if chosen else None
    chosen = allocate_across(spec, request, state, chosen) or chosen  # as the train-llm flow's HAS decides
    if chosen is None and not across and nothing is not None:
        hint = None if mixed else across_types_hint(spec, request.workload, state.cluster)
        raise NoFeasiblePlan(f"{nothing}; {hint}" if hint else str(nothing))
    ranked = [c for c in candidates if c.fits][:top]
    if as_json:
        echo_json(plans_json(ranked, chosen) | ({} if across is None else {"mixed": mixed_json(across, single_s)}))
        return
    title = f"{model}, global batch {global_batch} x {seq_len} tokens, on {state.cluster.name}"
    if chosen:
        print_plans(title, state.cluster, ranked, chosen, steps)
    if across is not None:
        print_mixed(title, across, single_s)


def mixed_json(found: list, single_s: float | None) -> list[dict]:
    """`frenzy plan --mixed --json`: each plan across types, its predicted step and peaks, and whether it beats ``single_s``."""
    from frenzy_prefect.allocator.mixed import worth_mixing

    return [
        {
            "plan": c.plan.model_dump(),
            "step_time_s": c.step_s,
            "peak_bytes": list(c.peaks),
            "worth_mixing": worth_mixing(c.step_s, single_s),
        }
        for c in found
    ]


def print_mixed(title: str, found: list, single_s: float | None) -> None:
    """The plans across types, each with whether it beats the chosen single-type plan by MIXED_GAIN."""
    from collections import Counter

    from frenzy_prefect.allocator.mixed import MIXED_GAIN, worth_mixing

    against = "no plan on one type fits" if single_s is None else f"the chosen plan's step: {duration(single_s)}"
    table = plain_table(caption=f"across two GPU types (predicted; worth it: {MIXED_GAIN:g}x faster than {against})")
    for column in ("#", "GPUs", "plan", "layers or batches", "step", "worth it"):
        table.add_column(column, justify="left" if column in ("GPUs", "plan", "layers or batches") else "right")
    for i, c in enumerate(found, 1):
        p = c.plan
        types = p.worker_types
        per = p.dp * p.tp if p.stage_types else p.tp
        gpus = " + ".join(f"{n * per} x {t}" for t, n in Counter(types).items())
        split = "/".join(map(str, p.stage_layers or p.replica_micro_batches or ()))
        table.add_row(str(i), gpus, compact_plan(p), split, duration(c.step_s), "yes" if worth_mixing(c.step_s, single_s) else "no")
    print_table(f"{title}, across types", table)


def plans_json(ranked: list[PlanCandidate], chosen: Allocation | None) -> dict:
    """`frenzy plan --json`: the ranked fitting plans and the chosen placement (a contract: docs/architecture.md)."""
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
    return {"plans": plans, "chosen": None if chosen is None else chosen.model_dump(mode="json")}


def compact_plan(p: ParallelPlan) -> str:
    """A plan in a table cell: ``dp2 tp1 pp2 mb8 z1``, and ``rc=selective`` or ``rc=full`` when it recomputes."""
    recompute = "" if p.recompute == "none" else f" rc={p.recompute}"
    return f"dp{p.dp} tp{p.tp} pp{p.pp} mb{p.micro_batch} z{p.zero}{recompute}"


def print_plans(title: str, cluster: ClusterSpec, ranked: list[PlanCandidate], chosen: Allocation, steps: int) -> None:
    """The ranked plans as a table that fits 80 columns (each GPU type's memory in the caption; a
    total column only for more than one step, a cost column only where the cluster has prices),
    then the chosen placement."""
    with_total, with_cost = steps > 1, any(c.cost is not None for c in ranked)
    table = plain_table(caption=_plans_caption(cluster, ranked, steps if with_total or with_cost else None))
    columns = ["#", "GPUs", "plan", "peak\nGiB", "spare\nGiB", "step"] + ["total"] * with_total + ["cost"] * with_cost
    for column in columns:
        table.add_column(column, justify="left" if column in ("GPUs", "plan") else "right")
    for i, c in enumerate(ranked, 1):
        cells = [str(i), f"{c.plan.gpus} x {c.gpu_type}", compact_plan(c.plan), gib(c.memory.peak_bytes, 2), gib(c.spare_bytes, 2)]
        cells += [duration(c.step_time_s)] + [duration(c.total_time_s)] * with_total + [usd(c.cost)] * with_cost
        table.add_row(*cells)
    console = print_table(title, table)
    placed = ", ".join(f"{p.node} GPUs {p.gpus}" for p in chosen.placements)
    console.print(f"chosen: {chosen.plan.gpus} x {chosen.gpu_type}, {chosen.plan.label()} on {placed}")
    console.print(chosen.fit_summary())


def _plans_caption(cluster: ClusterSpec, ranked: list[PlanCandidate], steps: int | None) -> str:
    margin = cluster.memory_margin
    memory = ", ".join(f"{t} {gib(b, 1)} GiB" for t, b in dict.fromkeys((c.gpu_type, c.gpu_memory_bytes) for c in ranked))
    total = "" if steps is None else f"; total and cost: of {steps} steps" if steps > 1 else "; cost: of one step"
    return (
        f"plan: dp, tp, pp degrees, micro-batch, ZeRO stage, recomputation{total}. peak: predicted tensors and the GPU "
        f"around them, per GPU ({memory}); spare: what is left after a margin of max({margin.fraction:.0%} of the GPU, "
        f"{gib(margin.floor_bytes, 1)} GiB)"
    )
