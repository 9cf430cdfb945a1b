"""One GPU's check of MARP and the step-time model (``scripts/gpu-check``): on a CUDA machine,
for each configuration of the knobs one GPU allows (micro-batch, sequence length, recomputation,
precision, master weights, fused or eager attention, ZeRO-2 and -3 on one rank), the engine's three
steps measured (``max_memory_allocated``/``max_memory_reserved``, the memory outside the
allocator, MemTracker's tensors) beside MARP's tensors, the replayed allocator and the planner's
figure; the type's runtime terms fitted over these runs as ``frenzy calibrate`` fits them; and
tokens/s of the engine against a bare training loop of the same model and batch, beside the
step-time model's prediction. Without a GPU it runs the same on CPU at small sizes (MemTracker
only) and says so, which keeps it working. Writes one calibration store (memory/run_records.py)
and prints a table.

    python -m benchmarks.gpu_check [--quick] [--budget-s 420] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

from frenzy_prefect.memory import peak_bytes
from frenzy_prefect.memory.calibration import Calibration, GpuConstants, default_calibration, fit
from frenzy_prefect.memory.run_records import CalibrationStore, RankRecord, RunRecord
from frenzy_prefect.profiling.model import PRESETS, resolve_model
from frenzy_prefect.spec.catalog import GPU_CATALOG
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.workload import Workload
from frenzy_prefect.training.allocation_trace import replayed, traceable
from frenzy_prefect.training.measure import Measurement, measure

GIB = 2**30
# (model, micro-batch, seq_len, precision, recompute, attention, zero, master weights); the first
# is the reference the others vary one knob of.
GPU_CONFIGS = [
    ("gpt2-medium", 4, 1024, "bf16", "none", "flash", 0, False),
    ("gpt2-medium", 8, 1024, "bf16", "none", "flash", 0, False),
    ("gpt2-medium", 8, 1024, "bf16", "selective", "flash", 0, False),
    ("gpt2-medium", 8, 1024, "bf16", "full", "flash", 0, False),
    ("gpt2-medium", 4, 1024, "fp32", "none", "flash", 0, False),
    ("gpt2-medium", 4, 1024, "fp16", "none", "flash", 0, False),
    ("gpt2-medium", 4, 1024, "bf16", "none", "eager", 0, False),
    ("gpt2-medium", 4, 1024, "bf16", "none", "flash", 0, True),
    ("gpt2-medium", 4, 1024, "bf16", "none", "flash", 2, False),
    ("gpt2-medium", 4, 1024, "bf16", "none", "flash", 3, False),
    ("qwen2-0.5b", 2, 2048, "bf16", "none", "flash", 0, False),
    ("qwen2-0.5b", 2, 4096, "bf16", "full", "flash", 0, False),
]
CPU_CONFIGS = [
    ("gpt-nano", 2, 64, "fp32", "none", "flash", 0, False),
    ("gpt-nano", 2, 64, "bf16", "full", "flash", 0, False),
    ("llama-nano", 2, 64, "bf16", "selective", "eager", 0, False),
    ("gpt-nano", 2, 64, "bf16", "none", "flash", 0, True),
    ("gpt-nano", 2, 64, "fp32", "none", "flash", 3, False),
]
TIMED = {"gpu": ("gpt2-medium", 8, 1024, "bf16"), "cpu": ("gpt-nano", 4, 64, "fp32")}


def catalog_type(device_name: str) -> str | None:
    """The catalog type whose name the CUDA device's name contains (longest first: H100 NVL before H100)."""
    for name in sorted(GPU_CATALOG, key=len, reverse=True):
        if name.split("-")[0].lower() in device_name.lower() and (name.split("-")[-1] in device_name or "-" not in name):
            return name
    return None


def measured_record(config: tuple, gpu: str | None, device_name: str | None) -> RunRecord:
    model, mb, seq, precision, recompute, attention, zero, master = config
    spec, plan = resolve_model(model, seq_len=seq), ParallelPlan(micro_batch=mb, recompute=recompute, zero=zero)
    work = Workload(global_batch=mb, seq_len=seq, precision=precision, attention=attention, master_weights=master)
    measurement = Measurement(model=spec, plan=plan, work=work)
    gpu_type = GPU_CATALOG[gpu] if gpu else None
    tensors = peak_bytes(spec, plan, work, gpu=gpu_type, calibration=Calibration(gpus={gpu: GpuConstants()}) if gpu else None)
    workspace = default_calibration().for_gpu(gpu_type).workspace_bytes if gpu_type else 0
    replay = replayed(measurement, workspace_bytes=workspace, on_gpu=gpu is not None)[0] if traceable(measurement) is None else None
    (rank,) = measure(measurement)
    record = RankRecord(
        rank=0,
        stage=0,
        predicted_tensors_bytes=tensors,
        measured_tensors_bytes=rank.breakdown.total,
        predicted_reserved_bytes=replay.reserved_bytes if replay else None,
        allocated_bytes=rank.cuda_max_allocated,
        reserved_bytes=rank.cuda_max_reserved,
        outside_allocator_bytes=rank.cuda_outside_torch,
    )
    return RunRecord(source="gpu-check", gpu_type=gpu, device_name=device_name, model=spec, plan=plan, work=work, ranks=[record])


