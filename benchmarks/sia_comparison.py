"""HAS against Sia (SOSP'23) on Sia's own workloads: the same jobs, the same 64 GPUs of three types
and the same speeds, replayed by our simulator (every policy) and by Sia's artifact simulator
(Sia as published, Sia with its batch sizes fixed, Sia with every job rigid, Gavel).

- Jobs: Sia's workload files (benchmarks/data/sia/workloads, copied from siasosp23/artifacts at
  aaf7a0d, `sia-simulator/workloads/{saturn,philly}`), read by `frenzy simulate` as they are.
- Cluster: Sia's default (benchmarks/data/sia/cluster.yaml: 6 x 4 T4, 3 x 8 RTX 2080Ti, 2 x 8
  A100-40GB), which its simulator has built in.
- Speeds and work: benchmarks/data/sia/throughput.csv, written from Sia's own profiles by
  benchmarks/sia_table.py (per model, batch, type and GPU count: the iteration time Sia's Gavel
  port predicts at a fixed batch; per job: its start-up cost and its iterations at that batch).

Sia runs in its own Python (`scripts/sia-setup` prints SIA_ARTIFACT and SIA_PYTHON). What is not
like for like, and which run isolates it: Sia tunes batch sizes, which cuts the samples a job
needs (`sia-fixed-batch` turns that off); Sia resizes and preempts jobs every 60 s round,
paying each job's start-up again on every change (`sia-rigid` holds each job to its requested
GPUs and batch; it may still suspend and resume it); Sia decides only at round ends, HAS at every
arrival and completion; our simulator charges the start-up once per run.

    SIA_ARTIFACT=... SIA_PYTHON=... python -m benchmarks.sia_comparison
        [--workloads saturn/workload-1 ...] [--systems frenzy ilp sia sia-fixed-batch ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from benchmarks import write_result
from frenzy_prefect.scheduling.inputs import load_cluster, load_sia_workload
from frenzy_prefect.scheduling.policies import make_policy
from frenzy_prefect.scheduling.simulator import simulate
from frenzy_prefect.scheduling.throughput import ThroughputTable
from frenzy_prefect.scheduling.workloads import load_jobs

DATA = Path(__file__).resolve().parent / "data" / "sia"
SIA_ARGS = ["--policy=sia", "--policy_p_val=-0.5", "--mip_lambda_a=0.01", "--mip_lambda_n=1.1", "--interval=60"]
SIA_ARGS += ["--project_throughputs", "--share_max_replicas"]  # as its run_experiment.sh
SIA_SYSTEMS = {
    "sia": SIA_ARGS,
    "sia-fixed-batch": [*SIA_ARGS, "--disable_bsz_tuning"],
    "sia-rigid": SIA_ARGS,  # with every job's category "rigid"
    "gavel": ["--policy=gavel", "--interval=360"],
}
HAS_SYSTEMS = {
    "frenzy": {},
    "frenzy-gpu-hours": {"objective": "gpu-hours"},
    "ilp": {},
    "first-fit": {},
    "fastest-type": {},
}
DEFAULT_WORKLOADS = ["saturn/workload-1", "saturn/workload-2", "saturn/workload-3"]


def run_has(system: str, workload: str) -> dict[str, float]:
    spec = load_cluster(DATA / "cluster.yaml")
    table = ThroughputTable.load(DATA / "throughput.csv")
    jobs = load_jobs(DATA / "workloads" / f"{workload}.csv", list(dict.fromkeys(n.gpu_type for n in spec.nodes)), table)
    policy = make_policy(system.split("-gpu-hours")[0], **HAS_SYSTEMS[system])
    result = simulate(jobs, spec, policy, table=table, records=True)
    return {r.job_id: r.jct_s for r in result.jobs or []}


def run_sia(system: str, workload: str) -> dict[str, float]:
    """Sia's simulator on ``workload``: its printed per-job JCTs."""
    source = DATA / "workloads" / f"{workload}.csv"
    jcts, _ = sia_simulator(system, source.read_text())
    return jcts


def sia_simulator(system: str, workload_csv: str) -> tuple[dict[str, float], list[dict]]:
    """Sia's simulator on a workload's text: the per-job JCTs it prints (the last "Completed jobs:"
    dict) and its jobs as its last round logged them (GPU type and placement)."""
    artifact, python = os.environ.get("SIA_ARTIFACT"), os.environ.get("SIA_PYTHON")
    if not artifact or not python:
        raise SystemExit("set SIA_ARTIFACT and SIA_PYTHON (scripts/sia-setup prints them)")
    lines = [line for line in workload_csv.splitlines() if line]
    if system == "sia-rigid":
        lines = [lines[0] + ",category", *(line + ",rigid" for line in lines[1:])]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "workload.csv"
        path.write_text("\n".join(lines) + "\n")
        out = subprocess.run(
            [python, "multi_simulator.py", str(path), *SIA_SYSTEMS[system], f"--output={tmp}/rounds.log"],
            cwd=Path(artifact) / "sia-simulator",
            capture_output=True,
            text=True,
            timeout=3 * 3600,
        )
        rounds = (Path(tmp) / "rounds.log").read_text().splitlines() if out.returncode == 0 else []
    found = re.findall(r"Completed jobs:\n(\{.*\})", out.stdout)
    if out.returncode or not found:
        raise RuntimeError(f"{system} failed ({out.returncode}): {out.stderr[-2000:]}")
    last = json.loads(rounds[-1])["submitted_jobs"] if rounds else []
    return {name: float(jct) for name, jct in ast.literal_eval(found[-1]).items()}, last


