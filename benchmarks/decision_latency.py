"""Scheduling decision latency, ``frenzy`` vs ``ilp`` on identical inputs, against cluster size
and queue length. A snapshot is a cluster (the three-type 64-GPU file, or every k-th node of the
Alibaba v2023 node list, keeping its type mix) about 80% occupied by cluster04's jobs placed by
HAS, plus a queue of the next L jobs of the trace; each policy decides on a fresh copy of the
same snapshot, REPEAT times per snapshot, over SNAPSHOTS snapshots. MARP's plans are computed
before timing (at submission, as in the simulator): the time is the decision alone.

    python -m benchmarks.decision_latency [--repeat 5] [--snapshots 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from benchmarks import p99, write_result
from benchmarks.scheduling_jct import CLUSTERS
from frenzy_prefect.scheduling.cluster import SimCluster
from frenzy_prefect.scheduling.inputs import load_cluster, load_trace, replicate, shared_traces
from frenzy_prefect.scheduling.jobs import SimJob, Waiting, sim_jobs
from frenzy_prefect.scheduling.policies import make_policy
from frenzy_prefect.scheduling.policies.base import Start
from frenzy_prefect.scheduling.simulator import start_run
from frenzy_prefect.scheduling.truth import MemoryTruth
from frenzy_prefect.spec.cluster import ClusterSpec

SIZES = [64, 512, 2048, 6212, 62120]  # the last: the Alibaba list 10 times over (frenzy simulate --replicate 10)
QUEUES = [1, 16, 128]
OCCUPANCY = 0.8


def alibaba_subset(gpus: int) -> ClusterSpec:
    """Every k-th node of the Alibaba list, or the list itself repeated to reach ``gpus``."""
    path, types = CLUSTERS["alibaba"]
    full = load_cluster(shared_traces() / path, types)
    total = sum(n.gpu_count for n in full.nodes)
    if gpus >= total:
        return replicate(full, gpus // total)
    step = total / gpus
    nodes = full.nodes[:: max(1, round(step))]
    return full.model_copy(update={"nodes": nodes, "name": f"alibaba-{gpus}"})


def snapshot(spec: ClusterSpec, jobs: list[SimJob], queue_length: int, rng: random.Random) -> tuple[SimCluster, list[Waiting]]:
    cluster = SimCluster(spec)
    filler = make_policy("frenzy")
    busy_target = OCCUPANCY * cluster.gpus
    for job in rng.sample(jobs, len(jobs)):
        if cluster.gpus - sum(cluster.free_total.values()) >= busy_target:
            break
        filler.prepare(job, cluster)
        for decision in filler.schedule(0.0, [Waiting(job)], cluster):
            if isinstance(decision, Start):
                run = start_run(decision, cluster, -rng.uniform(0, 3600), MemoryTruth())
                cluster.running[job.job_id] = run
    start = rng.randrange(len(jobs) - queue_length)
    return cluster, [Waiting(j) for j in jobs[start : start + queue_length]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--snapshots", type=int, default=10)
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="GPUs: 64 (the three-type file), or Alibaba cuts and multiples")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/decision_latency.json"))
    args = parser.parse_args()

    jobs = sim_jobs(load_trace(shared_traces() / "elasticflow" / "cluster04.csv"))
    rows = []
    print(f"{'GPUs':>6}{'queue':>7}{'frenzy p50 ms':>15}{'p99':>9}{'max':>9}{'ilp p50 ms':>12}{'p99':>9}{'max':>9}{'ilp/frenzy p50':>16}")
    for size in args.sizes:
        spec = load_cluster(CLUSTERS["three-types-64"][0]) if size == 64 else alibaba_subset(size)
        for queue_length in QUEUES:
            rng = random.Random(size * 1000 + queue_length)
            samples: dict[str, list[float]] = {"frenzy": [], "ilp": []}
            for _ in range(args.snapshots):
                cluster, queue = snapshot(spec, jobs, queue_length, rng)
                for name in samples:
                    policy = make_policy(name)
                    for w in queue:
                        policy.prepare(w.job, cluster)
                    for _ in range(args.repeat):
                        twin = cluster.copy()
                        started = time.perf_counter()
                        policy.schedule(7200.0, queue, twin)
                        samples[name].append((time.perf_counter() - started) * 1e3)
            row = {"gpus": sum(n.gpu_count for n in spec.nodes), "queue": queue_length}
            for name, values in samples.items():
                values.sort()
                row[name] = {"p50_ms": statistics.median(values), "p99_ms": p99(values), "max_ms": values[-1]}
            row["ilp_over_frenzy_p50"] = row["ilp"]["p50_ms"] / row["frenzy"]["p50_ms"]
            rows.append(row)
            f, i = row["frenzy"], row["ilp"]
            print(
                f"{row['gpus']:>6}{queue_length:>7}{f['p50_ms']:>15.3f}{f['p99_ms']:>9.3f}{f['max_ms']:>9.3f}"
                f"{i['p50_ms']:>12.3f}{i['p99_ms']:>9.3f}{i['max_ms']:>9.3f}{row['ilp_over_frenzy_p50']:>15.1f}x"
            )
    write_result({"occupancy": OCCUPANCY, "repeat": args.repeat, "snapshots": args.snapshots, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
