"""Per-GPU peak memory of a plan as Megatron-LM (Megatron-Core GPT) trains it.

Assumptions, each with its source (re-derived, no code copied):

- Model states (``megatron/training/theoretical_memory_usage.py``): 16-bit weights (2 B); the
  DDP gradient buffer (``main_grad``) in fp32 for bf16 (``arguments.py`` sets
  ``accumulate_allreduce_grads_in_fp32`` for bf16 only), in fp16 for fp16; fp32 master weights
  and the optimizer's fp32 states (Adam: 4 + 8 B). Without the distributed optimizer that is
  18 B per parameter (bf16); with it (``zero=1`` here, any tp/pp) master and states are sharded
  over dp: 6 + 12/dp. fp16 without the distributed optimizer also copies the fp16 gradients to
  fp32 (``Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads``) for the step.
  fp32 training keeps no master copy (16 B with Adam).
- Layout: the vocabulary padded to a multiple of ``make_vocab_size_divisible_by`` (the
  model's ``vocab_multiple``, else Megatron's default 128) times tp; the word embedding and the
  output layer are vocabulary-parallel (split over tp); learned positions, norms and the
  row-parallel biases are replicated. A tied embedding is a second copy on the last stage when
  pp > 1.
- Activations per layer and micro-batch, after Korthikanti et al. 2022 (Reducing Activation
  Recomputation in Large Transformer Models, Table 2: sbh(10 + 24/t + 5as/(ht)) in 16-bit),
  counted tensor by tensor so that the table's GPT-3 case is reproduced and the other cases
  follow: each norm's input and output (replicated over tp unless sequence parallel, which
  divides them by t) and its fp32 statistics; Q, the smaller K and V of grouped-query
  attention, the attention output; eager attention's softmax output (fp32 without
  ``masked_softmax_fusion``), its dropout mask (1 B) and output, or flash attention's fp32
  log-sum-exp instead (no s^2 term; its dropout mask is regenerated, not stored); the MLP's
  first projection output (GELU: f, SwiGLU: gate and up, 2f) and activation output; one 1-byte
  mask per hidden dropout. Selective recomputation (``--recompute-granularity selective``,
  core attention) drops the softmax/dropout tensors (flash: the log-sum-exp); full recomputation
  (``uniform``, one layer per checkpoint) keeps each layer's input and re-materialises one layer
  in its backward.
- Pipeline: 1F1B keeps min(pp - stage, micro-batches) micro-batches in flight; the interleaved
  schedule (vpp model chunks per rank) runs (pp - rank - 1) * 2 + (vpp - 1) * group warm-up
  chunk-micro-batches (``schedules.forward_backward_pipelining_with_interleaving``; group =
  ``microbatch_group_size_per_vp_stage``, default pp), all of them when that reaches the total,
  and holds one more in its steady state. The first stage also keeps each in-flight
  micro-batch's token ids and embedding dropout mask (Megatron's formula: 8sb + sbh).
- Output layer and loss on the last stage: vocabulary-parallel cross entropy on fp32 logits
  (``logits.float()``), whose softmax (4 sbV/t) is saved per in-flight micro-batch; while it is
  cast (and while its gradient is cast back) the 16-bit logits or their gradient (2 sbV/t) live
  beside it. ``--cross-entropy-loss-fusion`` (native impl, the only one Megatron's arguments
  accept) runs the loss through ``torch.compile`` (``megatron/core/jit.py``); its backward
  (``fused_cross_entropy.calculate_gradients``) scatters into the saved softmax in place, which
  Inductor compiles as an fp32 clone of it beside the 16-bit gradient: one more 4 sbV/t.
- Without gradient-accumulation fusion (``--no-gradient-accumulation-fusion``) each weight
  gradient is materialised in 16 bits before it is added to ``main_grad``: the largest such
  temporary (the output layer's, else the MLP's first projection) joins the backward moments.
- ``--defer-embedding-wgrad-compute`` (pp > 1 with gradient-accumulation fusion, which Megatron's
  ``TransformerConfig`` requires): the output layer keeps its input
  (``ColumnParallelLinear.forward``: ``embedding_activation_buffer``) and its 16-bit output
  gradient (``LinearWithGradAccumulationAndAsyncCommunication.backward``: ``grad_output_buffer``)
  for the first ``--wgrad-deferral-limit`` micro-batches of the step (0: all), in
  ``megatron/core/tensor_parallel/layers.py``, until the pipeline flush computes their weight
  gradients (``schedules.finish_embedding_wgrad_compute``): while the last micro-batch runs
  through the last stage, min(limit, micro-batches - 1) such pairs live beside it.
- ``--qk-layernorm`` normalises each query and key head (``megatron/core/transformer/attention.py``,
  ``q_layernorm``/``k_layernorm``): each norm saves its 16-bit input and its fp32 statistics
  per head; the norms' weights (4 x head size per layer) are left out.
- Not modelled: context parallelism, experts, FP8, CPU offloading, Megatron's own FSDP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.spec.layout import check_tp, layer_parameters
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import MemoryBreakdown, MemoryEstimate, ParallelPlan
from frenzy_prefect.spec.workload import Attention, Workload

FP32 = 4
MEGATRON_VOCAB_DIVISOR = 128  # make_vocab_size_divisible_by's default


@dataclass(frozen=True)
class MegatronOptions:
    """Megatron-LM arguments that change memory and that a ParallelPlan does not carry."""

    sequence_parallel: bool | None = None  # None: on when tp > 1, as Megatron users usually run
    vpp: int | None = None  # model chunks per pipeline rank (interleaved 1F1B); None or 1: plain 1F1B
    microbatch_group: int | None = None  # --microbatch-group-size-per-virtual-pipeline-stage; default pp
    grad_accumulation_fusion: bool = True  # False: --no-gradient-accumulation-fusion
    masked_softmax_fusion: bool = True  # False: --no-masked-softmax-fusion (eager softmax kept in fp32)
    first_stage_layers: int | None = None  # --decoder-first-pipeline-num-layers
    last_stage_layers: int | None = None  # --decoder-last-pipeline-num-layers
    cross_entropy_fusion: bool = False  # --cross-entropy-loss-fusion (native, torch.compile'd)
    wgrad_deferral: int | None = None  # --defer-embedding-wgrad-compute with --wgrad-deferral-limit (0: all); None: off
    qk_layernorm: bool = False  # --qk-layernorm

    def sp(self, tp: int) -> bool:
        return tp > 1 if self.sequence_parallel is None else self.sequence_parallel and tp > 1


def compute_bytes(work: Workload) -> int:
    """Megatron's weights and activations are 16-bit unless it trains in fp32."""
    return 2 if work.precision != "fp32" else FP32


