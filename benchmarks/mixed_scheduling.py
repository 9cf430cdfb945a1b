"""Plans across GPU types in the scheduler (issue 31, item 6): ``frenzy`` against
``frenzy-mixed`` on the same jobs, cluster and memory truth, in one run.

Clusters: three-types-64 (examples/clusters) and a contended cut of the Alibaba v2023 GPU
cluster (the first CUT of each type's nodes, at least one: 143 GPUs in 7 types; G2/G3 as
declared in examples/clusters/alibaba-gpu-types.yaml). Traces: ElasticFlow's. Models: the
simulator's rule (``trace``: GPT-2 small to XL, which fit one GPU of most types) and a scenario
with larger models (``large``: each trace model a size or two up, the largest 13B), which many
free counts of one type cannot hold. The ``large`` mapping is a scenario, not a fact of the trace.

For each run: average JCT, GPU-hours, out-of-memory restarts, decision latency, how many jobs
started across types, and those jobs' waits (arrival to start) under both policies.

    python -m benchmarks.mixed_scheduling [--traces cluster01 cluster02] [--clusters ...] [--models trace large] [--json PATH]
"""

from __future__ import annotations

import argparse
import math
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from benchmarks import write_result
from benchmarks.scheduling_jct import CLUSTERS
from frenzy_prefect.scheduling.inputs import load_cluster, load_trace, shared_traces
from frenzy_prefect.scheduling.jobs import TRACE_MODELS, sim_jobs
from frenzy_prefect.scheduling.policies import make_policy
from frenzy_prefect.scheduling.simulator import simulate
from frenzy_prefect.spec.cluster import ClusterSpec

CUT = 0.02
LARGE_MODELS = {
    "resnet50": "gpt2-large",
    "inception3": "gpt2-large",
    "deepspeech2": "gpt2-xl",
    "bert": "gpt2-xl",
    "vgg16": "llama-2-7b",
    "gpt2": "gpt3-13b",
}
MODELS = {"trace": TRACE_MODELS, "large": LARGE_MODELS}
POLICIES = ("frenzy", "frenzy-mixed")


def cut(spec: ClusterSpec, fraction: float) -> ClusterSpec:
    """The first ``fraction`` of each GPU type's nodes (at least one), in the cluster's order."""
    by_type: dict[str, list] = {}
    for node in spec.nodes:
        by_type.setdefault(node.gpu_type, []).append(node)
    nodes = [n for group in by_type.values() for n in group[: math.ceil(fraction * len(group))]]
    return spec.model_copy(update={"name": f"{spec.name}-cut", "nodes": nodes})


def cluster(name: str) -> ClusterSpec:
    if name == "alibaba-cut":
        path, types = CLUSTERS["alibaba"]
        return cut(load_cluster(shared_traces() / path, types), CUT)
    path, types = CLUSTERS[name]
    return load_cluster(path, types)


def one(cluster_name: str, trace: str, models: str) -> dict:
    """Both policies on one (cluster, trace, models): their summaries and the across-types jobs' waits."""
    spec = cluster(cluster_name)
    jobs = sim_jobs(load_trace(shared_traces() / "elasticflow" / f"{trace}.csv"), MODELS[models])
    results = {p: simulate(jobs, spec, make_policy(p), records=True) for p in POLICIES}
    across = {j.job_id for j in results["frenzy-mixed"].jobs or [] if "+" in j.gpu_type}
    row: dict = {"cluster": cluster_name, "trace": trace, "models": models, "started_across_types": len(across)}
    for p, r in results.items():
        waits = [j.started_s - j.arrival_s for j in r.jobs or [] if j.job_id in across]
        row[p] = {
            **r.model_dump(exclude={"unschedulable", "jobs"}),
            "across_jobs_avg_wait_s": sum(waits) / len(waits) if waits else None,
            "across_jobs_max_wait_s": max(waits, default=None),
        }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", nargs="+", default=["cluster01", "cluster02"])
    parser.add_argument("--clusters", nargs="+", default=["three-types-64", "alibaba-cut"], choices=["three-types-64", "alibaba-cut"])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/mixed_scheduling.json"))
    args = parser.parse_args()

    cases = [(c, t, m) for c in args.clusters for t in args.traces for m in args.models]
    with ProcessPoolExecutor(args.workers) as pool:
        rows = list(pool.map(one, *zip(*cases, strict=True)))
    hours = lambda s: "-" if s is None else f"{s / 3600:.2f}"  # noqa: E731
    print(
        f"{'cluster':<16}{'trace':<10}{'models':<7}{'policy':<14}{'avg JCT h':>10}{'GPU-h':>9}{'oom':>5}"
        f"{'across':>7}{'their wait h (avg/max)':>24}{'decision p50/p99/max ms':>26}"
    )
    for row in rows:
        for p in POLICIES:
            r, lat = row[p], row[p]["decision_latency_ms"]
            across = row["started_across_types"] if p == "frenzy-mixed" else "-"
            wait = f"{hours(r['across_jobs_avg_wait_s'])} / {hours(r['across_jobs_max_wait_s'])}"
            print(
                f"{row['cluster']:<16}{row['trace']:<10}{row['models']:<7}{p:<14}{hours(r['avg_jct_s']):>10}{r['gpu_hours']:>9,.0f}"
                f"{r['out_of_memory_restarts']:>5}{across:>7}{wait:>24}{lat['p50']:>10.2f} / {lat['p99']:.1f} / {lat['max']:,.0f}"
            )
    write_result({"cut_fraction": CUT, "large_models": LARGE_MODELS, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
