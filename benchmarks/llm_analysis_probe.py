"""Probe: llm-analysis's predicted per-GPU training peak for one published point.

Not part of the product.  Needs the PyPI package ``llm-analysis`` (tested with
0.2.2, which pulls transformers<5, huggingface-hub 0.14.x, fire 0.5; no torch,
no pydantic), e.g. in a throwaway venv:

    python3 -m venv /tmp/lla && /tmp/lla/bin/pip install llm-analysis==0.2.2
    /tmp/lla/bin/python benchmarks/llm_analysis_probe.py [point-id]

It reads ``benchmarks/data/memory_published.json`` and maps the point onto
llm-analysis's ``LLMAnalysis(...).training(...)``.  The per-GPU peak is the
summary key ``"(weight+op_state+grad+act)_memory_per_gpu"`` (bytes).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from llm_analysis.analysis import ActivationRecomputation, DSZeRO, LLMAnalysis
from llm_analysis.config import (
    ModelConfig,
    ParallelismConfig,
    get_dtype_config_by_name,
    get_gpu_config_by_name,
)

DATA = Path(__file__).resolve().parent / "data" / "memory_published.json"
DEFAULT_ID = "torchtitan-llama3.1-8b-fsdp8-sac-eager-h100"
PEAK_KEY = "(weight+op_state+grad+act)_memory_per_gpu"

# llm-analysis ships only these H100/A100 configs; the GPU only changes
# "memory_left"/"max_batch_size_per_gpu", never the predicted peak.
GPU_NAME = {"H100": "h100-sxm-80gb", "A100": "a100-sxm-80gb"}
RECOMPUTE = {
    "none": ActivationRecomputation.NONE,
    # llm-analysis "selective" = Megatron selective (recompute only the attention
    # core QK^T/softmax/dropout/AV); torchtitan's per-op SAC is not the same thing.
    "selective": ActivationRecomputation.SELECTIVE,
    "full": ActivationRecomputation.FULL,
}


def predict(point: dict) -> dict:
    m, r = point["model"], point["run"]
    h, ffn = m["hidden_size"], m["intermediate_size"]
    model = ModelConfig(
        name=m.get("name", point["id"]),
        num_layers=m["num_hidden_layers"],
        n_head=m["num_attention_heads"],
        hidden_dim=h,
        vocab_size=m["vocab_size"],
        max_seq_len=max(r["seq_len"], m.get("max_position_embeddings") or 0),
        num_key_value_heads=m["num_key_value_heads"],
        ffn_embed_dim=ffn,
        # ModelConfig asserts ffn % hidden == 0 unless expansion_ratio is given
        # (Llama-3 8B: 14336 / 4096 = 3.5).
        expansion_ratio=ffn / h,
        model_type="llama" if m.get("hidden_act") == "silu" else "gpt2",
    )
    gpu = get_gpu_config_by_name(next(v for k, v in GPU_NAME.items() if point["gpu"].startswith(k)))
    dtype = get_dtype_config_by_name("w16a16e16")  # bf16/fp16 weights+acts
    par = ParallelismConfig(
        tp_size=r["tp"],
        pp_size=r["pp"],
        dp_size=r["dp"],
        sp_size=r["tp"] if r.get("sequence_parallel") else 1,
    )
    la = LLMAnalysis(model, gpu, dtype, par)
    summary = la.training(
        batch_size_per_gpu=r["micro_batch"],
        global_batch_size=r["global_batch"],
        seq_len=r["seq_len"],
        activation_recomputation=RECOMPUTE[r["recompute"]],
        ds_zero=DSZeRO(r["zero"]),
        flash_attn=r.get("attention") == "flash",
        softmax_dropout=bool((r.get("dropout") or {}).get("attention")),
        mlp_gated_linear_units=m.get("hidden_act") == "silu",
    )
    return summary


def main() -> None:
    logging.getLogger().setLevel(logging.WARNING)
    pid = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_ID
    points = {p["id"]: p for p in json.loads(DATA.read_text())["points"]}
    point = points[pid]
    s = predict(point)
    peak = s[PEAK_KEY]
    meas = point["measured"]["bytes"]
    print(f"point: {pid}")
    print(f"llm-analysis {PEAK_KEY}: {peak:.0f} B = {peak / 2**30:.2f} GiB")
    for k in ("weight_memory_per_gpu", "gradient_memory_per_gpu", "optimizer_state_memory_per_gpu", "activation_memory_per_gpu"):
        print(f"  {k}: {s[k] / 2**30:.2f} GiB")
    print(f"measured ({point['measured']['kind']}): {meas} B = {meas / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
