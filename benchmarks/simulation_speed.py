"""Wall time of a whole-trace replay: cluster04 (15,802 jobs) on the Alibaba v2023 cluster shape
(6,212 GPUs) and on that list 10 times over (62,120 GPUs, ``frenzy simulate --replicate 10``),
per policy, with the simulator's own counts (decisions, jobs per second) and decision latency.

    python -m benchmarks.simulation_speed [--policies frenzy first-fit fastest-type ilp] [--replicate 1 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks import write_result
from benchmarks.scheduling_jct import CLUSTERS
from frenzy_prefect.scheduling.inputs import load_cluster, load_trace, replicate, shared_traces
from frenzy_prefect.scheduling.jobs import sim_jobs
from frenzy_prefect.scheduling.policies import POLICIES, make_policy
from frenzy_prefect.scheduling.simulator import simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="cluster04")
    parser.add_argument(
        "--policies", nargs="+", default=[p for p in POLICIES if p != "frenzy-mixed"], choices=list(POLICIES)
    )  # (frenzy-mixed: benchmarks/mixed_scheduling.py)
    parser.add_argument("--replicate", type=int, nargs="+", default=[1, 10], help="copies of the Alibaba node list")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/simulation_speed.json"))
    args = parser.parse_args()

    rows = []
    columns = f"{'GPUs':>7}{'policy':>14}{'jobs':>7}{'decisions':>11}{'load s':>8}{'replay s':>10}{'jobs/s':>9}"
    print(columns + f"{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    for copies in args.replicate:
        for name in args.policies:
            started = time.perf_counter()  # loading and mapping count: a replay starts from the files
            path, types = CLUSTERS["alibaba"]
            spec = replicate(load_cluster(shared_traces() / path, types), copies)
            jobs = sim_jobs(load_trace(shared_traces() / "elasticflow" / f"{args.trace}.csv"))
            loaded = time.perf_counter() - started
            result = simulate(jobs, spec, make_policy(name))
            total = time.perf_counter() - started
            latency = result.decision_latency_ms
            rows.append(
                {
                    "policy": name,
                    "trace": args.trace,
                    "gpus": result.cluster_gpus,
                    "jobs": len(jobs),
                    "decisions": result.decisions,
                    "load_s": loaded,
                    "total_s": total,
                    "decision_latency_ms": latency.model_dump(),
                }
            )
            print(
                f"{result.cluster_gpus:>7}{name:>14}{len(jobs):>7}{result.decisions:>11}{loaded:>8.2f}{total:>10.2f}"
                f"{len(jobs) / total:>9.0f}{latency.p50:>9.3f}{latency.p99:>9.3f}{latency.max:>9.3f}",
                flush=True,
            )
    write_result({"rows": rows}, args.json)


if __name__ == "__main__":
    main()