def timed_steps(step, steps: int, sync) -> float:
    """The median seconds of ``step`` over the steps after the first."""
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def throughput(gpu: str | None, device: torch.device, steps: int) -> dict:
    """Tokens/s of the engine against a bare loop (the same Decoder, AdamW, autocast) on one device."""
    from frenzy_prefect.allocator.step_time import predict_step
    from frenzy_prefect.training.decoder import Decoder
    from frenzy_prefect.training.engine import Engine

    model, mb, seq, precision = TIMED["gpu" if gpu else "cpu"]
    spec, plan = PRESETS[model], ParallelPlan(micro_batch=mb)
    work = Workload(global_batch=mb, seq_len=seq, precision=precision)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = torch.randint(0, spec.vocab_size, (mb, seq + 1), device=device)
    batch = (ids[:, :-1], ids[:, 1:])
    engine_s = timed_steps(partial(Engine(spec, plan, work, rank=0, device=device).step, [batch]), steps, sync)  # freed after
    bare = Decoder(spec).to(device)
    optimizer = torch.optim.AdamW(bare.parameters(), lr=1e-4)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def bare_step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = bare(*batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    bare_s = timed_steps(bare_step, steps, sync)
    predicted = predict_step(spec, plan, work, gpu=GPU_CATALOG[gpu]).seconds if gpu else None
    tokens = mb * seq
    return {
        "config": f"{model} mb={mb} s={seq} {precision}",
        "engine_tokens_per_s": tokens / engine_s,
        "bare_tokens_per_s": tokens / bare_s,
        "engine_over_bare": bare_s / engine_s,
        "measured_step_s": engine_s,
        "predicted_step_s": predicted,
    }


def row_text(r: RunRecord) -> str:
    k, w = r.ranks[0], r.work
    precision = f"{w.precision}{' mw' if w.master_weights else ''}"
    label = f"{r.model.name} mb={r.plan.micro_batch} s={w.seq_len} {precision} rc={r.plan.recompute} {w.attention} z{r.plan.zero}"
    text = f"{label:55s} tensors {k.predicted_tensors_bytes / GIB:7.3f} predicted, {k.measured_tensors_bytes / GIB:7.3f} measured"
    if k.reserved_bytes is not None:
        replay = f"{k.predicted_reserved_bytes / GIB:7.3f}" if k.predicted_reserved_bytes is not None else "    n/a"
        text += f" | allocated {k.allocated_bytes / GIB:7.3f} | reserved {replay} replayed, {k.reserved_bytes / GIB:7.3f} measured"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two configurations (what tests run)")
    parser.add_argument("--budget-s", type=float, default=420, help="stop starting configurations after this many seconds")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    started = time.monotonic()
    on_gpu = torch.cuda.is_available()
    device_name = torch.cuda.get_device_name() if on_gpu else None
    gpu = catalog_type(device_name) if on_gpu else None
    if on_gpu and gpu is None:
        sys.exit(f"gpu-check: {device_name} is not a catalog GPU type ({', '.join(sorted(GPU_CATALOG))})")
    print(f"gpu-check: {device_name} ({gpu})" if on_gpu else "gpu-check: no CUDA GPU here: running the CPU part (MemTracker, small models)")
    configs = GPU_CONFIGS if on_gpu else CPU_CONFIGS
    store = CalibrationStore(cluster=f"gpu-check-{(gpu or 'cpu').lower()}")
    for config in configs[:2] if args.quick else configs:
        if time.monotonic() - started > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent: the remaining configurations are left out")
            break
        try:
            record = measured_record(config, gpu, device_name)
        except Exception as exc:  # one configuration that fails (out of memory) does not lose the rest
            print(f"{config}: failed: {' '.join(str(exc).split())[:200]}", flush=True)
            continue
        store = store.add(record)
        print(row_text(record), flush=True)
    result = {
        "store": store.model_dump(mode="json"),
        "throughput": throughput(gpu, torch.device("cuda" if on_gpu else "cpu"), 6 if args.quick else 12),
    }
    t = result["throughput"]
    engine, bare = t["engine_tokens_per_s"], t["bare_tokens_per_s"]
    print(f"tokens/s {t['config']}: engine {engine:,.0f}, bare loop {bare:,.0f} (x{t['engine_over_bare']:.3f})")
    measured = [(r.ranks[0].predicted_tensors_bytes, r.ranks[0].device_bytes) for r in store.records if r.ranks[0].device_bytes]
    if len(measured) >= 3:  # `frenzy calibrate`'s fit, over these runs
        constants = fit(*map(list, zip(*measured, strict=True)), note=f"scripts/gpu-check on {device_name}")
        result["fitted"] = constants.model_dump(mode="json")
        print(f"fitted {gpu}: overhead {constants.overhead_bytes / GIB:.3f} GiB, x{constants.fragmentation:.4f}")
    from benchmarks import write_result

    write_result(result, args.json or Path(f"benchmarks/results/gpu_check_{(gpu or 'cpu').lower()}.json"))
    print(f"gpu-check: {len(store.records)} configurations in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
