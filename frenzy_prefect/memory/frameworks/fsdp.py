"""Per-GPU peak memory of a plan as torchtitan trains a Llama with torch FSDP2 (``fully_shard``).

Assumptions, each with its source (re-derived, no code copied):

- Sharding (torchtitan ``parallelize_llama`` / ``apply_fsdp``): ``fully_shard`` on every
  transformer block and on the root (token embedding, final norm, output layer); ZeRO-3 over
  the dp ranks (``zero=3`` is the only stage modelled). Sharded fp32 parameters (4N/dp), fp32
  AdamW states (8N/dp) and, from the backward until the next step's ``zero_grad``
  (``set_to_none``), sharded fp32 gradients (4N/dp): 16N/dp in all at the optimizer step.
- Mixed precision (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, torchtitan's
  default): blocks compute on bf16 parameters all-gathered just before use. A block is freed after
  its forward (``reshard_after_forward=True``) except the last one, and the root is never freed
  between forward and backward (FSDP2 keeps the root unsharded); prefetching keeps at most two
  blocks gathered besides. Gradients are reduce-scattered in ``reduce_dtype``: a block's bf16
  gradients plus their fp32 copy (the reduce-scatter input) at once.
- Activations (torchtitan Llama: RMSNorm, RoPE in fp32 complex, ``repeat_kv``, SDPA flash,
  SwiGLU) per token and layer, bf16: without checkpointing 20h + 4kv + 8f bytes plus the fp32
  log-sum-exp (4a); selective op-level checkpointing (``activation_checkpoint.mode=selective``,
  ``selective_ac_option=op``: the outputs of SDPA and of every other matmul, wq, wv, w1, w2, are
  saved) keeps the block input and those: 2(4h + kv + f) + 4a; full checkpointing keeps the
  block input (2h) and re-materialises one block in its backward. Eager attention adds the
  softmax scores (2as per token, bf16).
- Loss (torchtitan ``cross_entropy_loss``): bf16 logits of the full vocabulary are upcast to fp32
  and go through log_softmax (output saved, 4sbV) and nll_loss; the bf16 logits are deleted
  before the backward, where nll_loss's gradient, the saved log_softmax output and its
  gradient coexist (12 sbV bytes).
- Tensor parallelism (torchtitan's 2D: FSDP over dp, TP inside, sequence-parallel norms, loss
  parallel): everything above that is sharded by TP is divided by t (parameters, activations,
  logits); norms' weights are replicated. Pipeline parallelism is not modelled (refused).
- Not modelled: Float8, context parallelism, CPU offload, torch.compile's different saved sets
  (compiled blocks save less than eager; the estimate is eager's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.spec.layout import check_tp
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import MemoryBreakdown, MemoryEstimate, ParallelPlan
from frenzy_prefect.spec.workload import Attention, Precision, Workload

FP32 = 4
BF16 = 2


@dataclass(frozen=True)
class FsdpOptions:
    """torchtitan settings that change memory and that a ParallelPlan does not carry."""

    reduce_dtype: Literal["fp32", "bf16"] = "fp32"  # MixedPrecisionPolicy.reduce_dtype


def _check(model: ModelSpec, plan: ParallelPlan, precision: Precision) -> None:
    if plan.zero != 3 or plan.pp != 1:
        raise FrenzyError(
            f"fsdp models torchtitan's FSDP2: zero=3 with pp=1 (tp >= 1 as 2D TP inside FSDP); got zero={plan.zero}, pp={plan.pp}"
        )
    if precision != "bf16":
        raise FrenzyError(f"fsdp models torchtitan's bf16 mixed precision (fp32 master, bf16 compute); got precision={precision}")
    check_tp(model, plan.tp)


def layer_bytes_per_token(model: ModelSpec, recompute: str, attention: Attention, seq_len: int) -> tuple[int, int]:
    """(saved, saved without checkpointing) bytes per token of one block, before the division by tp."""
    h, kv, f, a = model.hidden, model.kv_width, model.ffn_hidden, model.heads
    lse = FP32 * a if attention == "flash" else BF16 * a * seq_len  # eager: the softmax scores instead
    full = 20 * h + 4 * kv + 8 * f + lse + 2 * FP32  # two RMSNorms' fp32 reciprocal RMS
    if recompute == "none":
        return full, full
    if recompute == "selective":
        return BF16 * (4 * h + kv + f) + lse, full
    return BF16 * h, full


def block_parameters(model: ModelSpec, tp: int) -> int:
    """One block's parameters on a TP rank (norm weights replicated)."""
    return (model.layer_parameters - 2 * model.norm_parameters) // tp + 2 * model.norm_parameters


