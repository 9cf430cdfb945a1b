"""A GPT-2 style decoder in one readable file (after nanoGPT's model.py), built from a ModelSpec.

One module serves every plan: ``stage``/``stages`` select a pipeline stage's layers (embeddings
on the first, final norm and head on the last) and ``tp`` splits attention heads and the MLP
Megatron-style. Weights are drawn for the whole model and sliced (``shard_state``), so every
plan starts from the same weights. Shapes: B batch, T sequence, C hidden, H heads, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from frenzy_prefect.spec.layout import stage_layer_counts
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import Recompute
from frenzy_prefect.training.tensor_parallel import TensorParallel


def stage_layers(layers: int, stages: int, stage: int) -> range:
    """The layers of one pipeline stage (the split the memory model counts)."""
    counts = stage_layer_counts(layers, stages)
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


class CausalSelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec, recompute: Recompute, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.heads = spec.heads // tp.size
        self.width = spec.hidden // tp.size
        self.qkv = nn.Linear(spec.hidden, 3 * self.width)  # column parallel: this rank's heads
        self.proj = nn.Linear(self.width, spec.hidden, bias=tp.rank == 0)  # row parallel: the bias is added once
        self.recompute_core = recompute == "selective"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(self.tp.enter(x)).split(self.width, dim=2)
        q, k, v = (t.view(B, T, self.heads, self.width // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, H, T, C/H)
        if self.recompute_core and self.training:  # selective: recompute only the attention core
            y = checkpoint(F.scaled_dot_product_attention, q, k, v, None, 0.0, True, use_reentrant=False)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.tp.leave(self.proj(y.transpose(1, 2).contiguous().view(B, T, self.width)))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.fc = nn.Linear(spec.hidden, spec.ffn_hidden // tp.size)
        self.proj = nn.Linear(spec.ffn_hidden // tp.size, spec.hidden, bias=tp.rank == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.leave(self.proj(F.gelu(self.fc(self.tp.enter(x)), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, recompute: Recompute, tp: TensorParallel):
        super().__init__()
        self.ln1 = nn.LayerNorm(spec.hidden)
        self.attn = CausalSelfAttention(spec, recompute, tp)
        self.ln2 = nn.LayerNorm(spec.hidden)
        self.mlp = MLP(spec, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self, spec: ModelSpec, recompute: Recompute = "none", *, tp: TensorParallel = TensorParallel(), stage: int = 0, stages: int = 1
    ):
        super().__init__()
        self.spec = spec
        self.first, self.last = stage == 0, stage == stages - 1
        self.recompute_blocks = recompute == "full"
        if self.first:
            self.tok_emb = nn.Embedding(spec.padded_vocab, spec.hidden)
            self.pos_emb = nn.Embedding(spec.max_seq_len, spec.hidden)
        self.blocks = nn.ModuleList(Block(spec, recompute, tp) for _ in stage_layers(spec.layers, stages, stage))
        if self.last:
            self.ln_f = nn.LayerNorm(spec.hidden)
            self.head = nn.Linear(spec.hidden, spec.padded_vocab, bias=False)
            if spec.tied_embeddings and self.first:
                self.head.weight = self.tok_emb.weight
        if tp.size == 1 and stages == 1:
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
        hidden states, or on the last stage logits (B, T, V), or the mean cross-entropy given ``targets``."""
        if self.first:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))  # (B, T, C)
        for block in self.blocks:
            if self.recompute_blocks and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if not self.last:
            return x
        logits = self.head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def shard_state(full: dict[str, torch.Tensor], spec: ModelSpec, tp: TensorParallel, stage: int, stages: int) -> dict[str, torch.Tensor]:
    """The whole model's state sliced to one stage and tensor-parallel rank (``GPT`` naming; views
    of ``full``, for ``load_state_dict`` to copy)."""
    layers = stage_layers(spec.layers, stages, stage)
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
            out[name] = t
        elif name.startswith(("ln_f", "head")) and stage == stages - 1:
            out[name] = t
    if stage == stages - 1 and "head.weight" not in out:  # tied head on a later stage than the embedding
        out["head.weight"] = full["tok_emb.weight"]
    return out


def is_tp_sharded(name: str) -> bool:
    """Whether a parameter is split over tensor-parallel ranks (or, for row-parallel biases, held by one)."""
    return ".attn." in name or ".mlp." in name


def _tp_slice(name: str, t: torch.Tensor, spec: ModelSpec, tp: TensorParallel) -> torch.Tensor | None:
    if tp.size == 1:
        return t
    h = spec.hidden
    if name.startswith("attn.qkv"):  # rows are [q | k | v]; keep this rank's heads of each
        return t.view(3, h, *t.shape[1:])[:, tp.split(h)].reshape(-1, *t.shape[1:])
    if name == "mlp.fc.weight" or name == "mlp.fc.bias":
        return t[tp.split(spec.ffn_hidden)]
    if name.endswith("proj.bias"):
        return t if tp.rank == 0 else None
    if name == "attn.proj.weight":
        return t[:, tp.split(h)]
    if name == "mlp.proj.weight":
        return t[:, tp.split(spec.ffn_hidden)]
    return t  # layer norms are whole on every rank
