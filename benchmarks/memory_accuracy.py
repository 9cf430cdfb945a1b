"""MARP's accuracy: predicted vs measured per-GPU peak memory over a grid of plans.

Every configuration is executed by the training engine on real ranks (one process per GPU of
the plan, gloo on CPU, two optimizer steps, MemTracker) and predicted by ``frenzy_prefect.memory``;
beside it the Megatron-LM theoretical formula and DeepSpeed's model-state estimator on the same
configuration (``memory_baselines``). The error of each is (predicted - measured) / measured of
the peak over ranks. Prints a table, then the summary, and writes JSON.

    python -m benchmarks.memory_accuracy [--only SUBSTRING] [--json benchmarks/results/memory_accuracy.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from benchmarks import memory_baselines, write_result
from frenzy_prefect.memory import estimate
from frenzy_prefect.profiling.model import PRESETS
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.workload import Workload
from frenzy_prefect.training.measure import Measurement, measure

NANO = PRESETS["gpt-nano"]  # 4 layers, hidden 128, 4 heads, vocab 256, tied
MICRO = PRESETS["gpt-micro"]  # 6 layers, hidden 256, 8 heads, vocab 256, tied
WIDE = ModelSpec(  # untied, a larger vocabulary padded to a multiple of 128, an MLP narrower than 4h
    name="wide-untied",
    layers=2,
    hidden=192,
    heads=6,
    vocab_size=2000,
    vocab_multiple=128,
    max_seq_len=128,
    ffn_hidden=512,
    tied_embeddings=False,
)

LLAMA_NANO = PRESETS["llama-nano"]  # 4 layers, hidden 128, 4 heads over 2 KV heads, SwiGLU 352, RMSNorm, RoPE, untied
LLAMA_MICRO = PRESETS["llama-micro"]  # 6 layers, hidden 256, 8 heads over 2 KV heads, SwiGLU 688, untied
LLAMA_TIED = LLAMA_NANO.model_copy(update={"name": "llama-nano-tied", "tied_embeddings": True})
DROPOUT = {"attention_dropout": 0.1, "hidden_dropout": 0.1}  # what GPT-2's HF config sets
NANO_DROPOUT = NANO.model_copy(update={"name": "gpt-nano-drop", **DROPOUT})
LLAMA_DROPOUT = LLAMA_NANO.model_copy(update={"name": "llama-nano-drop", **DROPOUT})
NANO_ODD = NANO.model_copy(update={"name": "gpt-nano-v251", "vocab_size": 251})  # tp=2 pads the vocabulary to 252

MASTER = {"master_weights": True}  # bf16/fp16 weights, fp32 main gradients and masters

# (model, plan, precision, global batch, sequence length, optimizer[, attention: flash by default,
# or a dict of further request fields: attention, master_weights])
GRID: list[tuple] = [
    (NANO, {}, "fp32", 4, 128, "adamw"),
    (NANO, {}, "bf16", 4, 128, "adamw"),
    (NANO, {"recompute": "selective"}, "bf16", 4, 128, "adamw"),
    (NANO, {"recompute": "full"}, "fp32", 8, 128, "adamw"),
    (NANO, {"dp": 2}, "fp32", 8, 128, "sgd"),
    (NANO, {"tp": 2}, "bf16", 4, 128, "adamw"),
    (NANO, {"pp": 2}, "fp32", 8, 128, "adamw"),
    (NANO, {"pp": 2, "recompute": "full"}, "bf16", 8, 128, "adamw"),
    (NANO, {"dp": 2, "zero": 1}, "fp32", 8, 128, "adamw"),
    (NANO, {"dp": 2, "zero": 2}, "bf16", 8, 128, "adamw"),
    (NANO, {"dp": 2, "zero": 3}, "fp32", 8, 128, "adamw"),
    (MICRO, {}, "bf16", 2, 256, "adamw"),
    (MICRO, {"recompute": "full"}, "bf16", 4, 256, "adamw"),
    (MICRO, {"recompute": "selective"}, "fp32", 2, 256, "adamw"),
    (MICRO, {"dp": 2}, "bf16", 4, 256, "adamw"),
    (MICRO, {"tp": 2, "recompute": "full"}, "fp32", 2, 256, "adamw"),
    (MICRO, {"pp": 2}, "bf16", 4, 256, "adamw"),
    (MICRO, {"dp": 2, "zero": 1}, "bf16", 4, 256, "adamw"),
    (MICRO, {"dp": 2, "zero": 2}, "fp32", 4, 256, "adamw"),
    (MICRO, {"dp": 2, "zero": 3, "recompute": "full"}, "bf16", 4, 256, "adamw"),
    (WIDE, {}, "fp32", 4, 128, "adamw"),
    (WIDE, {"recompute": "full"}, "bf16", 4, 128, "sgd"),
    (WIDE, {"tp": 2}, "fp32", 4, 128, "adamw"),
    (WIDE, {"pp": 2, "recompute": "selective"}, "bf16", 8, 128, "adamw"),
    (WIDE, {"dp": 2, "zero": 2, "recompute": "selective"}, "bf16", 4, 128, "adamw"),
    (WIDE, {"dp": 2, "zero": 3}, "fp32", 4, 128, "adamw"),
    (NANO, {"dp": 2, "pp": 2}, "fp32", 8, 128, "adamw"),
    (NANO, {"dp": 2, "tp": 2}, "bf16", 8, 128, "adamw"),
    (NANO, {"dp": 2, "pp": 2, "zero": 1}, "bf16", 8, 128, "adamw"),
    (MICRO, {"dp": 2, "tp": 2, "zero": 1}, "fp32", 4, 256, "adamw"),
    (NANO, {"dp": 2, "tp": 2, "zero": 2}, "bf16", 8, 128, "adamw"),
    (LLAMA_NANO, {"dp": 2, "tp": 2, "zero": 2}, "fp32", 8, 128, "adamw"),
    # The Llama family: RMSNorm, RoPE, grouped-query attention, SwiGLU, no biases.
    (LLAMA_NANO, {}, "fp32", 4, 128, "adamw"),
    (LLAMA_NANO, {}, "bf16", 4, 128, "adamw"),
    (LLAMA_NANO, {"recompute": "selective"}, "bf16", 4, 128, "adamw"),
    (LLAMA_NANO, {"recompute": "full"}, "fp32", 8, 128, "adamw"),
    (LLAMA_NANO, {"dp": 2}, "bf16", 8, 128, "adamw"),
    (LLAMA_NANO, {"tp": 2}, "bf16", 4, 128, "adamw"),
    (LLAMA_NANO, {"pp": 2}, "fp32", 8, 128, "adamw"),
    (LLAMA_NANO, {"dp": 2, "zero": 1}, "bf16", 8, 128, "adamw"),
    (LLAMA_NANO, {"dp": 2, "zero": 2}, "fp32", 8, 128, "adamw"),
    (LLAMA_NANO, {"dp": 2, "zero": 3}, "bf16", 8, 128, "adamw"),
    (LLAMA_TIED, {}, "bf16", 4, 128, "adamw"),
    (LLAMA_TIED, {"pp": 2, "recompute": "full"}, "bf16", 8, 128, "adamw"),
    (LLAMA_MICRO, {}, "bf16", 2, 256, "adamw"),
    (LLAMA_MICRO, {"recompute": "full"}, "bf16", 4, 256, "adamw"),
    (LLAMA_MICRO, {"tp": 2, "recompute": "selective"}, "fp32", 2, 256, "adamw"),
    (LLAMA_MICRO, {"pp": 2}, "bf16", 4, 256, "adamw"),
    (LLAMA_MICRO, {"dp": 2, "zero": 3, "recompute": "full"}, "bf16", 4, 256, "adamw"),
    # Eager attention (scores, fp32 softmax, dropped probabilities and their masks) and hidden dropout.
    (NANO_DROPOUT, {}, "fp32", 4, 128, "adamw", "eager"),
    (NANO_DROPOUT, {}, "bf16", 4, 128, "adamw", "eager"),
    (NANO_DROPOUT, {"recompute": "selective"}, "bf16", 4, 128, "adamw", "eager"),
    (NANO_DROPOUT, {"tp": 2}, "bf16", 4, 128, "adamw", "eager"),
    (NANO_DROPOUT, {"dp": 2, "zero": 2}, "fp32", 8, 128, "adamw", "eager"),
    (LLAMA_DROPOUT, {}, "bf16", 4, 128, "adamw", "eager"),
    (LLAMA_DROPOUT, {"recompute": "full"}, "fp32", 8, 128, "adamw", "eager"),
    (LLAMA_DROPOUT, {"pp": 2}, "bf16", 8, 128, "adamw", "eager"),
    (LLAMA_NANO, {}, "fp32", 4, 128, "adamw", "eager"),
    # The vocabulary split over tp: with pipeline stages (a tied head on the last stage), and padded.
    (NANO, {"tp": 2, "pp": 2}, "fp32", 8, 128, "adamw"),
    (LLAMA_NANO, {"tp": 2, "pp": 2}, "bf16", 8, 128, "adamw"),
    (NANO_ODD, {"tp": 2}, "bf16", 4, 128, "adamw"),
    # Master weights: bf16 weights without autocast, fp32 main gradients, fp32 masters in the optimizer.
    (NANO, {}, "bf16", 4, 128, "adamw", MASTER),
    (NANO, {"recompute": "selective"}, "bf16", 4, 128, "adamw", MASTER),
    (NANO, {"recompute": "full"}, "bf16", 8, 128, "adamw", MASTER),
    (NANO, {"dp": 2}, "bf16", 8, 128, "adamw", MASTER),
    (NANO, {"dp": 2}, "fp16", 8, 128, "adamw", MASTER),
    (NANO, {"tp": 2}, "bf16", 4, 128, "adamw", MASTER),
    (NANO, {"pp": 2}, "bf16", 8, 128, "adamw", MASTER),
    (NANO, {"dp": 2, "zero": 1}, "bf16", 8, 128, "adamw", MASTER),
    (NANO, {"dp": 2, "zero": 3}, "bf16", 8, 128, "adamw", MASTER),
    (LLAMA_NANO, {}, "bf16", 4, 128, "adamw", MASTER),
    (LLAMA_NANO, {"recompute": "selective"}, "bf16", 4, 128, "adamw", MASTER),
    (LLAMA_NANO, {"recompute": "full"}, "bf16", 8, 128, "adamw", MASTER),
    (LLAMA_NANO, {"dp": 2}, "bf16", 8, 128, "adamw", MASTER),
    (LLAMA_NANO, {"tp": 2}, "bf16", 4, 128, "adamw", MASTER),
    (LLAMA_NANO, {"pp": 2}, "bf16", 8, 128, "adamw", MASTER),
    (LLAMA_NANO, {"dp": 2, "zero": 1}, "bf16", 8, 128, "adamw", MASTER),
    (LLAMA_NANO, {"dp": 2, "zero": 3}, "bf16", 8, 128, "adamw", MASTER),
    (LLAMA_TIED, {"pp": 2, "recompute": "full"}, "bf16", 8, 128, "adamw", MASTER),
    (MICRO, {"dp": 2, "tp": 2, "zero": 1}, "bf16", 4, 256, "adamw", MASTER),
]


def error(predicted: int, measured: int) -> float:
    return (predicted - measured) / measured


def run_one(
    model: ModelSpec,
    plan: ParallelPlan,
    precision: str,
    global_batch: int,
    seq_len: int,
    optimizer: str,
    attention: str = "flash",
    master_weights: bool = False,
) -> dict:
    work = Workload(
        global_batch=global_batch,
        seq_len=seq_len,
        precision=precision,
        optimizer={"name": optimizer},
        attention=attention,
        master_weights=master_weights,
    )
    started = time.perf_counter()
    ranks = measure(Measurement(model=model, plan=plan, work=work))
    wall = time.perf_counter() - started
    measured = max(r.breakdown.total for r in ranks)
    predicted = estimate(model, plan, work).peak_bytes
    micro_batches = plan.accumulation(global_batch)
    megatron = memory_baselines.megatron(model, plan, seq_len=seq_len, precision=precision, micro_batches=micro_batches)
    deepspeed = memory_baselines.deepspeed(model, plan)
    return {
        "model": model.name,
        "plan": plan.label(),
        "precision": precision,
        "optimizer": optimizer,
        "attention": attention,
        "master_weights": master_weights,
        "global_batch": global_batch,
        "seq_len": seq_len,
        "measured_bytes": measured,
        "frenzy_bytes": predicted,
        "megatron_bytes": megatron,
        "deepspeed_bytes": deepspeed,
        "frenzy_error": error(predicted, measured),
        "megatron_error": error(megatron, measured),
        "deepspeed_error": error(deepspeed, measured),
        "per_rank_measured": [r.breakdown.total for r in ranks],
        "measure_wall_s": round(wall, 1),
    }


def summary(rows: list[dict], key: str) -> dict:
    errors = [abs(r[key]) for r in rows]
    return {"median_abs_error": statistics.median(errors), "worst_abs_error": max(errors)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run configurations whose label contains this text")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/memory_accuracy.json"))
    args = parser.parse_args()
    rows = []
    header = (
        f"{'model':<16} {'plan':<46} {'prec':<7} {'opt':<5} {'attn':<5} {'measured MiB':>12} {'frenzy':>8} {'megatron':>9} {'deepspeed':>9}"
    )
    print(header)
    for model, kwargs, precision, gb, seq, opt, *rest in GRID:
        extra = {"attention": rest[0]} if rest and isinstance(rest[0], str) else (rest[0] if rest else {})
        attention, master = extra.get("attention", "flash"), extra.get("master_weights", False)
        plan = ParallelPlan(**({"micro_batch": 2} | kwargs))
        prec = f"{precision}{'+m' if master else ''}"  # +m: master weights
        if args.only not in f"{model.name} {plan.label()} {prec} {opt} {attention}{' master' if master else ''}":
            continue
        r = run_one(model, plan, precision, gb, seq, opt, attention, master)
        rows.append(r)
        print(
            f"{r['model']:<16} {r['plan']:<46} {prec:<7} {opt:<5} {attention:<5} {r['measured_bytes'] / 2**20:>12.3f}"
            f" {r['frenzy_error']:>+8.2%} {r['megatron_error']:>+9.1%} {r['deepspeed_error']:>+9.1%}",
            flush=True,
        )
    if not rows:
        sys.exit("no configuration matches --only")
    result = {
        "configurations": len(rows),
        "frenzy": summary(rows, "frenzy_error"),
        "megatron": summary(rows, "megatron_error"),
        "deepspeed": summary(rows, "deepspeed_error"),
        "rows": rows,
    }
    print()
    for name in ("frenzy", "megatron", "deepspeed"):
        s = result[name]
        print(f"{name:<10} median |error| {s['median_abs_error']:.2%}   worst |error| {s['worst_abs_error']:.2%}")
    write_result(result, args.json)


if __name__ == "__main__":
    main()
