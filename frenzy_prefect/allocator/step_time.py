"""Predicted time of one optimizer step, from FLOPs, bytes moved and link bandwidths.

Assumptions (each a knob; ``fit_achievable_fraction`` calibrates the first from measured steps):
- compute runs at the GPU type's ``achievable_fraction`` of its dense peak (bf16/fp16 tensor
  peak for mixed precision, fp32 peak otherwise), scaled by t / (t + SATURATION_TOKENS) for a
  micro-batch of t tokens per tensor-parallel rank: small GEMMs leave the GPU under-fed;
- FLOPs per token are 6N + 12*l*h*s (Kaplan et al.; attention scores), plus one more forward
  (2N + 4*l*h*s) under full recomputation and the attention core (4*l*h*s) under selective;
- 1F1B adds the bubble fraction (pp - 1) / accumulation;
- data parallelism ring-all-reduces fp32 gradients once per step (ZeRO-3 moves 1.5x that:
  weights gathered for forward and backward, gradients reduce-scattered); tensor parallelism
  all-reduces 4 activations per layer per micro-batch; pipeline stages pass one activation
  forward and one gradient back per micro-batch and boundary;
- tensor-parallel groups stay inside a node (the placer guarantees it); data- and
  pipeline-parallel traffic crosses the network when the placement spans nodes;
- communication does not overlap compute (conservative: DDP hides part of the all-reduce);
- the optimizer step is memory-bound: 32 bytes read and written per parameter it updates.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.memory.analytic import COMPUTE_BYTES, FP32
from frenzy_prefect.spec.gpu import GpuType
from frenzy_prefect.spec.layout import stage_shapes
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.workload import Workload

SATURATION_TOKENS = 256
OPTIMIZER_BYTES_MOVED = 32


def ring_all_reduce_factor(peers: int) -> float:
    """How many times a ring all-reduce moves its buffer over each link: 2(n - 1) / n."""
    return 0.0 if peers <= 1 else 2 * (peers - 1) / peers


def _ring_all_reduce_s(nbytes: float, peers: int, gbps: float) -> float:
    return ring_all_reduce_factor(peers) * nbytes / (gbps * 1e9)


def boundary_activation_bytes(model: ModelSpec, plan: ParallelPlan, work: Workload) -> int:
    """One micro-batch's activation (or its gradient) passed between pipeline stages."""
    return work.seq_len * plan.micro_batch * model.hidden * COMPUTE_BYTES[work.precision]


