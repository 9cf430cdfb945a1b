"""MARP against one real GPU: for each configuration, the training engine runs three steps on the
GPU (frenzy_prefect.training.measure) and records the caching allocator's peaks
(``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``), the memory in use outside torch's
allocator (CUDA context, library workspaces) and MemTracker's tensor peak; beside them MARP's
tensor prediction (what allocated should be) and its device prediction with the GPU type's
calibrated runtime terms (what allocated + reserved slack + context should be). Errors are
(predicted - measured) / measured; a negative device error is a plan that would not fit.
Prints a table, then writes JSON. Needs a CUDA GPU (``--gpu`` its catalog name).

    python -m benchmarks.gpu_memory --gpu H200 [--json benchmarks/results/gpu_memory_h200.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks import write_result
from frenzy_prefect.memory import peak_bytes
from frenzy_prefect.memory.calibration import Calibration, GpuConstants
from frenzy_prefect.profiling.model import resolve_model
from frenzy_prefect.spec.catalog import GPU_CATALOG
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.workload import Workload
from frenzy_prefect.training.measure import Measurement, measure

GIB = 2**30
TENSORS_ONLY = {name: Calibration(gpus={name: GpuConstants()}) for name in GPU_CATALOG}
# (model, micro-batch, seq_len, precision, recompute, attention): none of them is one of
# `frenzy calibrate`'s runs except where noted, so the calibrated terms meet new shapes.
CONFIGS = [
    ("gpt2-medium", 8, 1024, "bf16", "none", "flash"),
    ("gpt2-medium", 8, 1024, "bf16", "full", "flash"),
    ("gpt2-large", 4, 1024, "bf16", "none", "eager"),
    ("gpt2-small", 8, 1024, "fp32", "none", "flash"),
    ("llama-micro", 32, 512, "bf16", "none", "flash"),
    ("qwen2-0.5b", 4, 2048, "bf16", "none", "flash"),
    ("qwen2-0.5b", 4, 2048, "bf16", "selective", "flash"),
    ("gpt2-xl", 2, 1024, "bf16", "full", "flash"),
]


def run(gpu: str) -> list[dict]:
    rows = []
    for model, mb, seq, precision, recompute, attention in CONFIGS:
        spec, plan = resolve_model(model, seq_len=seq), ParallelPlan(micro_batch=mb, recompute=recompute)
        work = Workload(global_batch=mb, seq_len=seq, precision=precision, attention=attention)
        label = f"{model} mb={mb} s={seq} {precision} rc={recompute} {attention}"
        try:
            (rank,) = measure(Measurement(model=spec, plan=plan, work=work))
        except Exception as exc:  # one configuration that fails (out of memory) does not lose the rest
            print(f"{label}: failed: {' '.join(str(exc).split())[:200]}", flush=True)
            continue
        row = {
            "config": label,
            "tensors_measured": rank.breakdown.total,
            "allocated": rank.cuda_max_allocated,
            "reserved": rank.cuda_max_reserved,
            "outside_torch": rank.cuda_outside_torch,
            "device_measured": rank.device_peak,
            # The tensors as on a GPU (the optimizer's foreach temporaries), without the runtime terms.
            "tensors_predicted": peak_bytes(spec, plan, work, gpu=GPU_CATALOG[gpu], calibration=TENSORS_ONLY[gpu]),
            "device_predicted": peak_bytes(spec, plan, work, gpu=GPU_CATALOG[gpu]),
        }
        row["allocated_error"] = row["tensors_predicted"] / row["allocated"] - 1
        row["device_error"] = row["device_predicted"] / row["device_measured"] - 1
        rows.append(row)
        print(
            f"{label:55s} alloc {row['allocated'] / GIB:7.2f} reserved {row['reserved'] / GIB:7.2f} "
            f"outside {row['outside_torch'] / GIB:5.2f} | predicted tensors {row['tensors_predicted'] / GIB:7.2f} "
            f"({row['allocated_error']:+.1%}) device {row['device_predicted'] / GIB:7.2f} ({row['device_error']:+.1%})",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", required=True, help="this machine's GPU, a catalog name (H200, H100, A100-80GB, ...)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks.gpu_memory measures a CUDA GPU and this machine has none")
    rows = run(args.gpu)
    result = {"gpu": args.gpu, "device_name": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    write_result(result, args.json or Path(f"benchmarks/results/gpu_memory_{args.gpu.lower()}.json"))


if __name__ == "__main__":
    main()
