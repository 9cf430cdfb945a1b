"""Megatron-style tensor parallelism (Shoeybi et al. 2019): a column-parallel linear enters a
region of the tensor-parallel group with ``f`` (identity forward, all-reduce backward) and a
row-parallel linear leaves it with ``g`` (all-reduce forward, identity backward)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


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

    def split(self, n: int) -> slice:
        """This rank's slice of a dimension of size ``n``."""
        part = n // self.size
        return slice(self.rank * part, (self.rank + 1) * part)
