"""Published memory formulas the estimator is compared with, re-derived from their papers and
documentation (not copied code):

- Megatron-LM's theoretical memory (megatron/training/theoretical_memory_usage.py, as of 2025):
  model states at 18 bytes per parameter for mixed precision with Adam (2 weights + 4 fp32
  gradient + 4 fp32 master + 8 Adam moments; 16 in fp32), 6 + 12/dp with its distributed
  optimizer (ZeRO-1-like, used here for any ZeRO stage), on the most loaded shard; activations
  of the first stage from Korthikanti et al. 2022 Table 2 as that file writes them (see
  ``megatron``).
- DeepSpeed's model-state estimators (estimate_zero2/zero3_model_states_mem_needs): ZeRO-2
  4N + 16N/n, ZeRO-3 4 * largest layer + 18N/n bytes; for stages 0 and 1, which it has no
  estimator for, the ZeRO paper's (2 + 2 + K)N and (2 + 2)N + KN/n with K = 12. No activations.
"""

from __future__ import annotations

from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import ParallelPlan

HALF = {"fp32": False, "bf16": True, "fp16": True}


def megatron(
    model: ModelSpec,
    plan: ParallelPlan,
    *,
    seq_len: int,
    precision: str,
    micro_batches: int,
    sequence_parallel: bool = False,
    vpp: int | None = None,
    vocab: int | None = None,
) -> int:
    """Megatron-LM's theoretical memory (megatron/training/theoretical_memory_usage.py), its
    most loaded shard: parameters as it counts them (grouped-query K/V, SwiGLU's 3/2 MLP, RMSNorm
    without a shift) on (layers/pp + one embedding)/tp, another embedding/tp when untied and
    pp = 1, at 18 bytes (6 + 12/dp with the distributed optimizer, which any ZeRO stage stands
    for here); activations on the first stage, sbh(18 + 4f/h)/t per layer with sequence
    parallelism and selective recomputation, else sbh(10 + 24/t) per layer (its
    ``compute_activation_memory_without_sp``, which has no attention-score term and a 5 %
    allowance), plus the embedding's ids and dropout mask and, for pp = 1, the output layer,
    scaled by the interleaved schedule's penalty or by min(1, micro-batches / pp). fp32 doubles
    activations (the formula counts 16-bit elements). ``vocab``: the padded vocabulary (default
    the model's)."""
    s, b, h, t, p, L = seq_len, plan.micro_batch, model.hidden, plan.tp, plan.pp, model.layers
    V = vocab or model.padded_vocab
    scale = 1 if HALF[precision] else 2
    q = model.kv_heads / model.heads
    gated = 1.5 if model.mlp == "swiglu" else 1
    norm = 1 if model.norm == "rmsnorm" else 2
    layer = 2 * h * (model.ffn_hidden * gated + norm) + 2 * h * h * (1 + q)
    block = L * layer + norm * h
    embedding = h * V
    shard = (block / p + embedding) / t + (embedding / t if not model.tied_embeddings and p == 1 else 0)
    states = shard * (6 + 12 / plan.dp if plan.zero else (18 if HALF[precision] else 16))
    if sequence_parallel and plan.recompute == "selective":
        acts = s * b * h * (18 + 4 * model.ffn_hidden / h) * L + 8 * s * b * p + s * b * h * p
        acts = _pipeline_factor(acts, p, vpp, micro_batches)
        if p == 1:
            acts += s * b * h * 4 * (1 + V / h)
        acts /= t
    else:
        per_layer = 2 * s * b * h if plan.recompute == "full" else s * b * h * (10 + 24 / t)
        acts = per_layer * L + 8 * s * b * p + s * b * h * p
        acts = _pipeline_factor(acts, p, vpp, micro_batches)
        if p == 1:
            acts += (s * b * V / t + s * b * h) * 2
        acts *= 1.05
    return round(states + acts * scale)


def _pipeline_factor(acts: float, p: int, vpp: int | None, micro_batches: int) -> float:
    if vpp and vpp > 1:
        return acts * (1 + (p - 1) / (p * vpp))
    if p > 1:
        return acts * min(1, micro_batches / p)
    return acts


def deepspeed(model: ModelSpec, plan: ParallelPlan) -> int:
    n, gpus = model.parameters, plan.dp  # model states of the whole model over the data-parallel ranks
    if plan.zero == 0:
        return 16 * n
    if plan.zero == 1:
        return 4 * n + 12 * n // gpus
    if plan.zero == 2:
        return 4 * n + 16 * n // gpus
    largest_layer = max(model.layer_parameters, model.padded_vocab * model.hidden)
    return 4 * largest_layer + 18 * n // gpus
