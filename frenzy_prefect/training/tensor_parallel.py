"""Megatron-style tensor parallelism (Shoeybi et al. 2019): a column-parallel linear enters a
region of the tensor-parallel group with ``f`` (identity forward, all-reduce backward) and a
row-parallel linear leaves it with ``g`` (all-reduce forward, identity backward).

The vocabulary is split too: each rank holds V/t rows of the token embedding (tokens outside its
rows embed to zeros, the ranks' outputs all-reduced) and of the output layer (column-parallel:
logits for its V/t slice), and the cross-entropy is computed over the slices
(``vocab_parallel_cross_entropy``), so no rank ever holds a full-vocabulary tensor."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _in_slice(ids: torch.Tensor, rank: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids local to ``rank``'s vocabulary slice of ``rows`` rows, 0 where outside; the bool mask
    of the ids other ranks hold)."""
    outside = (ids < rank * rows) | (ids >= (rank + 1) * rows)
    return (ids - rank * rows).masked_fill_(outside, 0), outside


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split by columns over the tensor-parallel group (Megatron's
    ``_VocabParallelCrossEntropy``): the row maxima, the target's logit and the sums of exponentials
    are all-reduced; each rank keeps its slice's softmax (the shifted logits, exponentiated and
    divided in place) and its backward turns it, in place, into softmax minus one-hot."""

    @staticmethod
    def forward(ctx, logits, targets, tp):  # logits (N, V/t) fp32, targets (N,)
        rows = logits.shape[-1]
        peak = logits.max(dim=-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=tp.group)
        shifted = logits - peak.unsqueeze(-1)
        local, outside = _in_slice(targets, tp.rank, rows)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill_(outside, 0.0)
        dist.all_reduce(target_logit, group=tp.group)
        softmax = shifted.exp_()
        total = softmax.sum(dim=-1)
        dist.all_reduce(total, group=tp.group)
        softmax.div_(total.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local)
        return total.log_() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, outside, local = ctx.saved_tensors
        grad_logits = softmax  # in place: no second (N, V/t) tensor
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), (outside.to(softmax.dtype) - 1.0).unsqueeze(-1))
        grad_logits.mul_(grad.unsqueeze(-1))
        return grad_logits, None, None


class _Leave(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.mark_dirty(x)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group (size 1: no parallelism, no communication)."""

    rank: int = 0
    size: int = 1
    group: object = None

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.size == 1 else _Enter.apply(x, self.group)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.size == 1 else _Leave.apply(x, self.group)

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Embeddings of ``ids`` from this rank's rows of the table (``weight``: V/t rows), zeros for
        the tokens other ranks hold, summed over the group: every rank gets every token's embedding."""
        if self.size == 1:
            return F.embedding(ids, weight)
        local, outside = _in_slice(ids, self.rank, weight.shape[0])
        out = F.embedding(local, weight)
        return self.leave(out.masked_fill_(outside.unsqueeze(-1), 0.0))

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of (N, V/t) logits, this rank's vocabulary slice, against (N,) targets."""
        if self.size == 1:
            return F.cross_entropy(logits, targets)
        return _VocabParallelCrossEntropy.apply(logits, targets, self).mean()

    def split(self, n: int) -> slice:
        """This rank's slice of a dimension of size ``n``."""
        part = n // self.size
        return slice(self.rank * part, (self.rank + 1) * part)