SIA_TYPES = {"aws": "T4", "rtx": "RTX2080Ti", "dgx-ext": "A100-40GB"}  # as benchmarks/sia_table.py renames them


def speed_check() -> list[dict]:
    """The shared table against Sia's simulator: each (model, batch) of the workloads as one rigid
    job alone, at its most requested GPU count; Sia's JCT against the table's start-up plus steps
    at the step time of the type and GPU count Sia placed it on (one node or spread, as placed).
    Sia starts a job at its first round, so its JCT includes up to one 60 s round of waiting."""
    table = ThroughputTable.load(DATA / "throughput.csv")
    counts: dict[tuple[str, int], dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for path in sorted((DATA / "workloads").glob("*/*.csv")):
        for job in load_sia_workload(path):
            counts[job.application, job.batch_size][job.num_replicas] += 1
    rows = []
    for (model, batch), by_count in sorted(counts.items()):
        gpus = max(by_count, key=by_count.get)
        jcts, jobs = sia_simulator("sia-rigid", f"name,time,application,num_replicas,batch_size\n{model}-0,0,{model},{gpus},{batch}\n")
        placed = jobs[0]
        gpu_type, placement = SIA_TYPES[placed["cluster"]], [n for n in placed["placement"] if n]
        shape, row = table.shape(model, batch), table.option(model, batch, gpu_type, sum(placement))
        per_node = {"T4": 4}.get(gpu_type, 8)
        spread = len(placement) > 1 and sum(placement) <= per_node
        predicted = shape.startup_s + shape.job_steps * (row.spread_step_s if spread else row.step_s)
        sia = jcts[f"{model}-0"]
        rows.append({"model": model, "global_batch": batch, "gpus": gpus, "gpu_type": gpu_type, "placement": placement,
                     "sia_jct_s": sia, "table_s": predicted, "difference_s": sia - predicted})  # fmt: skip
    return rows


def summary(jcts: dict[str, float], total: int) -> dict:
    values = sorted(jcts.values())
    per_model: dict[str, list[float]] = defaultdict(list)
    for name, jct in jcts.items():
        per_model[name.rsplit("-", 1)[0]].append(jct)
    return {
        "jobs_completed": len(values),
        "jobs_total": total,
        "avg_jct_s": sum(values) / len(values) if values else None,
        "p99_jct_s": values[min(len(values) - 1, round(0.99 * len(values)))] if values else None,
        "avg_jct_s_by_model": {m: sum(v) / len(v) for m, v in sorted(per_model.items())},
        "jct_s": jcts,
    }


def one(system: str, workload: str) -> dict:
    started = time.perf_counter()
    jcts = run_sia(system, workload) if system in SIA_SYSTEMS else run_has(system, workload)
    total = sum(1 for line in (DATA / "workloads" / f"{workload}.csv").read_text().splitlines()[1:] if line)
    return {"workload": workload, "system": system, **summary(jcts, total), "wall_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=DEFAULT_WORKLOADS)
    parser.add_argument("--systems", nargs="+", default=[*HAS_SYSTEMS, *SIA_SYSTEMS], choices=[*HAS_SYSTEMS, *SIA_SYSTEMS])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--speed-check", action="store_true", help="Only check the shared table against Sia's simulator, job by job.")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/sia_comparison.json"))
    args = parser.parse_args()
    if args.speed_check:
        checks = speed_check()
        print(f"{'model':<13}{'batch':>6}{'GPUs':>6}  {'Sia placed on':<26}{'Sia JCT s':>10}{'table s':>10}{'Sia - table':>12}")
        for c in checks:
            where, times = f"{c['gpu_type']} {c['placement']}", f"{c['sia_jct_s']:>10.0f}{c['table_s']:>10.0f}{c['difference_s']:>12.0f}"
            print(f"{c['model']:<13}{c['global_batch']:>6}{c['gpus']:>6}  {where:<26}{times}")
        write_result({"speed_check": checks}, args.json.with_name("sia_speed_check.json"))
        return

    cases = [(s, w) for w in args.workloads for s in args.systems]
    with ProcessPoolExecutor(args.workers) as pool:  # processes: ilp silences file descriptor 1 while it solves
        rows = list(pool.map(one, *zip(*cases, strict=True)))
    sia = {r["workload"]: r["avg_jct_s"] for r in rows if r["system"] == "sia"}
    models = sorted({m for r in rows for m in r["avg_jct_s_by_model"]})
    print(f"{'workload':<20}{'system':<18}{'done':>9}{'avg h':>8}{'p99 h':>8}{'vs sia':>8}" + "".join(f"{m[:10]:>11}" for m in models))
    for r in rows:
        base = sia.get(r["workload"])
        r["avg_jct_vs_sia"] = r["avg_jct_s"] / base if base and r["avg_jct_s"] else None
        ratio = f"{r['avg_jct_vs_sia']:.2f}" if r["avg_jct_vs_sia"] else "-"
        by_model = "".join(f"{r['avg_jct_s_by_model'].get(m, 0) / 3600:>11.2f}" for m in models)
        done, hours = f"{r['jobs_completed']}/{r['jobs_total']}", f"{r['avg_jct_s'] / 3600:>8.2f}{r['p99_jct_s'] / 3600:>8.2f}"
        print(f"{r['workload']:<20}{r['system']:<18}{done:>9}{hours}{ratio:>8}{by_model}")
    means = defaultdict(list)
    for r in rows:
        if r["avg_jct_vs_sia"]:
            means[r["system"]].append(r["avg_jct_vs_sia"])
    print("\naverage JCT / Sia's, mean over workloads:", ", ".join(f"{s} {sum(v) / len(v):.2f}" for s, v in means.items()))
    write_result({"workloads": args.workloads, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
