"""`frenzy simulate`: a job trace replayed on a cluster under one scheduling policy."""

from __future__ import annotations

from pathlib import Path

import typer

from frenzy_prefect.cli.common import print_metrics
from frenzy_prefect.units import duration


def _time(seconds: float | None) -> str:
    return "-" if seconds is None else duration(seconds)


def _memory_truth(table: bool, exact: bool, seed: int) -> str:
    if table:
        return "the throughput table's (its rows fit)"
    return "the estimate" if exact else f"published errors, seed {seed}"


def simulate(
    trace: Path = typer.Option(..., "--trace", help="ElasticFlow job trace CSV, or a Sia workload CSV (with --throughput-table)."),
    cluster: Path = typer.Option(..., "--cluster", help="Alibaba v2023 node-list CSV, or a cluster file (YAML/JSON)."),
    policy: str = typer.Option("frenzy", "--policy", help="frenzy, frenzy-mixed (across GPU types), first-fit, fastest-type or ilp."),
    gpu_types: Path | None = typer.Option(None, "--gpu-types", help="YAML declaring GPU types the catalog lacks (e.g. Alibaba's G2, G3)."),
    seed: int = typer.Option(
        0, "--seed", help="Seeds each job's true peak memory: its estimate off by one of MARP's published GPU-run errors."
    ),
    exact_memory: bool = typer.Option(False, "--exact-memory", help="True peak memory = MARP's estimate (no estimate is ever wrong)."),
    objective: str | None = typer.Option(None, "--objective", help="frenzy ranks plans by time (the default), gpu-hours or cost (prices)."),
    stretch_bound: float | None = typer.Option(
        None, "--stretch-bound", help="frenzy starts no run longer than this x the longer of its request and its fastest plan (2)."
    ),
    copies: int = typer.Option(1, "--replicate", min=1, help="The cluster's nodes N times over (names suffixed -r0..), to scale it."),
    throughput_table: Path | None = typer.Option(
        None, "--throughput-table", help="CSV of step times per model, batch, GPU type and count, for a Sia workload's jobs."
    ),
    per_job: bool = typer.Option(False, "--per-job", help="With --json: list every completed job (arrival, start, end, JCT, GPUs)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Replay a job trace on a cluster under one scheduling policy."""
    from frenzy_prefect.scheduling.inputs import load_cluster, replicate
    from frenzy_prefect.scheduling.policies import make_policy
    from frenzy_prefect.scheduling.simulator import simulate as run
    from frenzy_prefect.scheduling.throughput import ThroughputTable
    from frenzy_prefect.scheduling.truth import MemoryTruth
    from frenzy_prefect.scheduling.workloads import load_jobs

    options = {k: v for k, v in (("objective", objective), ("stretch_bound", stretch_bound)) if v is not None}
    chosen = make_policy(policy, **options)
    spec = replicate(load_cluster(cluster, gpu_types), copies)
    table = ThroughputTable.load(throughput_table) if throughput_table else None
    jobs = load_jobs(trace, list(dict.fromkeys(n.gpu_type for n in spec.nodes)), table)
    result = run(jobs, spec, chosen, MemoryTruth(seed=seed, exact=exact_memory), table, records=per_job)
    if as_json:
        typer.echo(result.model_dump_json())
        return
    rows = [
        ("jobs completed", f"{result.jobs_completed} / {result.jobs_total}"),
        ("unschedulable", str(result.jobs_unschedulable)),
        ("out-of-memory restarts", str(result.out_of_memory_restarts)),
        ("true peak memory", _memory_truth(table is not None, exact_memory, seed)),
        ("average JCT", _time(result.avg_jct_s)),
        ("p50 JCT", _time(result.p50_jct_s)),
        ("p99 JCT", _time(result.p99_jct_s)),
        ("makespan", _time(result.makespan_s)),
        ("GPU utilisation", f"{result.gpu_utilization:.1%}"),
        ("GPU-hours held / requested", f"{result.gpu_hours:,.0f} / {result.requested_gpu_hours:,.0f}"),
        ("deadline misses", f"{result.deadline_misses} of {result.jobs_completed}"),
        ("worst stretch (JCT / request)", "-" if result.worst_stretch is None else f"{result.worst_stretch:,.1f}x"),
        ("worst run stretch", "-" if result.worst_run_stretch is None else f"{result.worst_run_stretch:,.2f}x"),
        ("decision latency p50 / p99", f"{result.decision_latency_ms.p50:.3f} / {result.decision_latency_ms.p99:.3f} ms"),
    ]
    print_metrics(f"{trace.name} on {cluster.name} ({result.cluster_gpus} GPUs), policy {result.policy}", rows)
