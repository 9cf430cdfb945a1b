"""The layout of a parallel plan over the model: which plans split it, layers per pipeline stage,
parameters (and the largest tensor) on a rank of each stage, how gradients are reduced, and in
what order DeepSpeed flattens the parameters it shards.

The training engine lays the model out by these rules and the memory model counts bytes by them,
so both import them from here: the executor does not depend on its own model.
"""

from __future__ import annotations

import heapq
from functools import lru_cache

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.request import Precision, Resilience, check_master_weights


def zero_runs_with(zero: int, tp: int, pp: int) -> bool:
    """Whether ZeRO stage ``zero`` combines with tp and pp: ZeRO-2 runs through DeepSpeed, which
    refuses pipelines (its runtime/pipe/engine.py); ZeRO-3 through FSDP2, over data parallelism alone."""
    return not (zero == 2 and pp > 1 or zero == 3 and (tp > 1 or pp > 1))


def check_plan(model: ModelSpec, plan: ParallelPlan) -> None:
    """Reject plans the model cannot be split into, naming the accepted values."""
    check_tp(model, plan.tp)
    plan.layer_split(model.layers)  # pp within the layers, an uneven split adding up to them
    if zero_runs_with(plan.zero, plan.tp, plan.pp):
        return
    if plan.zero == 2:
        raise FrenzyError(f"zero=2 runs through DeepSpeed, which refuses it with pipelines; use pp=1, or zero 0 or 1 with pp={plan.pp}")
    raise FrenzyError("zero=3 runs through FSDP2 here, over data parallelism only; use tp=1 and pp=1, or zero=0 or 1 with tp/pp")


def check_engine_plan(spec: ModelSpec, plan: ParallelPlan, precision: Precision, master_weights: bool = False) -> None:
    """The plans the estimator covers (``check_plan``), less what the training engine does not run."""
    check_plan(spec, plan)
    try:
        check_master_weights(precision, master_weights)
    except ValueError as e:
        raise FrenzyError(str(e)) from None
    if master_weights and plan.zero == 2:
        raise FrenzyError("master_weights runs with zero 0, 1 (any tp and pp) or 3 (FSDP2's mixed precision); ZeRO-2 keeps fp32 weights")
    if precision == "fp16" and (plan.tp > 1 or plan.pp > 1 or plan.zero):
        raise FrenzyError("fp16 loss scaling is implemented for plain data parallelism (tp=1, pp=1, zero=0); use bf16 or fp32")
    if plan.replica_micro_batches is not None and (plan.pp > 1 or plan.zero == 2):
        raise FrenzyError(
            "replica_micro_batches (uneven replicas) runs with pp=1 and zero 0, 1 or 3; use an even split with pipelines or ZeRO-2"
        )


def check_resilience(plan: ParallelPlan, resilience: Resilience, master_weights: bool = False) -> None:
    """Refuse, in one line, a plan that resilience 'recycle' (ReCycle) cannot keep running through a
    failure: the failed worker's stage must be whole on a live peer in another pipeline."""
    if resilience != "recycle":
        return
    problems = [
        f"dp={plan.dp} (needs >= 2: a failed worker's peers run its micro-batches)" if plan.dp < 2 else "",
        f"pp={plan.pp} (needs >= 2: its schedules re-route a stage's micro-batches)" if plan.pp < 2 else "",
        f"tp={plan.tp} (needs 1)" if plan.tp != 1 else "",
        f"zero={plan.zero} (needs 0: ZeRO shards the state a failed worker's peers must hold whole)" if plan.zero else "",
        "master_weights (not carried through a failure yet)" if master_weights else "",
    ]
    if any(problems):
        raise FrenzyError(f"resilience 'recycle' cannot run plan {plan.label()}: " + "; ".join(p for p in problems if p))


def tp_splits(model: ModelSpec, tp: int) -> bool:
    """Whether Megatron-style tensor parallelism over ``tp`` ranks splits the model evenly: whole
    query heads and key/value heads, and the MLP, on every rank."""
    return not (model.heads % tp or model.kv_heads % tp or model.hidden % tp or model.ffn_hidden % tp)


