"""Published memory formulas the estimator is compared with, re-derived from their papers and
documentation (not copied code):

- Megatron-LM's theoretical memory: model states at 18 bytes per parameter for mixed precision
  with Adam (2 weights + 4 fp32 gradient + 4 fp32 master + 8 Adam moments; 16 in fp32), 6 + 12/dp
  with its distributed optimizer (ZeRO-1-like, used here for any ZeRO stage); activations per
  layer from Korthikanti et al. 2022 Table 2 (16-bit: sbh(10 + 24/t + 5as/(ht)) without
  recomputation, sbh(10 + 24/t) selective, 2sbh full; twice that in fp32), times the layers of
  the most loaded stage times 1F1B's in-flight micro-batches (p on the first stage), plus the
  output layer's logits (2sbV/t, fp32 copy 4sbV/t) on the last stage.
- DeepSpeed's model-state estimators (estimate_zero2/zero3_model_states_mem_needs): ZeRO-2
  4N + 16N/n, ZeRO-3 4 * largest layer + 18N/n bytes; for stages 0 and 1, which it has no
  estimator for, the ZeRO paper's (2 + 2 + K)N and (2 + 2)N + KN/n with K = 12. No activations.
"""

from __future__ import annotations

from frenzy_prefect.spec.layout import stage_layer_counts, stage_parameters
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import ParallelPlan

HALF = {"fp32": False, "bf16": True, "fp16": True}


def megatron(model: ModelSpec, plan: ParallelPlan, *, seq_len: int, precision: str, micro_batches: int) -> int:
    s, b, h, a, V, t = seq_len, plan.micro_batch, model.hidden, model.heads, model.padded_vocab, plan.tp
    scale = 1 if HALF[precision] else 2  # Table 2 counts 16-bit elements
    if plan.recompute == "full":
        per_layer = 2 * s * b * h
    else:
        per_layer = s * b * h * (10 + 24 / t + (5 * a * s / (h * t) if plan.recompute == "none" else 0))
    peak = 0.0
    for stage in range(plan.pp):
        params = stage_parameters(model, plan, stage)
        if plan.zero:
            states = params * (6 + 12 / plan.dp)
        else:
            states = params * (18 if HALF[precision] else 16)
        in_flight = min(plan.pp - stage, micro_batches)
        acts = stage_layer_counts(model.layers, plan.pp)[stage] * in_flight * per_layer * scale
        if stage == plan.pp - 1:
            acts += (2 * scale + 4) * s * b * V / t
        peak = max(peak, states + acts)
    return round(peak)


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
