"""Predicted time of one optimizer step, from FLOPs and communication volume.

Assumptions (to be calibrated from measured step times):
- compute reaches ACHIEVABLE_FRACTION of the GPU type's dense peak (bf16/fp16 tensor peak for
  mixed precision, fp32 peak otherwise);
- FLOPs per token are 6N + 12*l*h*s (Kaplan et al.; attention scores), plus one more forward
  (2N) under full recomputation;
- 1F1B adds the bubble fraction (pp - 1) / accumulation;
- data parallelism ring-all-reduces fp32 gradients once per step; tensor parallelism
  all-reduces 4 activations per layer per micro-batch; both over NVLink/PCIe inside a node and
  over the cluster network across nodes.
"""

from __future__ import annotations

from frenzy_prefect.memory.analytic import COMPUTE_BYTES, FP32, stage_parameters
from frenzy_prefect.spec.cluster import GpuType
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.request import Precision

ACHIEVABLE_FRACTION = 0.4


def _ring_all_reduce_s(nbytes: float, peers: int, gbps: float) -> float:
    return 0.0 if peers <= 1 else 2 * (peers - 1) / peers * nbytes / (gbps * 1e9)


def step_time_s(
    model: ModelSpec,
    plan: ParallelPlan,
    *,
    global_batch: int,
    seq_len: int,
    precision: Precision,
    gpu: GpuType,
    link_gbps: float,
) -> float:
    """``link_gbps`` is the slowest link the plan's collectives cross (node-internal or network)."""
    accumulation = plan.accumulation(global_batch)
    tokens = global_batch * seq_len
    per_token = 6 * model.parameters + 12 * model.layers * model.hidden * seq_len
    if plan.recompute == "full":
        per_token += 2 * model.parameters
    peak = (gpu.fp32_tflops if precision == "fp32" else gpu.half_tflops) * 1e12
    compute = tokens * per_token / (plan.gpus * peak * ACHIEVABLE_FRACTION)
    compute *= 1 + (plan.pp - 1) / accumulation

    grads = FP32 * max(stage_parameters(model, plan, s) for s in range(plan.pp))
    dp_comm = _ring_all_reduce_s(grads, plan.dp, link_gbps)
    layers_per_stage = -(-model.layers // plan.pp)
    activation = seq_len * plan.micro_batch * model.hidden * COMPUTE_BYTES[precision]
    tp_comm = 4 * layers_per_stage * accumulation * _ring_all_reduce_s(activation, plan.tp, link_gbps)
    return compute + dp_comm + tp_comm