def padded_vocab(model: ModelSpec, tp: int) -> int:
    divisor = (model.vocab_multiple if model.vocab_multiple > 1 else MEGATRON_VOCAB_DIVISOR) * tp
    return math.ceil(model.vocab_size / divisor) * divisor


def stage_layers(model: ModelSpec, plan: ParallelPlan, options: MegatronOptions) -> list[int]:
    """Layers per pipeline stage: even, or with the first and last stages' counts fixed."""
    first, last, pp, n = options.first_stage_layers, options.last_stage_layers, plan.pp, model.layers
    if first is None and last is None:
        if n % pp:
            raise FrenzyError(f"megatron needs layers ({n}) divisible by pp ({pp}), or first/last stage layers set")
        return [n // pp] * pp
    fixed = [x for x in (first, last) if x is not None]
    middle = pp - len(fixed)
    rest = n - sum(fixed)
    if pp < 2 or rest < 0 or (middle and rest % middle) or (not middle and rest):
        raise FrenzyError(f"first/last stage layers ({first}, {last}) do not split {n} layers over pp={pp} evenly")
    each = rest // middle if middle else 0
    counts = [each] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def stage_parameters(model: ModelSpec, plan: ParallelPlan, layers: int, stage: int) -> int:
    """Parameters on one rank of ``stage``: its layers (tp rank 0: replicated norms and biases
    included), the vocabulary-parallel embedding and learned positions on the first stage, the
    final norm and the vocabulary-parallel output layer (or tied copy) on the last."""
    t, h = plan.tp, model.hidden
    vocab_shard = padded_vocab(model, t) // t * h
    n = layers * layer_parameters(model, t)[0]
    if stage == 0:
        n += vocab_shard + (model.max_seq_len * h if model.position == "learned" else 0)
    if stage == plan.pp - 1:
        n += model.norm_parameters
        if not model.tied_embeddings or plan.pp > 1:
            n += vocab_shard
    return n


@dataclass(frozen=True)
class _Terms:
    """Bytes of one micro-batch on one rank."""

    layer: int  # saved by one layer
    layer_full: int  # one layer's saved tensors without recomputation (re-materialised under full)
    layer_backward: int  # gradient temporaries of one layer's backward
    embedding: int  # first stage: token ids and the embedding dropout mask
    head: int  # last stage: final norm and the fp32 softmax of the loss
    softmax: int  # the fp32 softmax alone (it becomes the logits' gradient in place)
    logits_transient: int  # the 16-bit logits (or their gradient) beside the fp32 softmax
    output_backward: int  # the output layer's backward: logits gradient, input gradient, weight gradient
    deferred_wgrad: int  # one micro-batch's output-layer input and 16-bit output gradient, kept for a deferred weight gradient


def _layer_bytes(model: ModelSpec, t: int, sp: bool, e: int, attention: Attention, qk_layernorm: bool) -> tuple[int, int]:
    """Bytes one layer saves per token without recomputation, apart from eager attention's
    s-sized tensors: (replicated over tp unless sequence parallel, split over tp)."""
    h, kv, f, a = model.hidden, model.kv_width, model.ffn_hidden, model.heads
    stats = (2 if model.norm == "layernorm" else 1) * FP32
    masks = 2 * h if model.hidden_dropout > 0 else 0
    replicated = 2 * (2 * e * h + stats) + masks  # two norms' inputs and outputs, dropout masks
    sharded = e * (2 * h + 2 * kv) + (FP32 * a if attention == "flash" else 0)  # Q, K, V, attention output; flash's log-sum-exp
    if qk_layernorm:  # the query and key norms' inputs, and their statistics per head
        sharded += e * (h + kv) + stats * (a + model.kv_heads)
    f_in = 2 * f if model.mlp == "swiglu" else f
    sharded += e * (f_in + f)
    return replicated // (t if sp else 1), sharded // t


def _eager_core(model: ModelSpec, e: int, seq_len: int, softmax_fused: bool) -> int:
    """Eager attention's per-token s-sized tensors (before the division by t): the softmax output
    (fp32 when the masked softmax is not fused), and with attention dropout its mask and output."""
    a, s = model.heads, seq_len
    per = (e if softmax_fused else FP32) + ((1 + e) if model.attention_dropout > 0 else 0)
    return per * a * s


def micro_batch_terms(model: ModelSpec, plan: ParallelPlan, work: Workload, options: MegatronOptions) -> _Terms:
    seq_len, attention = work.seq_len, work.attention
    t, sp, e = plan.tp, options.sp(plan.tp), compute_bytes(work)
    tokens, h, f = seq_len * plan.micro_batch, model.hidden, model.ffn_hidden
    f_in = 2 * f if model.mlp == "swiglu" else f
    V = padded_vocab(model, t)
    replicated, sharded = _layer_bytes(model, t, sp, e, attention, options.qk_layernorm)
    core = _eager_core(model, e, seq_len, options.masked_softmax_fusion) // t if attention == "eager" else 0
    full = tokens * (replicated + sharded + core)
    if plan.recompute == "none":
        layer = full
    elif plan.recompute == "selective":  # core attention recomputed: its softmax and dropout (flash: the log-sum-exp)
        layer = full - tokens * (core + (FP32 * model.heads // t if attention == "flash" else 0))
    else:
        layer = tokens * e * h // (t if sp else 1)
    wgrad = 0 if options.grad_accumulation_fusion else e * h * f_in // t
    attn_grad = 2 * e * tokens * model.heads * seq_len // t if attention == "eager" else 0
    layer_backward = max(e * tokens * (2 * h + (f_in + f) // t), attn_grad) + wgrad
    if plan.recompute == "full":
        layer_backward += full
    norm_stats = (2 if model.norm == "layernorm" else 1) * FP32
    head_norm = tokens * (2 * e * h // (t if sp else 1) + norm_stats)
    logits = tokens * V // t
    return _Terms(
        layer=layer,
        layer_full=full,
        layer_backward=layer_backward,
        embedding=tokens * (8 + (h // (t if sp else 1) if model.hidden_dropout > 0 else 0)),
        head=head_norm + FP32 * logits,
        softmax=FP32 * logits,
        logits_transient=(e if e < FP32 else 0) * logits + (FP32 * logits if options.cross_entropy_fusion else 0),
        output_backward=e * logits + e * tokens * h + (0 if options.grad_accumulation_fusion else e * V // t * h),
        deferred_wgrad=e * logits + e * tokens * h // (t if sp else 1),
    )


def in_flight(plan: ParallelPlan, stage: int, micro_batches: int, options: MegatronOptions) -> list[int]:
    """Chunk indices of the chunk-micro-batches a rank of ``stage`` holds at its first backward
    (plain 1F1B: one chunk, repeated once per micro-batch in flight)."""
    p, v = plan.pp, options.vpp or 1
    if v == 1:
        return [0] * min(p - stage, micro_batches)
    group = options.microbatch_group or p
    total = micro_batches * v
    warmup = min(total, (p - stage - 1) * 2 + (v - 1) * group)
    held = min(total, warmup + 1)
    # forward order: groups of ``group`` micro-batches per chunk, chunk after chunk
    return [(k // group) % v for k in range(held)]


def _check(model: ModelSpec, plan: ParallelPlan, options: MegatronOptions, micro_batches: int) -> None:
    if plan.zero > 1:
        raise FrenzyError(f"megatron models zero=0 (DDP) and zero=1 (its distributed optimizer), with any tp/pp; got zero={plan.zero}")
    check_tp(model, plan.tp)
    v = options.vpp or 1
    if v > 1 and (plan.pp < 2 or model.layers % (plan.pp * v)):
        raise FrenzyError(f"vpp={v} needs pp >= 2 and layers ({model.layers}) divisible by pp * vpp ({plan.pp * v})")
    if options.wgrad_deferral is not None and (plan.pp < 2 or not options.grad_accumulation_fusion):
        # Megatron's TransformerConfig refuses both, so no run can hold what this would count.
        raise FrenzyError("wgrad_deferral (--defer-embedding-wgrad-compute) needs pp >= 2 and gradient-accumulation fusion")


def model_state_bytes(plan: ParallelPlan, params: int, work: Workload) -> tuple[int, int, int]:
    """(weights, gradient buffer, master weights + optimizer states) bytes of ``params`` parameters."""
    half = work.precision != "fp32"
    weights = compute_bytes(work) * params
    grads = (2 if work.precision == "fp16" else FP32) * params
    sharded = ((FP32 if half else 0) + work.optimizer_bytes_per_param) * params
    if plan.zero == 1:
        sharded = math.ceil(sharded / plan.dp)
    return weights, grads, sharded


def estimate(
    model: ModelSpec, plan: ParallelPlan, work: Workload, *, options: MegatronOptions | None = None, overhead_bytes: int = 0
) -> MemoryEstimate:
    """Peak bytes per GPU of every pipeline stage; ``overhead_bytes`` (CUDA context, NCCL,
    allocator) is added to ``other`` when the caller wants more than tensors."""
    options = options or MegatronOptions()
    micro_batches = plan.accumulation(work.global_batch)
    _check(model, plan, options, micro_batches)
    counts = stage_layers(model, plan, options)
    terms = micro_batch_terms(model, plan, work, options)
    v = options.vpp or 1
    out = []
    for stage, layers in enumerate(counts):
        params = stage_parameters(model, plan, layers, stage)
        weights, grads, states = model_state_bytes(plan, params, work)
        chunks = in_flight(plan, stage, micro_batches, options)
        first, last = stage == 0, stage == plan.pp - 1
        saved = len(chunks) * layers // v * terms.layer
        saved += sum(terms.embedding for c in chunks if first and c == 0)
        saved += sum(terms.head for c in chunks if last and c == v - 1)
        if last and options.wgrad_deferral is not None:
            saved += min(options.wgrad_deferral or micro_batches, micro_batches - 1) * terms.deferred_wgrad
        moments = [(saved, terms.layer_backward)]
        if last and (v - 1) in chunks:
            moments.append((saved, max(terms.logits_transient, terms.output_backward - terms.softmax)))
        if first:  # the embedding's dense weight gradient, once the oldest micro-batch's backward is through
            done = layers // v * terms.layer + terms.embedding
            moments.append((saved - done, compute_bytes(work) * padded_vocab(model, plan.tp) // plan.tp * model.hidden))
        if work.precision == "fp16" and plan.zero == 0:  # the step's fp32 copies of the fp16 gradients
            moments.append((0, FP32 * params))
        activations, transient = max(moments, key=sum)
        out.append(
            MemoryBreakdown.model_construct(
                params=weights, grads=grads, optimizer=states, activations=activations, other=transient + overhead_bytes
            )
        )
    return MemoryEstimate.model_construct(per_stage=out)
