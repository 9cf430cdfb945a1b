"""Analytic per-GPU peak memory of the project's training engine, itemised per pipeline stage.

The engine (``training/engine.py``) keeps fp32 weights, fp32 gradient buffers that persist
between steps, and optimizer states; bf16/fp16 run under torch autocast. Its peak is the
largest of a few moments of a training step, each the sum of the tensors alive then:

- forward-loss: the activations saved by every in-flight micro-batch, plus the logits and their
  fp32 copy while the loss is computed;
- loss-backward: saved activations plus the two fp32 vocabulary-sized gradients of the loss;
- block-backward: the last block's backward, with the head's activations freed and the block's
  gradient temporaries alive (and, under full recomputation, the block re-materialised);
- embedding-backward: the dense embedding gradient at the end of backward;
- optimizer: model states plus the optimizer's temporaries.

Saved activations per layer are counted tensor by tensor for this GPT (pre-LayerNorm, GELU MLP,
no dropout, fused causal attention that keeps no scores) rather than with Korthikanti et al.'s
Table 2, whose constants include dropout masks and attention scores this engine never stores.
Pipeline stages hold 1F1B's in-flight micro-batches (stage s of p: min(p - s, micro-batches)).
ZeRO stages partition what DeepSpeed partitions over ``dp``; see ``zero_states``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.memory.calibration import Calibration, default_calibration
from frenzy_prefect.spec.cluster import GpuType
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import MemoryBreakdown, MemoryEstimate, ParallelPlan
from frenzy_prefect.spec.request import Precision

COMPUTE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
FP32 = 4
INDEX = 8  # token ids are int64


def check_plan(model: ModelSpec, plan: ParallelPlan) -> None:
    """Reject plans the model cannot be split into, naming the accepted values."""
    t = plan.tp
    if model.heads % t or model.hidden % t or model.ffn_hidden % t:
        ok = [d for d in range(1, model.heads + 1) if model.heads % d == 0 and model.hidden % d == 0 and model.ffn_hidden % d == 0]
        raise FrenzyError(
            f"tp ({t}) must divide heads ({model.heads}), hidden ({model.hidden}) and ffn_hidden ({model.ffn_hidden}); accepted: {ok}"
        )
    if plan.pp > model.layers:
        raise FrenzyError(f"pp ({plan.pp}) must not exceed the number of layers ({model.layers}); accepted: 1..{model.layers}")
    if plan.zero and (plan.tp > 1 or plan.pp > 1):
        raise FrenzyError(f"zero={plan.zero} is modelled as DeepSpeed runs it here, over data parallelism only; use tp=1 and pp=1, or zero=0 with tp/pp")


def stage_layer_counts(layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage; the first stages take the remainder."""
    base, extra = divmod(layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def layer_parameters(model: ModelSpec, tp: int) -> tuple[int, int]:
    """(all, matrices and biases of the linear layers) of one block on tensor-parallel rank 0:
    QKV and MLP-in split by columns, the projections by rows (their biases kept on rank 0)."""
    h, f = model.hidden, model.ffn_hidden
    linear = (3 * h * h + 3 * h + h * h + f * h + f + f * h) // tp + 2 * h
    return linear + 4 * h, linear


def stage_parameters(model: ModelSpec, plan: ParallelPlan, stage: int) -> int:
    """Parameters on a rank of a stage: its layers (tp rank 0), the embeddings on the first stage,
    the final norm and head on the last (a separate copy of a tied embedding when the stages differ).
    Embeddings and head are replicated over tp."""
    n = stage_layer_counts(model.layers, plan.pp)[stage] * layer_parameters(model, plan.tp)[0]
    if stage == 0:
        n += model.embedding_parameters
    if stage == plan.pp - 1:
        n += model.head_parameters
        if model.tied_embeddings and plan.pp > 1:
            n += model.vocab_size * model.hidden
    return n


def largest_tensor(model: ModelSpec, plan: ParallelPlan, stage: int) -> int:
    """Elements of the largest parameter tensor on a rank of ``stage``."""
    h, f, t = model.hidden, model.ffn_hidden, plan.tp
    sizes = [3 * h * h // t, f * h // t]
    if stage == 0:
        sizes += [model.vocab_size * h, model.max_seq_len * h]
    if stage == plan.pp - 1 and (not model.tied_embeddings or plan.pp > 1):
        sizes.append(model.vocab_size * h)
    return max(sizes)


def zero_bucket_elements(model: ModelSpec) -> int:
    """DeepSpeed's communication buckets, sized to the model as the Hugging Face integration's
    "auto" does (hidden^2 elements) rather than DeepSpeed's 5e8-element GPU defaults."""
    return model.hidden**2


def parameter_sizes(model: ModelSpec) -> list[int]:
    """Elements of every parameter tensor of the whole model, in ``GPT.parameters()`` order (the
    order DeepSpeed flattens and partitions them in)."""
    h, f, V = model.hidden, model.ffn_hidden, model.vocab_size
    block = [h, h, 3 * h * h, 3 * h, h * h, h, h, h, f * h, f, h * f, h]
    sizes = [V * h, model.max_seq_len * h] + block * model.layers + [h, h]
    return sizes + ([] if model.tied_embeddings else [V * h])


def partition_overlap(sizes: list[int], part: int, rank: int) -> int:
    """Elements of the tensors that overlap ``rank``'s slice of the flattened parameters: ZeRO-2
    allocates their gradients when it reduces them into that slice."""
    low, high, offset, total = rank * part, (rank + 1) * part, 0, 0
    for n in sizes:
        if offset < high and offset + n > low:
            total += n
        offset += n
    return total


class Moments(NamedTuple):
    """(saved activations, transient bytes) at the candidate peaks of one rank's forward and backward."""

    before_grads: list[tuple[int, int]]  # forward end, logits, loss backward: no parameter gradient yet
    block: tuple[int, int]  # the last block's backward
    embedding: tuple[int, int] | None  # the embedding's backward (first stage)
    ids: int  # token ids of the step's micro-batches, alive through the optimizer step


def activation_moments(model: ModelSpec, plan: ParallelPlan, *, micro_batches: int, seq_len: int, precision: Precision, stage: int) -> Moments:
    s, b, h, f, a, V, t = seq_len, plan.micro_batch, model.hidden, model.ffn_hidden, model.heads, model.vocab_size, plan.tp
    e = COMPUTE_BYTES[precision]
    half = e < FP32
    first, last = stage == 0, stage == plan.pp - 1
    sbh, sb, sbV = s * b * h, s * b, s * b * V
    layers = stage_layer_counts(model.layers, plan.pp)[stage]
    _, linear = layer_parameters(model, t)

    # Autocast's half-precision weight copies are saved for the backward by torch's linear layers,
    # but not by ZeRO-3's (DeepSpeed's own linear function saves its fp32 input and weight and
    # casts again in the backward); either way the copies live until the forward ends.
    saves_copies = half and plan.zero < 3
    norm_out = e * sbh if plan.zero < 3 else FP32 * sbh  # what the layer after a LayerNorm saves

    # One block's saved tensors, one micro-batch.
    layer = (
        2 * FP32 * sbh  # block input and the residual after attention (fp32 under autocast)
        + 2 * 2 * FP32 * sb  # LayerNorm means and reciprocal deviations
        + 2 * norm_out  # LayerNorm outputs (their compute-precision casts under autocast)
        + 4 * e * sbh // t  # QKV output, attention output
        + 2 * e * s * b * f // t  # MLP input and GELU output
        + (2 * linear if saves_copies else 0)
    )
    lse = FP32 * b * (a // t) * s  # fused attention's log-sum-exp, dropped by selective recompute
    if plan.recompute == "none":
        layer += lse
    saved_layer = FP32 * sbh if plan.recompute == "full" else layer
    head = (FP32 * sbh + 2 * FP32 * sb + norm_out + (2 * V * h if saves_copies else 0) + FP32 * sbV) if last else 0
    micro = layers * saved_layer + head
    micro += FP32 * sbh * ((not first) + (not last))  # received input, output held for its gradient
    in_flight = min(plan.pp - stage, micro_batches)
    ids = micro_batches * b * (s + 1) * INDEX
    held = (in_flight - 1) * micro + ids

    tied_pending = FP32 * V * h if model.tied_embeddings and plan.pp == 1 else 0  # head's gradient waits for the embedding's
    block_temp = FP32 * sbh + tied_pending + e * (s * b * f + h * f) // t + e * h
    if plan.recompute == "full":  # the block re-materialised whole (its input is already saved)
        block_temp += layer + lse - FP32 * sbh
    if half and not saves_copies:  # ZeRO-3 casts one weight again in the backward
        block_temp += 2 * h * f // t
    # Autocast caches its weight copies until the forward ends; under full recomputation nothing
    # else keeps them, so they are extra until then. (ZeRO-3's gathered weights are cast anew.)
    cache = layers * 2 * linear if half and plan.recompute == "full" and saves_copies else 0
    before = [(held + micro, cache)]
    if last:
        before.append((held + micro, cache + (FP32 + e if half else FP32) * sbV))  # logits and their fp32 copy
        before.append((held + micro, 2 * FP32 * sbV))  # loss backward
    embedding = (held, FP32 * sbh + tied_pending + FP32 * V * h) if first else None
    return Moments(before, (held + micro - head, block_temp), embedding, ids)


def adam_temporaries(tensor_elements: int, optimizer_bytes_per_param: int, on_gpu: bool) -> int:
    """Adam's update keeps the square root of its second moment and that divided by the bias
    correction (two tensors the size of the parameter at once, on CPU where torch updates tensor by
    tensor; one list the size of all of them on CUDA, where it updates them together). SGD: none."""
    if optimizer_bytes_per_param < 8:
        return 0
    return FP32 * tensor_elements * (1 if on_gpu else 2)


def estimate(
    model: ModelSpec,
    plan: ParallelPlan,
    *,
    global_batch: int,
    seq_len: int,
    precision: Precision,
    optimizer_bytes_per_param: int,
    gpu: GpuType | None = None,
    calibration: Calibration | None = None,
) -> MemoryEstimate:
    """Predicted peak bytes on one GPU of every pipeline stage of ``plan`` (``gpu`` None: the
    tensors alone, as measured on CPU)."""
    check_plan(model, plan)
    micro_batches = plan.accumulation(global_batch)
    constants = (calibration or default_calibration()).for_gpu(gpu)
    on_gpu = gpu is not None
    stages = []
    for stage in range(plan.pp):
        moments = activation_moments(model, plan, micro_batches=micro_batches, seq_len=seq_len, precision=precision, stage=stage)
        if plan.zero:
            breakdown = _zero_peak(model, plan, moments, micro_batches, optimizer_bytes_per_param, on_gpu)
        else:
            params = stage_parameters(model, plan, stage)
            largest = params if on_gpu else largest_tensor(model, plan, stage)
            step = (moments.ids, adam_temporaries(largest, optimizer_bytes_per_param, on_gpu))
            saved, transient = max([*moments.before_grads, moments.block, moments.embedding or step, step], key=sum)
            breakdown = (FP32 * params, FP32 * params, optimizer_bytes_per_param * params, saved, transient)
        tensors = sum(breakdown)
        runtime = constants.overhead_bytes + math.ceil((constants.fragmentation - 1) * tensors)
        params_b, grads_b, optimizer_b, saved, transient = breakdown
        # model_construct: every field is a non-negative int by construction; the allocator calls
        # this for every candidate plan, and validation would cost more than the arithmetic.
        stages.append(
            MemoryBreakdown.model_construct(params=params_b, grads=grads_b, optimizer=optimizer_b, activations=saved, other=transient + runtime)
        )
    return MemoryEstimate.model_construct(per_stage=stages)


def _zero_peak(model: ModelSpec, plan: ParallelPlan, moments: Moments, micro_batches: int, optimizer_bytes_per_param: int, on_gpu: bool) -> tuple[int, int, int, int, int]:
    """(params, grads, optimizer, saved, transient) at the peak of the worst data-parallel rank
    under DeepSpeed's ZeRO (tp = pp = 1, fp32 weights), as DeepSpeed 0.19 allocates:

    - stages 1-2 flatten the weights (padded to a multiple of 2 * dp); each rank owns a slice of P
      elements with an fp32 master copy and the optimizer states. Gradients reduce through one
      bucket, allocated at the first gradient of each backward; stage 1 keeps every gradient until
      the end of backward, then gathers its slice's (the tensors overlapping it, G_in); stage 2
      frees each gradient once bucketed and keeps G_in from the first bucket carrying its slice
      (accumulating, the previous micro-batches' G_in too). Gradients kept across micro-batches
      of one step are there from the second micro-batch's forward on.
    - stage 3 partitions each tensor (P3 elements per rank, with master, gradient and optimizer
      slices and a persistent bucket) and, in steady state, keeps every weight gathered from the
      forward until its gradient has arrived; a reduce-scatter of the bucket copies it twice (gloo).
    - the step: the slice's gradient norm in float64, its gradient flattened, Adam's temporaries.
    """
    dp, sizes, bucket = plan.dp, parameter_sizes(model), FP32 * zero_bucket_elements(model)
    n, h = sum(sizes), model.hidden
    embeddings = (model.vocab_size + model.max_seq_len) * h
    tail = 2 * h + (0 if model.tied_embeddings else model.vocab_size * h) + model.layer_parameters  # gradients by the last block's backward
    block, embedding, ids = moments.block, moments.embedding, moments.ids
    worst = (0, 0, 0, 0, 0)
    if plan.zero == 3:
        part = sum(math.ceil(x / dp) for x in sizes)
        states = FP32 * part + optimizer_bytes_per_param * part + 4  # master slice and optimizer states
        grads = FP32 * part + bucket
        flush = 2 * bucket
        candidates = [(FP32 * (part + n), grads, states, saved, transient) for saved, transient in moments.before_grads]
        released = 2 * h + (0 if model.tied_embeddings else model.vocab_size * h)  # final norm and head, whose gradients are in
        candidates.append((FP32 * (part + n - released), grads, states, block[0], block[1] + flush))
        candidates.append((FP32 * (part + embeddings), grads, states, embedding[0], embedding[1] + flush))
        largest = max(math.ceil(x / dp) for x in sizes)
        for step in (8 * largest, FP32 * part + adam_temporaries(part, optimizer_bytes_per_param, on_gpu)):
            candidates.append((FP32 * part, grads, states, ids, step))
        return max(candidates, key=sum)
    padded = math.ceil(n / (2 * dp)) * 2 * dp
    part = padded // dp
    weights, states = FP32 * padded, FP32 * part + optimizer_bytes_per_param * part + 4
    accumulating = micro_batches > 1  # later micro-batches run while the earlier ones' gradients are kept
    for rank in range(dp):
        overlap = FP32 * partition_overlap(sizes, part, rank)
        if plan.zero == 1:
            kept = FP32 * n if accumulating else 0
            candidates = [(weights, kept, states, saved, transient) for saved, transient in moments.before_grads]
            candidates.append((weights, (FP32 * n if accumulating else FP32 * tail) + bucket, states, *block))
            candidates.append((weights, (FP32 * n if accumulating else FP32 * (n - embeddings)) + bucket, states, *embedding))
            candidates.append((weights, FP32 * n + bucket + overlap, states, ids, 0))  # end of backward
        else:
            # Accumulating, the slice's gradients so far stay while a second buffer receives this micro-batch's.
            kept = overlap if accumulating else 0
            owns_tail = (rank + 1) * part > n - tail  # its slice is reduced during the last block's backward
            candidates = [(weights, kept, states, saved, transient) for saved, transient in moments.before_grads]
            candidates.append((weights, bucket + kept + (overlap if owns_tail else 0), states, *block))
            candidates.append((weights, bucket + kept + overlap, states, *embedding))
        largest = max(x for x in sizes)
        candidates.append((weights, overlap, states, ids, 8 * largest))  # gradient norm in float64
        candidates.append((weights, overlap, states, ids, FP32 * part))  # the slice's gradient flattened
        candidates.append((weights, 0, states, ids, FP32 * part + adam_temporaries(part, optimizer_bytes_per_param, on_gpu)))
        worst = max([worst, *candidates], key=sum)
    return worst
