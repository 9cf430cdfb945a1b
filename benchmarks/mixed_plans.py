"""Plans across GPU types against the best single-type plan of the same free GPUs (issue 31), by
prediction: for each scenario, the allocator's fastest fitting plan on each type's free GPUs
alone (``candidate_plans``, the single-type search), and the bounded mixed search over both
(``allocator.mixed.mixed_candidates``), with each search's wall time on this machine.

Scenarios: a job that fits neither type's free GPUs alone (gpt2-xl in fp32 on an A10 and a T4);
two types of about equal throughput (2 A100-40GB and 6 A10); the same four times over; a large
cluster's pair (64 H100 and 64 A100-80GB, gpt3-6.7b); and a job that one type holds nearly as
fast (gpt2-large on an A10 and a T4). 100 Gb/s between nodes, one GPU per node (every transfer
between GPUs crosses the network, for single-type plans too).

    python -m benchmarks.mixed_plans [--json PATH]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks import write_result
from frenzy_prefect.allocator.mixed import MixedCandidate, mixed_candidates, worth_mixing
from frenzy_prefect.allocator.plans import candidate_plans
from frenzy_prefect.errors import NoFeasiblePlan
from frenzy_prefect.profiling.model import PRESETS
from frenzy_prefect.spec.catalog import GPU_CATALOG
from frenzy_prefect.spec.cluster import ClusterSpec
from frenzy_prefect.spec.plan import PlanCandidate
from frenzy_prefect.spec.request import TrainingRequest

NETWORK_GBPS = 12.5  # 100 Gb/s between nodes
SCENARIOS = [
    ("fits neither alone", "gpt2-xl", 16, "fp32", {"A10": 1, "T4": 1}),
    ("balanced types", "gpt2-xl", 64, "bf16", {"A100-40GB": 2, "A10": 6}),
    ("balanced, 4x", "gpt2-xl", 64, "bf16", {"A100-40GB": 8, "A10": 24}),
    ("large cluster's pair", "gpt3-6.7b", 512, "bf16", {"H100": 64, "A100-80GB": 64}),
    ("one type nearly as fast", "gpt2-large", 16, "fp32", {"A10": 1, "T4": 1}),
]


def request(model: str, global_batch: int, precision: str) -> TrainingRequest:
    return TrainingRequest(model=model, dataset="s3://b/d", global_batch=global_batch, seq_len=1024, steps=100, precision=precision)


def cluster_of(**free: int) -> ClusterSpec:
    """One node per GPU, ``free[type]`` of each type."""
    nodes = [{"name": f"{t}-{i}", "host": "h", "gpu_type": t, "gpu_count": 1} for t, n in free.items() for i in range(n)]
    return ClusterSpec(name="mixed", nodes=nodes, network_gbps=NETWORK_GBPS)


def best_single(model: str, req: TrainingRequest, gpu_type: str, count: int) -> PlanCandidate | None:
    """The allocator's fastest fitting plan on ``count`` GPUs of ``gpu_type`` alone, or None."""
    try:
        fitting = [c for c in candidate_plans(PRESETS[model], req, cluster_of(**{gpu_type: count})) if c.fits]
    except NoFeasiblePlan:
        return None
    return fitting[0] if fitting else None


def best_mixed(model: str, req: TrainingRequest, **free: int) -> MixedCandidate | None:
    """The fastest fitting plan of the mixed search over ``free``, or None."""
    types = {t: (GPU_CATALOG[t], n) for t, n in free.items()}
    found = mixed_candidates(PRESETS[model], req.workload, types, cluster_of(**free).memory_margin, NETWORK_GBPS)
    return found[0] if found else None


def scenario(name: str, model: str, global_batch: int, precision: str, free: dict[str, int]) -> dict:
    req = request(model, global_batch, precision)
    began = time.perf_counter()
    singles = {t: best_single(model, req, t, n) for t, n in free.items()}
    single_s = time.perf_counter() - began
    began = time.perf_counter()
    mixed = best_mixed(model, req, **free)
    mixed_s = time.perf_counter() - began
    fitting = [(t, c) for t, c in singles.items() if c is not None]
    best_type, best = min(fitting, key=lambda tc: tc[1].step_time_s) if fitting else (None, None)
    return {
        "scenario": name,
        "model": model,
        "precision": precision,
        "global_batch": global_batch,
        "free": free,
        "single": {t: None if c is None else {"plan": c.plan.label(), "step_s": c.step_time_s} for t, c in singles.items()},
        "best_single_type": best_type,
        "best_single_step_s": None if best is None else best.step_time_s,
        "mixed_plan": None if mixed is None else mixed.plan.label(),
        "mixed_step_s": None if mixed is None else mixed.step_s,
        "speedup": None if mixed is None or best is None else best.step_time_s / mixed.step_s,
        "worth_mixing": mixed is not None and worth_mixing(mixed.step_s, None if best is None else best.step_time_s),
        "single_search_s": single_s,
        "mixed_search_s": mixed_s,
    }


def report(rows: list[dict]) -> None:
    print("| scenario | free GPUs | best single type, step | mixed plan, step | speed-up | worth mixing | searches (single, mixed) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        free = " + ".join(f"{n} {t}" for t, n in r["free"].items())
        single = "none fits" if r["best_single_type"] is None else f"{r['best_single_type']}, {r['best_single_step_s']:.3f} s"
        mixed = "none fits" if r["mixed_plan"] is None else f"{r['mixed_plan']}, {r['mixed_step_s']:.3f} s"
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        searches = f"{r['single_search_s']:.2f} s, {r['mixed_search_s']:.2f} s"
        what = f"{r['scenario']} ({r['model']}, {r['precision']})"
        print(f"| {what} | {free} | {single} | {mixed} | {speedup} | {r['worth_mixing']} | {searches} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/mixed_plans.json"))
    args = parser.parse_args()
    rows = [scenario(*s) for s in SCENARIOS]
    report(rows)
    write_result({"network_gbps": NETWORK_GBPS, "scenarios": rows}, args.json)


if __name__ == "__main__":
    main()