def root_parameters(model: ModelSpec, tp: int) -> int:
    """The root's parameters on a TP rank: embedding, final norm, output layer (vocabulary-sharded)."""
    vocab = model.padded_vocab * model.hidden
    return vocab // tp + model.norm_parameters + (0 if model.tied_embeddings else vocab // tp)


def estimate(
    model: ModelSpec, plan: ParallelPlan, work: Workload, *, options: FsdpOptions | None = None, overhead_bytes: int = 0
) -> MemoryEstimate:
    """The peak bytes of one GPU (every rank is alike: one stage)."""
    options = options or FsdpOptions()
    _check(model, plan, work.precision)
    plan.accumulation(work.global_batch)
    t, dp, L = plan.tp, plan.dp, model.layers
    block, root = block_parameters(model, t), root_parameters(model, t)
    shard = math.ceil((L * block + root) / dp)  # parameters of this rank's shard
    weights, optimizer, grads = FP32 * shard, work.optimizer_bytes_per_param * shard, FP32 * shard
    tokens = plan.micro_batch * work.seq_len
    saved_token, full_token = layer_bytes_per_token(model, plan.recompute, work.attention, work.seq_len)
    layer = tokens * saved_token // t
    head = tokens * (2 * BF16 * model.hidden // t + FP32)  # final norm's input and output
    logits = tokens * model.padded_vocab // t
    saved = L * layer + head
    gathered_root, gathered_block = BF16 * root, BF16 * block
    reduce = FP32 if options.reduce_dtype == "fp32" else 0
    # The loss's backward: no sharded gradient exists yet; the root and the last block stay gathered.
    loss = (weights, 0, optimizer, saved + FP32 * logits, gathered_root + gathered_block + 2 * FP32 * logits)
    # The last block's backward: the output layer's bf16 weight gradient waits for the root's
    # reduce-scatter; two blocks gathered; the block re-run (checkpointing) and its gradients in bf16 and fp32.
    rerun = tokens * full_token // t if plan.recompute != "none" else 0
    block_grads = (BF16 + reduce) * block
    last_block = (weights, 0, optimizer, saved - head, gathered_root + BF16 * root // 2 + 2 * gathered_block + rerun + block_grads)
    # The end of the backward: every block's sharded gradient, the root's bf16 gradients and their fp32 copy.
    end = (weights, grads, optimizer, 0, gathered_root + (BF16 + reduce) * root)
    step = (weights, grads, optimizer, 0, 0)
    params, g, o, activations, transient = max((loss, last_block, end, step), key=sum)
    return MemoryEstimate.model_construct(
        per_stage=[
            MemoryBreakdown.model_construct(params=params, grads=g, optimizer=o, activations=activations, other=transient + overhead_bytes)
        ]
    )


def reserved_allowance(model: ModelSpec, plan: ParallelPlan, seq_len: int) -> int:
    """What the caching allocator holds beyond the allocated peak (for a peak-reserved figure):
    the bf16 logits' block (2 sbV/t), freed before the backward and too small for the fp32
    gradients allocated at the peak, so it stays reserved and unused then. Other fragmentation
    is not modelled."""
    return BF16 * plan.micro_batch * seq_len * model.padded_vocab // plan.tp
