"""How fast MARP's estimator evaluates plans: every (dp, tp, pp, micro-batch, ZeRO, recompute,
precision) combination the allocator could consider for a model, timed on one core, for the
search path (``peak_bytes``: the peak only; the tensors, and with an H100's terms as the
scheduler asks) and the itemised one (``estimate``: a breakdown per stage as pydantic objects).

    python -m benchmarks.estimator_speed [--model gpt3-6.7b] [--repeat 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

from benchmarks import write_result
from frenzy_prefect.memory import estimate
from frenzy_prefect.memory.analytic import PlanSearch, shared_by_plans
from frenzy_prefect.profiling.model import PRESETS
from frenzy_prefect.spec.catalog import GPU_CATALOG
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.workload import Workload


def grid(model) -> list[tuple[ParallelPlan, str, int]]:
    """Valid (plan, precision, global batch) triples: dp up to 64, tp and pp up to 8, the
    global batch a multiple of dp * micro-batch."""
    out = []
    for dp, tp, pp, mb, zero, recompute, precision in itertools.product(
        (1, 2, 4, 8, 16, 32, 64), (1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8), (0, 1, 2, 3), ("none", "selective", "full"), ("fp32", "bf16")
    ):
        if zero and (tp > 1 or pp > 1):
            continue
        out.append((ParallelPlan(dp=dp, tp=tp, pp=pp, micro_batch=mb, zero=zero, recompute=recompute), precision, 1024))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt3-6.7b", choices=sorted(PRESETS))
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/estimator_speed.json"))
    args = parser.parse_args()
    model = PRESETS[args.model]
    plans = grid(model)
    result = {"model": model.name, "seq_len": args.seq_len, "plans": len(plans), "target_plans_per_s": 100_000}
    print(f"{'function':<16} {'model':<12} {'plans':>7} {'best wall s':>12} {'plans/s':>12}")
    works = {
        (p, b): Workload(global_batch=b, seq_len=args.seq_len, precision=p) for _, p, b in plans
    }  # one per search, as the allocator has
    h100 = GPU_CATALOG["H100"]
    # A search holds one PlanSearch per (workload, GPU type), as the allocator and the scheduler
    # do; made anew each repeat, so that what plans share is computed again. ``peak_bytes`` and
    # ``estimate``: the tensors alone (the CPU figure); ``_h100``: with an H100's terms.
    for name, gpu in (("peak_bytes", None), ("estimate", None), ("peak_bytes_h100", h100)):
        best = float("inf")
        for _ in range(args.repeat):
            shared_by_plans.cache_clear()
            started = time.perf_counter()
            searches = {key: PlanSearch(model, work, gpu) for key, work in works.items()}
            for plan, precision, global_batch in plans:
                search = searches[precision, global_batch]
                if name == "estimate":
                    estimate(model, plan, search.work, gpu=gpu)
                else:
                    search.peak_bytes(plan)
            best = min(best, time.perf_counter() - started)
        result[name] = {"best_wall_s": best, "plans_per_s": len(plans) / best}
        print(f"{name:<16} {model.name:<12} {len(plans):>7} {best:>12.4f} {len(plans) / best:>12,.0f}")
    write_result(result, args.json)


if __name__ == "__main__":
    main()