def tensor_parallel_s(model: ModelSpec, plan: ParallelPlan, work: Workload, gpu: GpuType) -> float:
    """Tensor-parallel all-reduces of one micro-batch on one stage: 4 activations per layer."""
    layers_per_stage = -(-model.layers // plan.pp)
    return 4 * layers_per_stage * _ring_all_reduce_s(boundary_activation_bytes(model, plan, work), plan.tp, gpu.link_gbps)


def optimizer_step_s(updated_parameters: float, gpu: GpuType) -> float:
    """The memory-bound optimizer step over ``updated_parameters``."""
    return OPTIMIZER_BYTES_MOVED * updated_parameters / (gpu.memory_bandwidth_gbps * 1e9)


def peak_flops(gpu: GpuType, precision: str) -> float:
    """The dense peak a workload of ``precision`` runs at: the fp32 peak, else the half-precision tensor peak."""
    return (gpu.fp32_tflops if precision == "fp32" else gpu.half_tflops) * 1e12


def saturation(tokens: float) -> float:
    """The fraction of peak a micro-batch of ``tokens`` per rank keeps busy."""
    return tokens / (tokens + SATURATION_TOKENS)


@lru_cache(maxsize=4096)
def flops_per_token(model: ModelSpec, seq_len: int, recompute: str = "none") -> float:
    attention = 12 * model.layers * model.hidden * seq_len
    extra = {"none": 0.0, "selective": 4 * model.layers * model.hidden * seq_len, "full": 2 * model.parameters + attention / 3}
    return 6 * model.parameters + attention + extra[recompute]


class StepTime(NamedTuple):
    """A predicted step: compute at 100% of peak, everything else, and the type's fraction."""

    compute_at_peak_s: float
    other_s: float
    achievable_fraction: float

    @property
    def seconds(self) -> float:
        return self.compute_at_peak_s / self.achievable_fraction + self.other_s


def predict_step(model: ModelSpec, plan: ParallelPlan, work: Workload, *, gpu: GpuType, network_gbps: float | None = None) -> StepTime:
    """``network_gbps`` is the bandwidth between nodes when the placement spans nodes, None
    when it fits in one."""
    accumulation = plan.accumulation(work.global_batch)
    seq_len = work.seq_len
    peak = peak_flops(gpu, work.precision)
    per_rank_tokens = plan.micro_batch * seq_len / plan.tp
    compute = work.tokens * flops_per_token(model, seq_len, plan.recompute) / (plan.gpus * peak * saturation(per_rank_tokens))
    compute *= 1 + (plan.pp - 1) / accumulation
    split = plan.layer_split(model.layers)
    compute *= max(split) * plan.pp / model.layers  # an uneven split runs at its largest stage's pace
    if plan.replica_micro_batches:  # and uneven replicas at the largest's
        compute *= max(plan.replica_micro_batches) * plan.dp / sum(plan.replica_micro_batches)

    between = network_gbps or gpu.link_gbps
    stage_params = max(params for _, params, _ in stage_shapes(model, plan.tp, split))
    dp_comm = _ring_all_reduce_s(FP32 * stage_params, plan.dp, between) * (1.5 if plan.zero == 3 else 1.0)
    activation = boundary_activation_bytes(model, plan, work)
    tp_comm = accumulation * tensor_parallel_s(model, plan, work, gpu)
    pp_comm = 0.0 if plan.pp == 1 else 2 * (accumulation + plan.pp - 1) * activation / (between * 1e9)
    optimizer = optimizer_step_s(stage_params / (plan.dp if plan.zero else 1), gpu)
    return StepTime(compute, dp_comm + tp_comm + pp_comm + optimizer, gpu.achievable_fraction)


def predict_mixed_step(model: ModelSpec, plan: ParallelPlan, work: Workload, *, gpus: dict[str, GpuType], network_gbps: float) -> StepTime:
    """A plan across GPU types (``plan.stage_types`` or ``replica_types``, each named in ``gpus``):
    every worker computes its stage's layers of its replica's micro-batches on its own type; a
    replica's 1F1B runs (micro-batches + pp - 1) slots of its slowest stage, the step waits for
    the slowest replica. Types sit on different nodes, so the stages' transfers and the
    data-parallel all-reduce cross the network (``network_gbps``); tensor parallelism stays
    inside a node of one type. The compute is returned already at each type's achievable
    fraction (``achievable_fraction`` 1)."""
    split, counts = plan.layer_split(model.layers), plan.replica_accumulation(work.global_batch)
    if plan.replica_types:
        types = [[gpus[name]] * plan.pp for name in plan.replica_types]  # [replica][stage]
    elif plan.stage_types:
        types = [[gpus[name] for name in plan.stage_types]] * plan.dp
    else:
        raise FrenzyError(f"plan {plan.label()} names no GPU types: its step time is predict_step's on the allocation's type")
    per_rank_tokens = plan.micro_batch * work.seq_len / plan.tp
    micro_flops = plan.micro_batch * work.seq_len * flops_per_token(model, work.seq_len, plan.recompute) / plan.tp

    def speed(gpu: GpuType) -> float:
        return peak_flops(gpu, work.precision) * gpu.achievable_fraction * saturation(per_rank_tokens)

    compute = max(
        (m + plan.pp - 1) * max(micro_flops * layers / model.layers / speed(gpu) for layers, gpu in zip(split, row, strict=True))
        for m, row in zip(counts, types, strict=True)
    )
    stage_params = max(params for _, params, _ in stage_shapes(model, plan.tp, split))
    dp_comm = _ring_all_reduce_s(FP32 * stage_params, plan.dp, network_gbps) * (1.5 if plan.zero == 3 else 1.0)
    pp_comm = 0.0 if plan.pp == 1 else 2 * (max(counts) + plan.pp - 1) * boundary_activation_bytes(model, plan, work) / (network_gbps * 1e9)
    used = {gpu.name: gpu for row in types for gpu in row}.values()
    tp_comm = max(counts) * max(tensor_parallel_s(model, plan, work, gpu) for gpu in used)
    optimizer = max(optimizer_step_s(stage_params / (plan.dp if plan.zero else 1), gpu) for gpu in used)
    return StepTime(compute, dp_comm + pp_comm + tp_comm + optimizer, 1.0)


def fit_achievable_fraction(samples: list[tuple[StepTime, float]]) -> float:
    """The fraction that best explains measured steps (``samples``: a prediction and the
    measured seconds): least squares of measured - other = compute at peak / fraction."""
    if not samples:
        raise ValueError("fitting needs at least one measured step time")
    num = sum(p.compute_at_peak_s**2 for p, _ in samples)
    den = sum(p.compute_at_peak_s * (measured - p.other_s) for p, measured in samples)
    if den <= 0:
        raise ValueError("measured step times are not longer than the predicted communication; nothing to fit")
    return min(1.0, num / den)
