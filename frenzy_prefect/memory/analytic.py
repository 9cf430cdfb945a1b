"""Analytic per-GPU peak memory of the project's training engine, itemised per pipeline stage.

The engine (``training/engine.py``) keeps fp32 weights, fp32 gradient buffers that persist
between steps, and optimizer states; bf16/fp16 run under torch autocast. With master weights
(``master_weights``) the weights are half, the persistent gradients fp32 main gradients, and fp32
masters sit beside the optimizer states; no autocast runs, so the residual stream and LayerNorm's
statistics are half and no weight copies are kept. Its peak is the
largest of a few moments of a training step, each the sum of the tensors alive then:

- forward-loss: the activations saved by every in-flight micro-batch, plus the logits and their
  fp32 copy while the loss is computed;
- loss-backward: saved activations plus the two fp32 vocabulary-sized gradients of the loss
  (tp > 1: the vocab-parallel loss turns its saved softmax into the gradient in place);
- final-norm-backward: the head's tensors freed, the final norm's backward temporaries;
- block-backward: the last block's backward, with the head's activations freed and the block's
  gradient temporaries alive (and, under full recomputation, the block re-materialised);
- embedding-backward: the dense embedding gradient at the end of backward;
- optimizer: model states plus the optimizer's temporaries.

Saved activations per layer are counted tensor by tensor for this engine's decoder
(``layer_activations``) rather than with Korthikanti et al.'s Table 2, whose constants assume
one fixed block. Per knob:

- norm: LayerNorm keeps its mean and reciprocal deviation; RMSNorm (torch's) its reciprocal root
  mean square and the normalised input (sbh in fp32), beside the input both keep;
- positions: RoPE keeps no table per layer: the cos/sin tables (T x head_dim, compute dtype) are
  made once per micro-batch and shared, and the rotated q and k are new tensors the core keeps;
- attention ``flash`` (fused SDPA): QKV's output (K and V kv_heads wide: SDPA's ``enable_gqa``,
  no expanded copies), the rotated q and k, the output and the fp32 log-sum-exp, never scores;
- attention ``eager`` (Hugging Face's eager attention): q, k, v as its matmuls keep them
  (contiguous, K and V expanded to every head), the fp32 softmax output, the probabilities cast
  to the compute dtype or dropped out, the dropout's bool mask, and one bool causal mask per
  micro-batch; selective recomputation keeps only the core's inputs either way;
- MLP: GELU keeps fc's output and the GELU's; SwiGLU the fused gate|up output, silu(gate) and
  the product; the last block's backward holds the MLP's weight gradients in the compute dtype;
- hidden dropout: a bool mask (one byte per element) on the embeddings and on each residual
  branch (``native_dropout``, the same on CPU and CUDA);
- biases: absent ones are absent from the weights, their gradients and autocast's copies.

Attention dropout under ``flash`` is counted as CUDA's fused kernels run it (they regenerate the
mask, keeping no scores), which is not measured here; on CPU torch falls back to its math kernel,
which keeps scores and masks, and that case is not modelled.
Under tensor parallelism the vocabulary is split (Megatron's vocab-parallel embedding, column-
parallel head and cross-entropy): every vocabulary-sized term is one rank's V/t slice
(``vocab_rows``), with the rank-local token ids and masks the embedding and the loss keep.
Pipeline stages hold 1F1B's in-flight micro-batches (stage s of p: min(p - s, micro-batches)).
ZeRO-1 shards the optimizer states as torch's ZeroRedundancyOptimizer deals tensors out
(``optimizer_shares``); ZeRO-2 keeps what DeepSpeed 0.19 keeps (``_zero2_peak``); ZeRO-3 what
torch's FSDP2 keeps (``fully_sharded_peak``). ``peak_bytes`` is the search path
(the peak only); ``estimate`` itemises every stage.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import NamedTuple

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.memory.calibration import RESERVED_OVER_TENSORS, Calibration, GpuConstants, default_calibration
from frenzy_prefect.spec.gpu import GpuType
from frenzy_prefect.spec.layout import (
    block_shapes,
    block_tensors,
    check_plan,
    check_tp,
    deal_out,
    head_shapes,
    layer_parameters,
    parameter_sizes,
    root_shapes,
    stage_shapes,
    stage_tensor_sizes,
    uses_ddp,
    vocab_rows,
    zero_bucket_elements,
    zero_runs_with,
)
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import MemoryBreakdown, MemoryEstimate, ParallelPlan
from frenzy_prefect.spec.workload import Workload

COMPUTE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
FP32 = 4
INDEX = 8  # token ids are int64


def partition_overlap(offsets: Sequence[int], part: int, rank: int) -> int:
    """Elements of the tensors that overlap ``rank``'s slice of the flattened parameters: ZeRO-2
    allocates their gradients when it reduces them into that slice. ``offsets``: where each tensor
    starts in the flattened parameters, then their total."""
    low, high = rank * part, (rank + 1) * part
    first = bisect.bisect_right(offsets, low, 1) - 1  # the first tensor ending after low
    end = bisect.bisect_left(offsets, high, 0, len(offsets) - 1)  # the first tensor starting at or after high
    return offsets[end] - offsets[first] if end > first else 0


class ZeroLayout(NamedTuple):
    """How DeepSpeed lays a model's parameters over ``dp`` ranks (elements)."""

    total: int  # N
    padded: int  # N padded to a multiple of 2 * dp
    part: int  # each rank's slice of the flattened parameters
    # Ranks differ only by the tensors overlapping their slice (G_in) and by
    # whether the slice holds the last block (reduced early in the backward): the largest G_in of
    # the ranks that do and of those that do not are all the ranks' peaks need.
    overlap_tail: int
    overlap_rest: int
    largest: int