def check_tp(model: ModelSpec, tp: int) -> None:
    """Reject a tensor-parallel degree that does not split the model evenly, naming the accepted ones."""
    if not tp_splits(model, tp):
        ok = [d for d in range(1, model.heads + 1) if tp_splits(model, d)]
        raise FrenzyError(
            f"tp ({tp}) must divide heads ({model.heads}), kv_heads ({model.kv_heads}), hidden ({model.hidden}) and "
            f"ffn_hidden ({model.ffn_hidden}); accepted: {ok}"
        )


def padded_vocab(model: ModelSpec, tp: int) -> int:
    """Rows of the whole token embedding and head under ``tp``-way tensor parallelism. As Megatron
    pads (``make_vocab_size_divisible_by`` times tp): the vocabulary padded to a multiple of
    ``vocab_multiple * tp``, so each rank holds an equal slice. tp = 1: ``model.padded_vocab``."""
    multiple = model.vocab_multiple * tp
    return -(-model.vocab_size // multiple) * multiple


def vocab_rows(model: ModelSpec, tp: int) -> int:
    """Rows of the token embedding and of the head on one tensor-parallel rank (its vocabulary
    slice): the embedding, the head, the logits and the loss's gradients are split over tp."""
    return padded_vocab(model, tp) // tp


def uses_ddp(plan: ParallelPlan, master_weights: bool = False) -> bool:
    """Whether the engine reduces gradients through DDP (overlapped with the backward): plain data
    parallelism. DDP's buckets are the gradients, but it rebuilds them once, in the order the
    gradients became ready, at the second step's forward: a second set exists for that moment.
    With master weights the fp32 main gradients are all-reduced after the backward instead."""
    return plan.dp > 1 and plan.tp == 1 and plan.pp == 1 and not plan.zero and not master_weights


def block_shapes(model: ModelSpec, tp: int) -> list[tuple[int, int]]:
    """(rows, columns) of one block's parameter tensors on tensor-parallel rank 0, in ``Block``
    order: norm, QKV (column-split), projection (row-split, its bias kept on rank 0), norm, MLP-in
    (column-split; SwiGLU's gate and up together), MLP-out (row-split, bias on rank 0). A
    LayerNorm has a scale and a shift, an RMSNorm a scale; absent biases are left out; vectors
    have one column."""
    h, f, m = model.hidden, model.ffn_hidden, model
    norm = [(h, 1), (h, 1)] if m.norm == "layernorm" else [(h, 1)]
    qkv = (h + 2 * m.kv_width) // tp
    mlp_in = (2 if m.mlp == "swiglu" else 1) * f // tp
    attention = [(qkv, h), *([(qkv, 1)] if m.qkv_bias else []), (h, h // tp), *([(h, 1)] if m.out_bias else [])]
    return [*norm, *attention, *norm, (mlp_in, h), *([(mlp_in, 1)] if m.mlp_bias else []), (h, f // tp), *([(h, 1)] if m.mlp_bias else [])]


def embedding_shapes(model: ModelSpec, tp: int = 1) -> list[tuple[int, int]]:
    """(rows, columns) of what the first stage holds before the blocks: the token embedding (the
    rank's vocabulary slice) and the learned positions, if any (replicated over tp)."""
    h = model.hidden
    return [(vocab_rows(model, tp), h), *([(model.max_seq_len, h)] if model.position == "learned" else [])]


def head_shapes(model: ModelSpec, tp: int = 1, *, own_head: bool) -> list[tuple[int, int]]:
    """(rows, columns) of what the last stage holds after the blocks: the final norm and, with
    ``own_head`` (untied, or a tied embedding's copy on a later stage), the head's vocabulary slice."""
    h = model.hidden
    final_norm = [(h, 1), (h, 1)] if model.norm == "layernorm" else [(h, 1)]
    return final_norm + ([(vocab_rows(model, tp), h)] if own_head else [])


def root_shapes(model: ModelSpec, tp: int = 1) -> list[tuple[int, int]]:
    """(rows, columns) of the parameters outside the blocks on one tensor-parallel rank, in module
    order: token embedding (its vocabulary slice), learned positions, final norm, untied head (its slice)."""
    return embedding_shapes(model, tp) + head_shapes(model, tp, own_head=not model.tied_embeddings)


def block_tensors(model: ModelSpec, tp: int) -> list[int]:
    """Elements of one block's parameter tensors on tensor-parallel rank 0, in ``Block`` order."""
    return [rows * columns for rows, columns in block_shapes(model, tp)]


@lru_cache(maxsize=1024)
def layer_parameters(model: ModelSpec, tp: int) -> tuple[int, int]:
    """(all, those of the linear layers) parameters of one block on tensor-parallel rank 0."""
    total = sum(block_tensors(model, tp))
    return total, total - 2 * model.norm_parameters


def stage_tensor_sizes(model: ModelSpec, plan: ParallelPlan, stage: int) -> tuple[int, ...]:
    """Elements of every parameter tensor on a rank of a stage (tp rank 0): its layers, the
    embeddings on the first stage, the final norm and head on the last (a separate copy of a tied
    embedding when the stages differ). The token embedding and the head hold the rank's
    vocabulary slice (``vocab_rows``); learned positions and norms are replicated over tp."""
    return _stage_tensor_sizes(model, plan.tp, plan.layer_split(model.layers), stage)


@lru_cache(maxsize=4096)
def _stage_tensor_sizes(model: ModelSpec, tp: int, split: tuple[int, ...], stage: int) -> tuple[int, ...]:
    pp = len(split)
    shapes = embedding_shapes(model, tp) if stage == 0 else []
    if stage == pp - 1:
        shapes += head_shapes(model, tp, own_head=not model.tied_embeddings or pp > 1)
    return tuple(block_tensors(model, tp) * split[stage] + [r * c for r, c in shapes])


def stage_parameters(model: ModelSpec, plan: ParallelPlan, stage: int) -> int:
    """Parameters on a rank of a stage (``stage_tensor_sizes``)."""
    return _stage_parameters(model, plan.tp, plan.layer_split(model.layers), stage)


@lru_cache(maxsize=4096)
def _stage_parameters(model: ModelSpec, tp: int, split: tuple[int, ...], stage: int) -> int:
    return sum(_stage_tensor_sizes(model, tp, split, stage))


def largest_tensor(model: ModelSpec, plan: ParallelPlan, stage: int) -> int:
    """Elements of the largest parameter tensor on a rank of ``stage``."""
    return max(stage_tensor_sizes(model, plan, stage))


@lru_cache(maxsize=4096)
def stage_shapes(model: ModelSpec, tp: int, split: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """Per pipeline stage (``split``: the layers of each): (layers, parameters, largest parameter
    tensor) of one of its ranks."""
    plan = ParallelPlan(tp=tp, pp=len(split), stage_layers=split)
    return tuple((split[s], stage_parameters(model, plan, s), largest_tensor(model, plan, s)) for s in range(len(split)))


def zero_bucket_elements(model: ModelSpec) -> int:
    """DeepSpeed's communication buckets, sized to the model as the Hugging Face integration's
    "auto" does (hidden^2 elements) rather than DeepSpeed's 5e8-element GPU defaults."""
    return model.hidden**2


def parameter_sizes(model: ModelSpec, tp: int = 1) -> list[int]:
    """Elements of every parameter tensor of the whole model (on tensor-parallel rank 0), in
    ``Decoder.parameters()`` order (the order DeepSpeed flattens and partitions them in)."""
    outside = [r * c for r, c in root_shapes(model, tp)]
    before = len(embedding_shapes(model, tp))
    return outside[:before] + block_tensors(model, tp) * model.layers + outside[before:]


def deal_out(sizes: list[int], ranks: int) -> list[int]:
    """The rank each tensor (of ``sizes`` elements) goes to under ZeRO-1, as torch's
    ZeroRedundancyOptimizer deals them: largest first (ties in order), each to the rank holding the
    fewest elements so far (ties: the lowest rank). A heap of the ranks dealt to so far, beside the
    lowest rank not yet dealt to: the cost follows the tensors, not the ranks."""
    owners, dealt, fresh = [0] * len(sizes), [], 0  # dealt: a heap of (elements, rank)
    for i in sorted(range(len(sizes)), key=lambda i: sizes[i], reverse=True):
        if fresh < ranks and (not dealt or (0, fresh) < dealt[0]):
            total, owners[i] = 0, fresh
            fresh += 1
        else:
            total, owners[i] = heapq.heappop(dealt)
        heapq.heappush(dealt, (total + sizes[i], owners[i]))
    return owners
