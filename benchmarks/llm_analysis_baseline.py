"""llm-analysis's predicted per-GPU training peak for published points (a baseline column of
``memory_published``). llm-analysis (``pip install frenzy-prefect[benchmarks]``, or a separate
virtualenv) pins old transformers/huggingface-hub, so this module imports only it and the
standard library: ``memory_published`` imports it in-process when llm-analysis is installed
there, or runs it with another interpreter (``LLM_ANALYSIS_PYTHON``):

    echo '[point, ...]' | $LLM_ANALYSIS_PYTHON -m benchmarks.llm_analysis_baseline

prints ``{id: bytes or "error: ..."}``. The peak is llm-analysis's
``(weight+op_state+grad+act)_memory_per_gpu``. The mapping follows the published-data notes
(benchmarks/data/memory_published.md): its GPU only changes what is left, never the peak; its
"selective" is Megatron's (attention core), not torchtitan's op-level SAC.
"""

from __future__ import annotations

import json
import logging
import sys

PEAK_KEY = "(weight+op_state+grad+act)_memory_per_gpu"
GPU_NAME = {"H100": "h100-sxm-80gb", "A100": "a100-sxm-80gb"}


def predict(point: dict) -> int:
    from llm_analysis.analysis import ActivationRecomputation, DSZeRO, LLMAnalysis
    from llm_analysis.config import ModelConfig, ParallelismConfig, get_dtype_config_by_name, get_gpu_config_by_name

    m, r = point["model"], point["run"]
    h, ffn = m["hidden_size"], m["intermediate_size"]
    gated = m.get("hidden_act") == "silu"
    model = ModelConfig(
        name=m.get("name", point["id"]),
        num_layers=m["num_hidden_layers"],
        n_head=m["num_attention_heads"],
        hidden_dim=h,
        vocab_size=m["vocab_size"],
        max_seq_len=max(r["seq_len"], m.get("max_position_embeddings") or 0),
        num_key_value_heads=m["num_key_value_heads"],
        ffn_embed_dim=ffn,
        expansion_ratio=ffn / h,
        model_type="llama" if gated else "gpt2",
    )
    gpu = get_gpu_config_by_name(next(v for k, v in GPU_NAME.items() if point["gpu"].startswith(k)))
    parallel = ParallelismConfig(tp_size=r["tp"], pp_size=r["pp"], dp_size=r["dp"], sp_size=r["tp"] if r.get("sequence_parallel") else 1)
    analysis = LLMAnalysis(model, gpu, get_dtype_config_by_name("w16a16e16"), parallel)
    recompute = {
        "none": ActivationRecomputation.NONE,
        "selective": ActivationRecomputation.SELECTIVE,
        "full": ActivationRecomputation.FULL,
    }
    summary = analysis.training(
        batch_size_per_gpu=r["micro_batch"],
        global_batch_size=r["global_batch"],
        seq_len=r["seq_len"],
        activation_recomputation=recompute[r["recompute"]],
        ds_zero=DSZeRO(r["zero"]),
        flash_attn=r.get("attention") == "flash",
        softmax_dropout=bool((r.get("dropout") or {}).get("attention")),
        mlp_gated_linear_units=gated,
    )
    return round(summary[PEAK_KEY])


def predict_all(points: list[dict]) -> dict[str, int | str]:
    logging.getLogger().setLevel(logging.ERROR)
    out: dict[str, int | str] = {}
    for point in points:
        try:
            out[point["id"]] = predict(point)
        except Exception as exc:  # a baseline that cannot take a point says why, in its column
            out[point["id"]] = f"error: {type(exc).__name__}: {exc}"
    return out


if __name__ == "__main__":
    json.dump(predict_all(json.load(sys.stdin)), sys.stdout)
