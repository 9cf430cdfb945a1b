"""Job completion time of every scheduling policy on the ElasticFlow traces, on (a) the Alibaba
v2023 GPU cluster's shape (6,212 GPUs; G2/G3 as declared in examples/clusters/alibaba-gpu-types.yaml)
and (b) a small cluster of 64 GPUs in three types (examples/clusters/three-types-64.yaml).
Each (cluster, trace, policy) is one simulation; two run at a time.

    python -m benchmarks.scheduling_jct [--traces 195job cluster01 ...] [--clusters alibaba three-types-64]
        [--policies frenzy first-fit fastest-type ilp] [--json PATH]
"""

from __future__ import annotations

import argparse
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from benchmarks import write_result
from frenzy_prefect.scheduling.inputs import load_cluster, load_trace, shared_traces
from frenzy_prefect.scheduling.jobs import sim_jobs
from frenzy_prefect.scheduling.policies import POLICIES, make_policy
from frenzy_prefect.scheduling.simulator import simulate

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "clusters"
CLUSTERS = {
    "alibaba": ("alibaba-gpu-v2023/openb_node_list_gpu_node.csv", EXAMPLES / "alibaba-gpu-types.yaml"),
    "three-types-64": (EXAMPLES / "three-types-64.yaml", None),
}
TRACES = ["195job", "cluster01", "cluster02", "cluster03", "cluster04", "cluster05"]


def one(cluster: str, trace: str, policy: str) -> dict:
    path, types = CLUSTERS[cluster]
    spec = load_cluster(shared_traces() / path if isinstance(path, str) else path, types)
    result = simulate(sim_jobs(load_trace(shared_traces() / "elasticflow" / f"{trace}.csv")), spec, make_policy(policy))
    return {"cluster": cluster, "trace": trace, **result.model_dump(exclude={"unschedulable"})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", nargs="+", default=TRACES)
    parser.add_argument("--clusters", nargs="+", default=list(CLUSTERS), choices=list(CLUSTERS))
    parser.add_argument(
        "--policies", nargs="+", default=[p for p in POLICIES if p != "frenzy-mixed"], choices=list(POLICIES)
    )  # (frenzy-mixed: benchmarks/mixed_scheduling.py)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/scheduling_jct.json"))
    args = parser.parse_args()

    cases = [(c, t, p) for c in args.clusters for t in args.traces for p in args.policies]
    with ProcessPoolExecutor(args.workers) as pool:
        futures = {pool.submit(one, *case): case for case in cases}
        for future in as_completed(futures):
            print("done:", *futures[future], f"{future.result()['wall_s']:.1f} s", flush=True)
        rows = [f.result() for f in futures]
    frenzy = {(r["cluster"], r["trace"]): r["avg_jct_s"] for r in rows if r["policy"] == "frenzy"}
    print(
        f"{'cluster':<15}{'trace':<10}{'policy':<13}{'done':>12}{'oom':>7}{'avg h':>9}{'p50 h':>8}{'p99 h':>9}"
        f"{'makespan h':>11}{'util':>7}{'GPU-h/req':>10}{'missed':>8}{'stretch':>11}{'vs frenzy':>10}{'wall s':>8}"
    )
    for r in rows:
        base = frenzy.get((r["cluster"], r["trace"]))
        r["avg_jct_vs_frenzy"] = r["avg_jct_s"] / base if base and r["avg_jct_s"] else None
        hours = lambda s: f"{s / 3600:.2f}" if s is not None else "-"  # noqa: E731
        ratio = f"{r['avg_jct_vs_frenzy']:.2f}x" if r["avg_jct_vs_frenzy"] else "-"
        print(
            f"{r['cluster']:<15}{r['trace']:<10}{r['policy']:<13}{r['jobs_completed']:>6}/{r['jobs_total']:<5}{r['out_of_memory_restarts']:>7}"
            f"{hours(r['avg_jct_s']):>9}{hours(r['p50_jct_s']):>8}{hours(r['p99_jct_s']):>9}{hours(r['makespan_s']):>11}"
            f"{r['gpu_utilization']:>7.1%}{r['gpu_hours'] / r['requested_gpu_hours']:>9.1f}x{r['deadline_misses']:>8}"
            f"{r['worst_stretch'] or 0:>10,.1f}x{ratio:>10}{r['wall_s']:>8.1f}"
        )
    write_result({"rows": rows}, args.json)


if __name__ == "__main__":
    main()
