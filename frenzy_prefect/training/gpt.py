"""A GPT-2 style decoder in one readable file (after nanoGPT's model.py), built from a ModelSpec.

Shapes: B batch, T sequence, C hidden, H heads, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import Recompute


class CausalSelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec, recompute: Recompute):
        super().__init__()
        self.heads = spec.heads
        self.qkv = nn.Linear(spec.hidden, 3 * spec.hidden)
        self.proj = nn.Linear(spec.hidden, spec.hidden)
        self.recompute_core = recompute == "selective"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, H, T, C/H)
        if self.recompute_core and self.training:  # selective: recompute only the attention core
            y = checkpoint(F.scaled_dot_product_attention, q, k, v, None, 0.0, True, use_reentrant=False)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.fc = nn.Linear(spec.hidden, spec.ffn_hidden)
        self.proj = nn.Linear(spec.ffn_hidden, spec.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, recompute: Recompute):
        super().__init__()
        self.ln1 = nn.LayerNorm(spec.hidden)
        self.attn = CausalSelfAttention(spec, recompute)
        self.ln2 = nn.LayerNorm(spec.hidden)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, spec: ModelSpec, recompute: Recompute = "none"):
        super().__init__()
        self.spec = spec
        self.recompute_blocks = recompute == "full"
        self.tok_emb = nn.Embedding(spec.vocab_size, spec.hidden)
        self.pos_emb = nn.Embedding(spec.max_seq_len, spec.hidden)
        self.blocks = nn.ModuleList(Block(spec, recompute) for _ in range(spec.layers))
        self.ln_f = nn.LayerNorm(spec.hidden)
        self.head = nn.Linear(spec.hidden, spec.vocab_size, bias=False)
        if spec.tied_embeddings:
            self.head.weight = self.tok_emb.weight
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

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V), or the mean cross-entropy when ``targets`` (B, T) are given."""
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, C)
        for block in self.blocks:
            if self.recompute_blocks and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
