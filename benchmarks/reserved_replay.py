"""What a GPU reserves, predicted without one: each configuration that benchmarks/gpu_memory.py
measured on a real GPU is traced here on fake tensors (training/allocation_trace.py) and its
allocations replayed through the caching allocator's rules (frenzy_prefect/caching_allocator.py); the
replayed ``max_memory_allocated`` and ``max_memory_reserved`` are set against the measured ones,
and what the GPU held in all (reserved plus the memory outside the allocator) against two
predictions: the replay plus the type's CUDA context, and the planner's figure (``peak_bytes``
with the type's calibration: tensors x the allocator's figure for the recomputation, plus context
and workspaces). Runs on CPU in about a minute. Prints a table, then writes JSON.

    python -m benchmarks.reserved_replay [--measured benchmarks/results/gpu_memory_h200.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks import write_result
from benchmarks.gpu_memory import CONFIGS, TENSORS_ONLY
from frenzy_prefect.memory import peak_bytes
from frenzy_prefect.memory.calibration import default_calibration
from frenzy_prefect.profiling.model import resolve_model
from frenzy_prefect.spec.catalog import GPU_CATALOG
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.workload import Workload
from frenzy_prefect.training.allocation_trace import replayed
from frenzy_prefect.training.measure import Measurement

GIB = 2**30


def run(measured_rows: dict[str, dict], gpu: str) -> list[dict]:
    constants = default_calibration().for_gpu(GPU_CATALOG[gpu])
    rows = []
    for model, mb, seq, precision, recompute, attention in CONFIGS:
        label = f"{model} mb={mb} s={seq} {precision} rc={recompute} {attention}"
        measured = measured_rows.get(label)
        spec, plan = resolve_model(model, seq_len=seq), ParallelPlan(micro_batch=mb, recompute=recompute)
        work = Workload(global_batch=mb, seq_len=seq, precision=precision, attention=attention)
        (rank,) = replayed(Measurement(model=spec, plan=plan, work=work), workspace_bytes=constants.workspace_bytes)
        row = {
            "config": label,
            "recompute": recompute,
            "tensors_replayed": rank.tensors_bytes,
            "allocated_replayed": rank.allocated_bytes,
            "reserved_replayed": rank.reserved_bytes,
            "reserved_expandable_replayed": rank.reserved_expandable_bytes,
            "reserved_over_tensors": rank.reserved_bytes / rank.tensors_bytes,
        }
        if measured:
            device = measured["reserved"] + measured["outside_torch"]
            replayed_device = rank.reserved_bytes + constants.cuda_context_bytes  # one GPU: no NCCL
            planned = peak_bytes(spec, plan, work, gpu=GPU_CATALOG[gpu])
            analytic = peak_bytes(spec, plan, work, gpu=GPU_CATALOG[gpu], calibration=TENSORS_ONLY[gpu])
            row |= {
                "allocated_measured": measured["allocated"],
                "reserved_measured": measured["reserved"],
                "allocated_error": rank.allocated_bytes / measured["allocated"] - 1,
                "reserved_error": rank.reserved_bytes / measured["reserved"] - 1,
                "tensors_analytic": analytic,
                # the replay holds the workspaces too
                "tensors_analytic_vs_replayed": (analytic + constants.workspace_bytes) / rank.tensors_bytes - 1,
                "device_measured": device,
                "device_replayed": replayed_device,
                "device_planned": planned,
                "device_replayed_error": replayed_device / device - 1,
                "device_planned_error": planned / device - 1,
            }
        rows.append(row)
        print(
            f"{label:48s} replayed alloc {rank.allocated_bytes / GIB:7.3f} reserved {rank.reserved_bytes / GIB:7.3f} "
            f"(x{row['reserved_over_tensors']:.3f} the tensors; expandable {rank.reserved_expandable_bytes / GIB:7.3f})"
            + (
                f" | measured alloc {measured['allocated'] / GIB:7.3f} ({row['allocated_error']:+.1%}) "
                f"reserved {measured['reserved'] / GIB:7.3f} ({row['reserved_error']:+.1%}) | device replayed "
                f"{row['device_replayed_error']:+.1%} planned {row['device_planned_error']:+.1%}"
                if measured
                else ""
            ),
            flush=True,
        )
    return rows


def summary(rows: list[dict]) -> dict:
    errors = [abs(r["reserved_error"]) for r in rows if "reserved_error" in r]
    planned = [r["device_planned_error"] for r in rows if "device_planned_error" in r]
    analytic = [abs(r["tensors_analytic_vs_replayed"]) for r in rows if "tensors_analytic_vs_replayed" in r]
    by_mode: dict[str, float] = {}
    for r in rows:
        by_mode[r["recompute"]] = max(by_mode.get(r["recompute"], 1.0), r["reserved_over_tensors"])
    return {
        "reserved_abs_error_median": statistics.median(errors) if errors else None,
        "reserved_abs_error_max": max(errors) if errors else None,
        "reserved_under_predicted": sum(r.get("reserved_error", 0) < 0 for r in rows),
        "largest_reserved_over_tensors_by_recompute": by_mode,
        "tensors_analytic_vs_replayed_abs_max": max(analytic) if analytic else None,
        "device_planned_error_min": min(planned) if planned else None,
        "device_planned_error_median": statistics.median(planned) if planned else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measured", type=Path, default=Path("benchmarks/results/gpu_memory_h200.json"))
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/reserved_replay.json"))
    args = parser.parse_args()
    measured = json.loads(args.measured.read_text())
    rows = run({r["config"]: r for r in measured["rows"]}, measured["gpu"])
    result = {"measured": str(args.measured), "gpu": measured["gpu"], "rows": rows, "summary": summary(rows)}
    print(json.dumps(result["summary"], indent=2))
    write_result(result, args.json)


if __name__ == "__main__":
    main()
