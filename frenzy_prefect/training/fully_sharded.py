"""ZeRO-3 through torch's FSDP2 (``fully_shard``): every block is its own unit, gathered just before
it runs and resharded after, so at most one block's full weights (plus the root's embeddings,
final norm and head, which FSDP keeps gathered from the forward to the backward) exist at once.
Weights stay fp32 (bf16 runs under autocast, as in every other plan) and gradients are
reduce-scattered in fp32 after each micro-batch's backward, into persistent fp32 shards. With
master weights, FSDP2's own mixed precision: the fp32 shards are the masters, gathered as bf16/fp16
for compute (no autocast), and the half gradients reduce-scattered in fp32."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def shard_fully(
    model: torch.nn.Module, blocks: torch.nn.ModuleList, group, device: torch.device, param_dtype: torch.dtype | None = None
) -> None:
    """Shard ``model`` over the data-parallel ``group`` in place: each of ``blocks``, then the root;
    ``param_dtype``: gather the weights in it, and reduce the gradients in fp32."""
    mesh = DeviceMesh.from_group(group, device.type)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def clip_sharded_gradients(model: torch.nn.Module, max_norm: float) -> None:
    """Clip by the whole model's gradient norm; the shards' norms are combined over the mesh."""
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
