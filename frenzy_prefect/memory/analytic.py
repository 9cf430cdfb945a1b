"""Analytic per-GPU peak memory: model states plus activations plus runtime overhead.

Model states follow ZeRO (Rajbhandari et al. 2020); activations follow Korthikanti et al. 2022,
Table 2; pipeline stages hold 1F1B's in-flight micro-batches. The engine modelled here keeps fp32
weights and gradients (torch autocast for bf16/fp16) and buckets gradients in place
(DDP gradient_as_bucket_view), so data parallelism adds no gradient copy.
"""

from __future__ import annotations

import math

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.spec.cluster import GpuType
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import MemoryBreakdown, MemoryEstimate, ParallelPlan
from frenzy_prefect.spec.request import Precision

ACTIVATION_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
MASTER_BYTES = 4  # fp32 weights and fp32 gradients, whatever the compute precision


def check_plan(model: ModelSpec, plan: ParallelPlan) -> None:
    """Reject plans the model cannot be split into, naming the accepted values."""
    if model.heads % plan.tp or model.hidden % plan.tp:
        ok = [t for t in range(1, model.heads + 1) if model.heads % t == 0 and model.hidden % t == 0]
        raise FrenzyError(f"tp ({plan.tp}) must divide heads ({model.heads}) and hidden ({model.hidden}); accepted: {ok}")
    if plan.pp > model.layers:
        raise FrenzyError(f"pp ({plan.pp}) must not exceed the number of layers ({model.layers})")


def stage_layers(layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage; the first stages take the remainder."""
    base, extra = divmod(layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def stage_parameters(model: ModelSpec, plan: ParallelPlan, stage: int) -> int:
    """Parameters on one rank of a stage: its layers, embeddings on the first stage, the head on
    the last (with a tied copy of the embedding when the two stages differ), split over tp."""
    n = stage_layers(model.layers, plan.pp)[stage] * model.layer_parameters
    if stage == 0:
        n += model.embedding_parameters
    if stage == plan.pp - 1:
        n += model.head_parameters
        if model.tied_embeddings and plan.pp > 1:
            n += model.vocab_size * model.hidden
    return math.ceil(n / plan.tp)


def layer_activation_bytes(model: ModelSpec, plan: ParallelPlan, seq_len: int, precision: Precision, recompute: str) -> float:
    """Korthikanti Table 2, one layer, one micro-batch (their constants count 16-bit tensors)."""
    s, b, h, a, t = seq_len, plan.micro_batch, model.hidden, model.heads, plan.tp
    scale = ACTIVATION_BYTES[precision] / 2
    if recompute == "full":
        return 2 * s * b * h * scale
    attention_scores = 5 * a * s / (h * t) if recompute == "none" else 0.0
    return s * b * h * (10 + 24 / t + attention_scores) * scale


def activation_bytes(model: ModelSpec, plan: ParallelPlan, seq_len: int, precision: Precision, accumulation: int, stage: int) -> int:
    s, b = seq_len, plan.micro_batch
    in_flight = min(plan.pp - stage, accumulation)  # 1F1B: stage i holds pp - i micro-batches
    layers = stage_layers(model.layers, plan.pp)[stage]
    total = layers * in_flight * layer_activation_bytes(model, plan, seq_len, precision, plan.recompute)
    if plan.recompute == "full":  # one layer is rematerialised in full during its backward
        total += layer_activation_bytes(model, plan, seq_len, precision, "none")
    elem = ACTIVATION_BYTES[precision]
    if stage == 0:  # embedding output
        total += in_flight * s * b * model.hidden * elem
    if stage == plan.pp - 1:  # logits, plus the fp32 copy the loss and its gradient use
        total += s * b * model.vocab_size / plan.tp * (elem + 4)
    return math.ceil(total)


def estimate(
    model: ModelSpec,
    plan: ParallelPlan,
    *,
    global_batch: int,
    seq_len: int,
    precision: Precision,
    optimizer_bytes_per_param: int,
    gpu: GpuType | None = None,
) -> MemoryEstimate:
    """Predicted peak bytes per GPU for every pipeline stage of ``plan``."""
    check_plan(model, plan)
    accumulation = plan.accumulation(global_batch)
    dp = plan.dp
    stages = []
    for stage in range(plan.pp):
        params = stage_parameters(model, plan, stage)
        stages.append(
            MemoryBreakdown(
                params=math.ceil(MASTER_BYTES * params / (dp if plan.zero >= 3 else 1)),
                grads=math.ceil(MASTER_BYTES * params / (dp if plan.zero >= 2 else 1)),
                optimizer=math.ceil(optimizer_bytes_per_param * params / (dp if plan.zero >= 1 else 1)),
                activations=activation_bytes(model, plan, seq_len, precision, accumulation, stage),
                other=gpu.runtime_overhead_bytes if gpu else 0,
            )
        )
    return MemoryEstimate(per_stage=stages)