@lru_cache(maxsize=4096)
def zero_layout(model: ModelSpec, dp: int, tp: int = 1) -> ZeroLayout:
    sizes = parameter_sizes(model, tp)
    n = sum(sizes)
    padded = math.ceil(n / (2 * dp)) * 2 * dp
    part = padded // dp
    # reduced by the end of the last block's backward: the last block, the final norm and the head
    tail = sum(block_tensors(model, tp)) + sum(r * c for r, c in head_shapes(model, tp, own_head=not model.tied_embeddings))
    offsets = [0, *itertools.accumulate(sizes)]
    first_tail = (n - tail) // part  # the first rank whose slice reaches into the tail
    # A slice that neither starts nor ends a tensor lies inside one (or in the padding) and overlaps
    # what its neighbours do: the ranks at tensor boundaries, beside them, beside the tail's first
    # rank, and the first and last stand for all dp ranks.
    ranks = {0, dp - 1, first_tail - 1, first_tail}
    for start, end in itertools.pairwise(offsets):
        for r in (start // part, (end - 1) // part):
            ranks.update((r - 1, r, r + 1))
    overlaps = [(partition_overlap(offsets, part, r), (r + 1) * part > n - tail) for r in ranks if 0 <= r < dp]
    return ZeroLayout(
        total=n,
        padded=padded,
        part=part,
        overlap_tail=max((o for o, owns in overlaps if owns), default=-1),
        overlap_rest=max((o for o, owns in overlaps if not owns), default=-1),
        largest=max(sizes),
    )


class Moments(NamedTuple):
    """(saved activations, transient bytes) at the candidate peaks of one rank's forward and backward."""

    before_grads: tuple[tuple[int, int], ...]  # forward end, logits, loss backward: no parameter gradient yet
    block: tuple[int, int]  # the last block's backward
    embedding: tuple[int, int] | None  # the embedding's backward (first stage)
    ids: int  # token ids of the step's micro-batches, alive through the optimizer step
    final_norm: tuple[int, int] | None = None  # the final norm's backward (last stage)


class MicroBatchTerms(NamedTuple):
    """Bytes one micro-batch puts on a rank, independent of where the rank sits in the pipeline."""

    saved_layer: int  # what one block keeps for its backward
    head: int  # what the final norm, head and loss keep (last stage)
    boundary: int  # a stage's received input, or its output held for the gradient
    shared: int  # what a stage's blocks share: the rotary tables, eager attention's causal mask
    embedding: int  # what the embeddings keep (first stage): the dropout mask
    block_temp: int  # the last block's backward: gradient temporaries (and the block re-materialised)
    cache_layer: int  # autocast's weight copies of one block while only its cache keeps them
    logits: int  # the logits and their fp32 copy while the loss is computed
    loss_backward: int  # the loss's two fp32 vocabulary-sized gradients
    embedding_backward: int  # the residual gradient and the dense embedding gradient
    ids: int  # one micro-batch's token ids (inputs and shifted targets share one tensor)
    tied_pending: int  # the head's gradient, waiting for the embedding's when the two are tied
    final_norm_saved: int = 0  # what the final norm keeps (its input and statistics), part of ``head``
    final_norm_backward: int = 0  # the final norm's backward: its output's gradient and its temporaries


class NormBytes(NamedTuple):
    """Per element of the hidden states: the residual stream, what a norm keeps of its input; and
    the bytes of a norm's other saved tensors over ``sb`` tokens."""

    residual: int
    input: int
    saved: int


def norm_bytes(model: ModelSpec, sb: int, work: Workload) -> NormBytes:
    """The residual stream is fp32 under autocast, in the compute dtype with half weights (master
    weights). LayerNorm keeps its input, mean and reciprocal deviation (in its input's dtype);
    RMSNorm (torch's, on CPU) its input upcast to fp32 (the input itself when fp32), its
    reciprocal root mean square and the normalised input (before the scale), both fp32."""
    residual = COMPUTE_BYTES[work.precision] if work.master_weights else FP32
    if model.norm == "rmsnorm":
        return NormBytes(residual, FP32, FP32 * sb + FP32 * sb * model.hidden)
    return NormBytes(residual, residual, 2 * residual * sb)


def layer_activations(model: ModelSpec, tp: int, micro_batch: int, work: Workload) -> tuple[int, int, int]:
    """(what one block keeps for its backward around the attention core, what the core keeps
    beyond its inputs, what a checkpoint of the core keeps instead: its inputs), tensor by tensor."""
    s, b, h, f, kv, t = work.seq_len, micro_batch, model.hidden, model.ffn_hidden, model.kv_width, tp
    e = COMPUTE_BYTES[work.precision]
    sbh, sb = s * b * h, s * b
    # Autocast's half-precision weight copies are saved for the backward by torch's linear layers
    # (FSDP2's gathered weights too: they are ordinary parameters while gathered); half weights have none.
    saves_copies = e < FP32 and not work.master_weights
    norm_out = e * sbh  # what the layer after a norm saves: the norm's output in (or cast to) the compute dtype
    norm = norm_bytes(model, sb, work)
    around = (
        2 * norm.input * sbh  # what the two norms keep of the block input and of the residual after attention
        + 2 * norm.saved
        + 2 * norm_out
        + e * sbh // t  # attention output (the projection's input)
        + (4 if model.mlp == "swiglu" else 2) * e * sb * f // t  # GELU: fc out, gelu out; SwiGLU: gate|up, silu, product
        + (2 * sbh if model.hidden_dropout else 0)  # the residual branches' dropout masks (bool)
        + (2 * layer_parameters(model, t)[1] if saves_copies else 0)
    )
    # The core's inputs: QKV's output (q, k, v are views of it) and, with RoPE, the rotated q and k.
    inputs = e * sb * (h + 2 * kv) // t + (e * sb * (h + kv) // t if model.position == "rope" else 0)
    if work.attention == "flash":  # fused: q, k (kv_heads wide: enable_gqa), v, its output and the log-sum-exp
        return around, inputs + FP32 * b * (model.heads // t) * s, inputs
    # Eager: q, k and v as its matmuls keep them (contiguous copies, k and v expanded to every
    # head, QKV's output freed), the fp32 softmax output, the probabilities cast to the compute
    # dtype or dropped out (with their bool mask).
    bass = b * (model.heads // t) * s * s
    dropped = model.attention_dropout > 0
    probs = FP32 * bass + (e * bass if dropped or e < FP32 else 0) + (bass if dropped else 0)
    return around, 3 * e * sbh // t + probs, inputs


@lru_cache(maxsize=4096)
def micro_batch_terms(model: ModelSpec, tp: int, micro_batch: int, recompute: str, work: Workload) -> MicroBatchTerms:
    # V: this rank's vocabulary slice (the whole padded vocabulary when t = 1; ``vocab_rows``).
    s, b, h, f, V, t = work.seq_len, micro_batch, model.hidden, model.ffn_hidden, vocab_rows(model, tp), tp
    e = COMPUTE_BYTES[work.precision]
    half = e < FP32
    copies = half and not work.master_weights  # autocast's half weight copies
    sbh, sb, sbV = s * b * h, s * b, s * b * V
    norm_out = e * sbh
    norm = norm_bytes(model, sb, work)
    r = norm.residual
    # A block's input is what its first norm keeps, unless RMSNorm keeps an fp32 copy of a half one.
    input_is_kept = norm.input == r
    # Half weights: each parameter's half gradient lives only until it is added into its fp32 main gradient.
    g = e if work.master_weights else FP32
    around, core, core_inputs = layer_activations(model, t, b, work)
    layer = around + (core_inputs if recompute == "selective" else core)
    # The last block's MLP backward: the residual's gradient, an ffn-wide gradient, the weight
    # gradients of the MLP-out (and of SwiGLU's second ffn-wide part) and MLP-out's bias gradient.
    weight_grads = (2 if model.mlp == "swiglu" else 1) * h * f
    block_temp = r * sbh + e * (s * b * f + weight_grads) // t + (e * h if model.mlp_bias else 0)
    if recompute == "full":  # the block re-materialised whole (its input is already saved)
        block_temp += around + core - (r * sbh if input_is_kept else 0)
    # Made once per micro-batch and shared by a stage's blocks: the rotary tables (compute dtype)
    # and eager attention's causal mask (bool).
    shared = (2 * s * model.head_dim * e if model.position == "rope" else 0) + (s * s if work.attention == "eager" else 0)
    # Split over the vocabulary (t > 1), the embedding keeps its rank-local token ids (int64) and
    # the mask of the tokens other ranks hold (bool), and so does the loss for the targets.
    local_ids = (INDEX + 1) * sb if t > 1 else 0
    return MicroBatchTerms(
        saved_layer=r * sbh if recompute == "full" else layer,
        # The final norm's input and statistics, its output cast for the head, autocast's copy of the
        # head, and the loss's fp32 (log-)softmax of the rank's slice.
        head=norm.input * sbh + norm.saved + norm_out + (e * V * h if copies else 0) + FP32 * sbV + local_ids,
        boundary=r * sbh,
        shared=shared,
        embedding=(sbh if model.hidden_dropout else 0) + local_ids,  # the embeddings' dropout mask (bool)
        block_temp=block_temp,
        # Under full recomputation nothing but autocast's cache keeps the copies until the forward ends.
        cache_layer=2 * layer_parameters(model, t)[1] if copies and recompute == "full" else 0,
        logits=(FP32 + e if half else FP32) * sbV,
        # F.cross_entropy's backward makes two fp32 vocabulary-sized gradients; the vocab-parallel
        # loss turns its saved softmax into the gradient in place, cast to the logits' half dtype.
        loss_backward=2 * FP32 * sbV if t == 1 else (e * sbV if half else 0),
        # The residual's gradient and the dense embedding gradient (and, split, the gradient of the
        # masked embedding output).
        embedding_backward=r * sbh + g * V * h + (r * sbh if t > 1 else 0),
        ids=b * (s + 1) * INDEX,
        tied_pending=g * V * h if model.tied_embeddings else 0,
        # With the vocabulary split the head's tensors are small and this can be the peak. LayerNorm's
        # fused backward keeps its input and statistics and makes the input's gradient beside the
        # output's (and the scale's and shift's). Torch's RMSNorm on CPU runs as pow, mean, rsqrt and
        # products: the normalised input is freed once the scale's gradient is made, the input and
        # reciprocal root mean square stay, and five fp32 sbh tensors are alive at once (two partial
        # input gradients, the mean's, pow's and their product).
        final_norm_saved=norm.input * sbh + (FP32 * sb if model.norm == "rmsnorm" else norm.saved),
        final_norm_backward=5 * FP32 * sbh if model.norm == "rmsnorm" else 2 * r * sbh + 2 * g * h,
    )


def in_flight_micro_batch_bytes(terms: MicroBatchTerms, plan: ParallelPlan, *, layers: int, stage: int) -> int:
    """What one in-flight micro-batch keeps on a rank of ``stage`` until its backward: the saved
    activations of its layers, the head's on the last stage, and its boundary tensors."""
    first, last = stage == 0, stage == plan.pp - 1
    own = layers * terms.saved_layer + terms.shared + (terms.embedding if first else 0) + (terms.head if last else 0)
    return own + terms.boundary * ((not first) + (not last))


def deferred_weight_grad_bytes(model: ModelSpec, micro_batch: int, work: Workload, *, layers: int, stage: int, pp: int) -> int:
    """What a micro-batch holds beyond its saved activations on a rank of ``stage`` between its B and
    a W that does not follow it at once (zero-bubble split backward, ReCycle's schedules):
    torch.distributed.pipelining's ``stage_backward_input`` keeps, for W, the gradient of every
    operation's output that a weight feeds (per layer the two norms', the QKV, output, MLP-in and
    MLP-out projections'; on the last stage the final norm's and the head's), and the stage
    input's gradient it sent back. The first stage's B computes nothing (its input is token ids):
    its W runs the whole backward, so nothing is kept. Tensor parallelism is not modelled (ReCycle
    runs tp = 1); norms' gradients are counted in fp32, the projections' in the compute dtype."""
    if stage == 0:
        return 0
    tokens, h, e = work.seq_len * micro_batch, model.hidden, COMPUTE_BYTES[work.precision]
    mlp_in = (2 if model.mlp == "swiglu" else 1) * model.ffn_hidden
    per_layer = 2 * FP32 * h + e * (h + 2 * model.kv_width + h + mlp_in + h)
    last = FP32 * h + e * vocab_rows(model, 1) if stage == pp - 1 else 0
    return tokens * (layers * per_layer + last + e * h)


def waiting_for_w_bytes(model: ModelSpec, plan: ParallelPlan, work: Workload, terms: MicroBatchTerms, micro: int, stage: int) -> int:
    """What a micro-batch holds on a rank of ``stage`` between its B and a deferred W: its saved
    activations (``micro``), less the loss's logits on the last stage (freed by B), and what W
    keeps (``deferred_weight_grad_bytes``). On the first stage B computes nothing: ``micro``."""
    if stage == 0:
        return micro
    layers = plan.layer_split(model.layers)[stage]
    freed = terms.logits if stage == plan.pp - 1 else 0
    return micro - freed + deferred_weight_grad_bytes(model, plan.micro_batch, work, layers=layers, stage=stage, pp=plan.pp)


class StageShape(NamedTuple):
    """A rank of one pipeline stage, whatever the data parallelism and ZeRO: its layers,
    parameters, largest parameter tensor, and the bytes of one micro-batch in flight on it."""

    layers: int
    params: int
    largest: int
    micro: int


def activation_moments(
    terms: MicroBatchTerms, pp: int, stage: StageShape, index: int, micro_batches: int, in_flight: int | None = None
) -> Moments:
    """The candidate peaks of a rank of pipeline stage ``index`` (of ``pp``) running
    ``micro_batches`` micro-batches a step: 1F1B keeps min(pp - index, micro-batches) of them in
    flight (``in_flight``: another schedule's count, e.g. ReCycle's), the oldest in its backward."""
    first, last = index == 0, index == pp - 1
    micro = stage.micro
    ids = micro_batches * terms.ids
    held = ((min(pp - index, micro_batches) if in_flight is None else in_flight) - 1) * micro + ids
    pending = terms.tied_pending if pp == 1 else 0
    cache = stage.layers * terms.cache_layer
    if last:
        before = ((held + micro, cache), (held + micro, cache + terms.logits), (held + micro, terms.loss_backward))
        after_head = held + micro - terms.head
        final_norm = (after_head + terms.final_norm_saved, terms.final_norm_backward + pending)
    else:
        before, after_head, final_norm = ((held + micro, cache),), held + micro, None
    embedding = (held, terms.embedding_backward + pending) if first else None
    return Moments(before, (after_head, terms.block_temp + pending), embedding, ids, final_norm)


def adam_temporaries(tensor_elements: int, optimizer_bytes_per_param: int, on_gpu: bool) -> int:
    """Adam's update keeps the square root of its second moment and that divided by the bias
    correction (two tensors the size of the parameter at once, on CPU where torch updates tensor by
    tensor; one list the size of all of them on CUDA, where it updates them together). SGD: none."""
    if optimizer_bytes_per_param < 8:
        return 0
    return FP32 * tensor_elements * (1 if on_gpu else 2)


Breakdown = tuple[int, int, int, int, int]  # params, grads, optimizer, saved activations, transient


class PlanSearch:
    """MARP as a plan search asks it: one model and workload, on a GPU type (``gpu`` None: the
    tensors alone, as on CPU), for plan after plan. What every plan of one (tp, pp, micro-batch,
    recomputation) shares is computed once for all their data-parallel degrees and ZeRO stages:
    a micro-batch's terms and each stage's shape. Hold one for a search; the allocator and the
    scheduler do, per GPU type."""

    def __init__(self, model: ModelSpec, work: Workload, gpu: GpuType | None = None, calibration: Calibration | None = None):
        self.model, self.work, self.on_gpu = model, work, gpu is not None
        self.constants = (calibration or default_calibration()).for_gpu(gpu)
        self.optimizer_bytes = work.optimizer_bytes_per_param
        # Master weights: half weights (2 bytes), fp32 main gradients (4) and fp32 masters beside
        # the optimizer states (4 + states, both for the replica's share under ZeRO-1).
        self.weight_bytes = COMPUTE_BYTES[work.precision] if work.master_weights else FP32
        self.state_bytes = (FP32 if work.master_weights else 0) + self.optimizer_bytes
        self._shared: dict[tuple[int, int | tuple[int, ...], int, str], tuple[MicroBatchTerms, tuple[StageShape, ...]]] = {}

    def shared(self, plan: ParallelPlan) -> tuple[MicroBatchTerms, tuple[StageShape, ...]]:
        """A micro-batch's terms and each stage's shape for ``plan``'s tp, pp, micro-batch and recomputation."""
        key = (plan.tp, plan.stage_layers or plan.pp, plan.micro_batch, plan.recompute)  # (the split only when uneven: this is hot)
        found = self._shared.get(key)
        if found is None:
            split = plan.layer_split(self.model.layers)
            found = self._shared[key] = shared_by_plans(self.model, plan.tp, split, plan.micro_batch, plan.recompute, self.work)
        return found

    def stage_peaks(
        self, plan: ParallelPlan, stages: Sequence[int] | None = None, schedule: Mapping[int, tuple[int, int]] | None = None
    ) -> tuple[Breakdown, ...]:
        """The tensors at the peak of a rank of each of ``stages`` (default: every pipeline stage),
        as plain tuples; ``schedule``: per stage, the (micro-batches held in flight at most,
        micro-batches run) of a rank under another schedule than fault-free 1F1B (ReCycle's)."""
        if not zero_runs_with(plan.zero, plan.tp, plan.pp):
            check_plan(self.model, plan)  # names what would be accepted
        if self.work.master_weights and plan.zero == 2:
            raise FrenzyError("master weights are half weights beside fp32 masters, with zero 0, 1 or 3 (not 2) and precision bf16 or fp16")
        micro_batches = plan.accumulation(self.work.global_batch)
        terms, shapes = self.shared(plan)
        rebuilds = uses_ddp(plan, self.work.master_weights)
        out = []
        for stage in range(plan.pp) if stages is None else stages:
            shape = shapes[stage]
            held, runs = (None, micro_batches) if schedule is None else schedule[stage]
            moments = activation_moments(terms, plan.pp, shape, stage, runs, held)
            if plan.zero == 3:
                out.append(fully_sharded_peak(self.model, plan, moments, self.optimizer_bytes, self.on_gpu, self.weight_bytes))
            elif plan.zero == 2:
                out.append(_zero2_peak(self.model, plan, moments, micro_batches, self.optimizer_bytes, self.on_gpu))
            else:
                out.append(self._replicated_peak(plan, stage, shape, moments, rebuilds))
        return tuple(out)

    def _replicated_peak(self, plan: ParallelPlan, stage: int, shape: StageShape, moments: Moments, rebuilds: bool) -> Breakdown:
        """A rank whose weights and gradients are whole (ZeRO 0 and 1) at its peak."""
        params = shape.params
        # The forward's and backward's peaks; the step's and DDP's bucket rebuild depend on the share.
        activations = max((*moments.before_grads, moments.block, moments.final_norm or (0, 0), moments.embedding or (0, 0)), key=sum)
        rebuild = (moments.ids, FP32 * params if rebuilds else 0)
        # ZeRO-1: each data-parallel rank updates its share of the tensors; the worst share decides.
        if plan.zero == 1:
            shares = optimizer_shares(self.model, plan.tp, plan.layer_split(self.model.layers), plan.dp, stage)
        else:
            shares = ((params, shape.largest),)
        worst: Breakdown = (0, 0, 0, 0, 0)
        for owned, owned_largest in shares:
            step = (moments.ids, adam_temporaries(owned if self.on_gpu else owned_largest, self.optimizer_bytes, self.on_gpu))
            saved, transient = max((activations, step, rebuild), key=sum)
            worst = max(worst, (self.weight_bytes * params, FP32 * params, self.state_bytes * owned, saved, transient), key=sum)
        return worst

    def peak_bytes(self, plan: ParallelPlan) -> int:
        """The predicted peak of ``plan``'s most loaded GPU, without the itemised breakdown."""
        # The middle stages' peaks fall with their index (fewer micro-batches in flight, no more
        # layers), so with an even split the first, second and last stages bound them all.
        pp = plan.pp
        bounding = (0, 1, pp - 1) if pp > 2 and plan.stage_layers is None else range(pp)
        tensors = max(sum(p) for p in self.stage_peaks(plan, bounding))
        return tensors + _runtime(self.constants, tensors, plan)


@lru_cache(maxsize=4096)
def shared_by_plans(
    model: ModelSpec, tp: int, split: tuple[int, ...], micro_batch: int, recompute: str, work: Workload
) -> tuple[MicroBatchTerms, tuple[StageShape, ...]]:
    """What every plan of this (tp, layers per stage, micro-batch, recomputation) shares: a
    micro-batch's terms and each stage's shape (what ``PlanSearch.shared`` keeps per search)."""
    check_tp(model, tp)  # (a split is checked where it is made: ParallelPlan.layer_split, check_plan)
    terms = micro_batch_terms(model, tp, micro_batch, recompute, work)
    shape = ParallelPlan(tp=tp, pp=len(split))
    return terms, tuple(
        StageShape(layers, params, largest, in_flight_micro_batch_bytes(terms, shape, layers=layers, stage=stage))
        for stage, (layers, params, largest) in enumerate(stage_shapes(model, tp, split))
    )


@lru_cache(maxsize=256)
def _default_search(model: ModelSpec, work: Workload, gpu: GpuType | None) -> PlanSearch:
    return PlanSearch(model, work, gpu)


def plan_search(model: ModelSpec, work: Workload, gpu: GpuType | None = None, calibration: Calibration | None = None) -> PlanSearch:
    """The search for (model, workload, GPU type): kept and shared with the default calibration
    (a plan asked again, as the allocator itemises each plan per type, reuses what its shape
    shares), made afresh with another."""
    return _default_search(model, work, gpu) if calibration is None else PlanSearch(model, work, gpu, calibration)


@lru_cache(maxsize=4096)
def optimizer_shares(model: ModelSpec, tp: int, split: tuple[int, ...], dp: int, stage: int) -> tuple[tuple[int, int], ...]:
    """The distinct (elements, largest tensor) a data-parallel rank of ``stage`` updates under
    ZeRO-1, in rank order, as torch's ZeroRedundancyOptimizer deals whole tensors out: largest
    first, each to the rank holding the fewest elements so far (``deal_out``). Ranks alike are one
    entry (those dealt nothing last), so the cost follows the tensors, not dp."""
    sizes = stage_tensor_sizes(model, ParallelPlan(tp=tp, pp=len(split), stage_layers=split), stage)
    totals: dict[int, int] = {}
    largest: dict[int, int] = {}
    for n, rank in zip(sizes, deal_out(sizes, dp), strict=True):
        totals[rank] = totals.get(rank, 0) + n
        largest[rank] = max(largest.get(rank, 0), n)
    shares = [(totals[r], largest[r]) for r in sorted(totals)] + ([(0, 0)] if len(totals) < dp else [])
    return tuple(dict.fromkeys(shares))


def _runtime(constants: GpuConstants, tensors: int, plan: ParallelPlan) -> int:
    """The GPU around ``tensors``: context, workspaces, NCCL (more than one GPU) and what the caching allocator reserves beyond them."""
    fragmentation = constants.fragmentation or RESERVED_OVER_TENSORS[plan.recompute]
    return constants.overhead_for(plan.gpus) + math.ceil((fragmentation - 1) * tensors)


def on_device(tensors: int, plan: ParallelPlan, gpu: GpuType | None, *, calibration: Calibration | None = None) -> int:
    """The planner's figure for a rank of ``plan`` whose tensors peak at ``tensors`` on ``gpu``:
    what the fit test compares with the GPU (any framework's tensors, as ``peak_bytes`` ours)."""
    return tensors + _runtime((calibration or default_calibration()).for_gpu(gpu), tensors, plan)


def peak_bytes(
    model: ModelSpec, plan: ParallelPlan, work: Workload, *, gpu: GpuType | None = None, calibration: Calibration | None = None
) -> int:
    """The predicted peak of ``plan``'s most loaded GPU, without the itemised breakdown (a search
    of many plans holds a ``PlanSearch``)."""
    return plan_search(model, work, gpu, calibration).peak_bytes(plan)


def estimate(
    model: ModelSpec, plan: ParallelPlan, work: Workload, *, gpu: GpuType | None = None, calibration: Calibration | None = None
) -> MemoryEstimate:
    """Predicted peak bytes on one GPU of every pipeline stage of ``plan``, itemised (``gpu``
    None: the tensors alone, as MemTracker measures them on CPU)."""
    search = plan_search(model, work, gpu, calibration)
    # Validated, not model_construct: pydantic 2.14 validates five ints faster than it constructs
    # without validation (3.7 against 8 us), and the allocator does this for every candidate plan.
    return MemoryEstimate(
        per_stage=[
            MemoryBreakdown(
                params=p,
                grads=g,
                optimizer=o,
                activations=saved,
                other=transient + _runtime(search.constants, p + g + o + saved + transient, plan),
            )
            for p, g, o, saved, transient in search.stage_peaks(plan)
        ]
    )


def recycle_estimate(
    model: ModelSpec,
    plan: ParallelPlan,
    work: Workload,
    *,
    failures: int = 1,
    gpu: GpuType | None = None,
    calibration: Calibration | None = None,
) -> MemoryEstimate:
    """``plan``'s estimate when ReCycle runs it (its planner's schedules, as the live runtime
    does): a bound over every case of up to ``failures`` failed workers in one stage. Each rank
    holds every micro-batch it runs in a step at once (the planner's fault-free schedules already
    defer their W's that far), each waiting for its W with what W keeps
    (``deferred_weight_grad_bytes``; the loss's logits freed by B); where a stage lost workers, its
    survivors run their share too: ceil(micro-batches x dp / (dp - failures)) each. The schedules
    themselves are predicted exactly by ``pipeline.in_flight.schedule_peaks``, which this bounds
    without planning them (seconds per plan: too slow for the allocator's search)."""
    search = plan_search(model, work, gpu, calibration)
    runs = -(-plan.accumulation(work.global_batch) * plan.dp // (plan.dp - min(failures, plan.dp - 1)))
    terms, shapes = search.shared(plan)
    stages = []
    everything_held = dict.fromkeys(range(plan.pp), (runs, runs))
    for stage, (params, grads, optimizer, saved, transient) in enumerate(search.stage_peaks(plan, None, everything_held)):
        micro = shapes[stage].micro
        between = runs * (terms.ids + max(micro, waiting_for_w_bytes(model, plan, work, terms, micro, stage)))
        if between > saved + transient:
            saved, transient = between, 0
        tensors = params + grads + optimizer + saved + transient
        other = transient + _runtime(search.constants, tensors, plan)
        stages.append(MemoryBreakdown(params=params, grads=grads, optimizer=optimizer, activations=saved, other=other))
    return MemoryEstimate(per_stage=stages)


def fully_sharded_peak(
    model: ModelSpec, plan: ParallelPlan, moments: Moments, optimizer_bytes_per_param: int, on_gpu: bool, gathered_bytes: int = FP32
) -> Breakdown:
    """(params, grads, optimizer, saved, transient) at the peak of a rank under FSDP2 (ZeRO-3,
    tp = pp = 1, fp32 weights), as torch's ``fully_shard`` per block allocates:

    - every tensor is split by rows over the dp ranks (rows padded to a multiple of dp); each rank
      keeps its shards of the weights, of the gradients (persistent, reduced into after every
      micro-batch) and of the optimizer states;
    - the root (embeddings, final norm, head) is gathered from the forward to the end of the
      backward; each block is gathered for its forward and again for its backward;
    - the root's gradients (the head's first) stay unsharded until the backward ends; a block's
      until its backward ends, when they are copied into a reduce-scatter buffer and the next
      block is gathered (measured: one block at a time in a block's backward, two around the loss).

    With master weights (FSDP2's ``MixedPrecisionPolicy``) the fp32 shards are the masters and
    the weights are gathered, and their unsharded gradients made, in ``gathered_bytes`` (bf16/fp16);
    the reduce-scatter buffer stays fp32.
    """
    dp, layers = plan.dp, model.layers
    h, V = model.hidden, model.padded_vocab
    root, block = root_shapes(model), block_shapes(model, 1)
    shard = sum(-(-r // dp) * c for r, c in root) + layers * sum(-(-r // dp) * c for r, c in block)
    gathered_root = sum(-(-r // dp) * dp * c for r, c in root)
    gathered_block = sum(-(-r // dp) * dp * c for r, c in block)
    head_grads = V * h + model.norm_parameters  # the head's weight (a tied head's lands on the embedding) and the final norm
    root_grads = sum(r * c for r, c in root)
    params, grads, states = FP32 * shard, FP32 * shard, optimizer_bytes_per_param * shard
    (block_saved, block_transient), (embedding_saved, embedding_transient) = moments.block, moments.embedding
    # From the forward's end to the loss's backward, a block is gathered beside the flat output of
    # the last all-gather, which FSDP frees when the next one completes: two blocks' worth (on gloo
    # the free's timing varies, measured peaks by up to one block; the larger is counted). In a
    # block's backward: the block and its unsharded gradients (the next block is gathered once
    # these are reduced).
    w = gathered_bytes
    gathered = w * (gathered_root + gathered_block)
    candidates = [(params + gathered + w * gathered_block, grads, states, saved, transient) for saved, transient in moments.before_grads]
    candidates.append(
        (
            params + gathered,
            grads + w * (head_grads + gathered_block),
            states,
            block_saved,
            block_transient,
        )
    )
    candidates.append(
        (params + w * gathered_root, grads + w * root_grads, states, embedding_saved, embedding_transient + FP32 * gathered_root)
    )
    largest_shard = max(-(-r // dp) * c for r, c in root + block)
    candidates.append(
        (params, grads, states, moments.ids, adam_temporaries(shard if on_gpu else largest_shard, optimizer_bytes_per_param, on_gpu))
    )
    return max(candidates, key=sum)


def _zero2_peak(
    model: ModelSpec, plan: ParallelPlan, moments: Moments, micro_batches: int, optimizer_bytes_per_param: int, on_gpu: bool
) -> Breakdown:
    """(params, grads, optimizer, saved, transient) at the peak of the worst data-parallel rank
    under DeepSpeed's ZeRO-2 (pp = 1, fp32 weights; with tp, the tp rank's shard), as DeepSpeed 0.19 allocates:

    - it flattens the weights (padded to a multiple of 2 * dp); each rank owns a slice of P
      elements with an fp32 master copy and the optimizer states. Gradients reduce through one
      bucket, allocated at the first gradient of each backward; each gradient is freed once
      bucketed, and the tensors overlapping the rank's slice (G_in) are kept from the first bucket
      carrying it (accumulating, the previous micro-batches' G_in too, from the second
      micro-batch's forward on).
    - the step: the slice's gradient norm in float64, its gradient flattened, Adam's temporaries.
    """
    layout, bucket = zero_layout(model, plan.dp, plan.tp), FP32 * zero_bucket_elements(model)
    block, embedding, ids = moments.block, moments.embedding, moments.ids
    worst: Breakdown = (0, 0, 0, 0, 0)
    padded, part = layout.padded, layout.part
    weights, states = FP32 * padded, FP32 * part + optimizer_bytes_per_param * part + 4
    accumulating = micro_batches > 1  # later micro-batches run while the earlier ones' gradients are kept
    for elements, owns_tail in ((layout.overlap_tail, True), (layout.overlap_rest, False)):
        if elements < 0:  # no rank of this kind
            continue
        overlap = FP32 * elements
        # Accumulating, the slice's gradients so far stay while a second buffer receives this micro-batch's.
        kept = overlap if accumulating else 0
        candidates = [(weights, kept, states, saved, transient) for saved, transient in moments.before_grads]
        candidates.append((weights, bucket + kept + (overlap if owns_tail else 0), states, *block))
        candidates.append((weights, bucket + kept + overlap, states, *embedding))
        candidates.append((weights, overlap, states, ids, 8 * layout.largest))  # gradient norm in float64
        candidates.append((weights, overlap, states, ids, FP32 * part))  # the slice's gradient flattened
        candidates.append((weights, 0, states, ids, FP32 * part + adam_temporaries(part, optimizer_bytes_per_param, on_gpu)))
        worst = max([worst, *candidates], key=sum)
    return worst
