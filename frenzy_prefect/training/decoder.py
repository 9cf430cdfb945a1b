"""The decoder the engine trains, assembled from ``layers`` and built from a ModelSpec: GPT-2
(learned positions, LayerNorm, GELU) or Llama (rotary positions, RMSNorm, SwiGLU, grouped-query
attention), tied or untied embeddings.

One module serves every plan: ``stage``/``split`` select a pipeline stage's layers (embeddings
on the first, final norm and head on the last) and ``tp`` splits attention heads, the MLP and
the vocabulary Megatron-style (the token embedding and the head hold V/t rows, the logits and
the loss's gradients V/t columns; the vocabulary is padded to a multiple of tp, ``padded_vocab``).
Weights are drawn for the whole model and sliced (``shard_state``), so every plan with the same
padded vocabulary starts from the same weights. Shapes: B batch, T sequence, C hidden, V vocabulary.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from frenzy_prefect.spec.layout import padded_vocab
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import Recompute
from frenzy_prefect.spec.request import Attention
from frenzy_prefect.training.layers import Block, dropout, norm, positions
from frenzy_prefect.training.tensor_parallel import TensorParallel


def stage_layers(split: tuple[int, ...], stage: int) -> range:
    """The layers of one pipeline stage (``split``: the layers of each, as the plan gives them)."""
    start = sum(split[:stage])
    return range(start, start + split[stage])


class Decoder(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        recompute: Recompute = "none",
        *,
        attention: Attention = "flash",
        tp: TensorParallel = TensorParallel(),
        stage: int = 0,
        split: tuple[int, ...] | None = None,
        vocab: int | None = None,
    ):
        """``split``: the layers of each pipeline stage (default: one stage, every layer);
        ``vocab``: rows of the whole token embedding and head (default: padded for ``tp``); the
        whole model a ``tp``-way plan is sliced from is drawn with that plan's padding."""
        super().__init__()
        self.spec, self.attention, self.tp = spec, attention, tp
        rows = (vocab or padded_vocab(spec, tp.size)) // tp.size  # this rank's vocabulary slice
        split = split or (spec.layers,)
        self.first, self.last = stage == 0, stage == len(split) - 1
        self.recompute_blocks = recompute == "full"
        if self.first:
            self.tok_emb = nn.Embedding(rows, spec.hidden)
            if spec.position == "learned":
                self.pos_emb = nn.Embedding(spec.max_seq_len, spec.hidden)
        self.blocks = nn.ModuleList(Block(spec, attention, recompute, tp) for _ in stage_layers(split, stage))
        if self.last:
            self.ln_f = norm(spec)
            self.head = nn.Linear(spec.hidden, rows, bias=False)  # column-parallel
            if spec.tied_embeddings and self.first:
                self.head.weight = self.tok_emb.weight
        if tp.size == 1 and len(split) == 1:
            self.apply(self._init)
            for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
                if name.endswith("proj.weight"):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * spec.layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) in on the first stage, hidden states (B, T, C) in on the others; out:
        hidden states, or on the last stage logits (B, T, V/t: this rank's slice), or the mean
        cross-entropy given ``targets``."""
        if self.first:
            x = self.tp.embed(x, self.tok_emb.weight)  # (B, T, C)
            if self.spec.position == "learned":
                x = x + self.pos_emb(torch.arange(x.shape[1], device=x.device))
            x = dropout(x, self.spec.hidden_dropout, self.training)
        shared = positions(self.spec, self.attention, x.shape[1], x.device, x.dtype)
        for block in self.blocks:
            if self.recompute_blocks and self.training:
                x = checkpoint(block, x, shared, use_reentrant=False)
            else:
                x = block(x, shared)
        if not self.last:
            return x
        logits = self.head(self.tp.enter(self.ln_f(x)))  # (B, T, V/t)
        if targets is None:
            return logits
        return self.tp.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def shard_state(
    full: dict[str, torch.Tensor], spec: ModelSpec, tp: TensorParallel, stage: int, split: tuple[int, ...]
) -> dict[str, torch.Tensor]:
    """The whole model's state sliced to one stage (``split``: the layers of each) and
    tensor-parallel rank (``Decoder`` naming; views of ``full`` or slices copied from it, for
    ``load_state_dict`` to copy)."""
    layers = stage_layers(split, stage)
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        if name.startswith("blocks."):
            _, index, rest = name.split(".", 2)
            if int(index) not in layers:
                continue
            part = _tp_slice(rest, t, spec, tp)
            if part is not None:
                out[f"blocks.{int(index) - layers.start}.{rest}"] = part
        elif name.startswith(("tok_emb", "pos_emb")) and stage == 0:
            out[name] = t[tp.split(t.shape[0])] if name == "tok_emb.weight" else t
        elif name.startswith(("ln_f", "head")) and stage == len(split) - 1:
            out[name] = t[tp.split(t.shape[0])] if name == "head.weight" else t
    if stage == len(split) - 1 and "head.weight" not in out:  # tied head on a later stage than the embedding
        emb = full["tok_emb.weight"]
        out["head.weight"] = emb[tp.split(emb.shape[0])]
    return out


def is_tp_sharded(name: str) -> bool:
    """Whether a parameter is split over tensor-parallel ranks (or, for row-parallel biases, held by
    one): the blocks' attention and MLP, and the vocabulary slices of the token embedding and head."""
    return ".attn." in name or ".mlp." in name or name in ("tok_emb.weight", "head.weight")


def tp_split(name: str, spec: ModelSpec) -> tuple[int, list[int]] | None:
    """How a block tensor (``name`` inside the block: ``attn.qkv.weight``) is split over tensor-parallel
    ranks: (dimension, widths of the parts laid end to end along it), each rank holding its slice of
    every part in the same order (QKV: [q | k | v]; SwiGLU: [gate | up]); None: whole on every rank
    (norms; row-parallel biases, which tp rank 0 alone holds)."""
    h, f = spec.hidden, spec.ffn_hidden
    if name.startswith("attn.qkv"):  # each rank's query heads and the key/value heads they use
        return 0, [h, spec.kv_width, spec.kv_width]
    if name.startswith("mlp.fc"):
        return 0, [f, f] if spec.mlp == "swiglu" else [f]
    if name == "attn.proj.weight":
        return 1, [h]
    if name == "mlp.proj.weight":
        return 1, [f]
    return None


def _tp_slice(name: str, t: torch.Tensor, spec: ModelSpec, tp: TensorParallel) -> torch.Tensor | None:
    if tp.size == 1:
        return t
    if name.endswith("proj.bias"):
        return t if tp.rank == 0 else None
    split = tp_split(name, spec)
    if split is None:
        return t
    dim, widths = split
    parts = t.split(widths, dim)
    return torch.cat([part.narrow(dim, tp.split(n).start, n // tp.size) for part, n in zip(parts, widths, strict=True)], dim)
