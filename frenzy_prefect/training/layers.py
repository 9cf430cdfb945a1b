"""The parts of one decoder block, for the GPT-2 and the Llama families alike: normalisation
(LayerNorm or RMSNorm), rotary position embeddings, causal self-attention (fused or eager, with
grouped-query attention), the MLP (GELU or SwiGLU) and dropout. Shapes: B batch, T sequence,
C hidden, H query heads, K key/value heads, D head width.

What each keeps for its backward is what the memory model (``memory/analytic.py``) counts, so
the choices that decide memory are stated where they are made.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import Recompute
from frenzy_prefect.spec.request import Attention
from frenzy_prefect.training.tensor_parallel import TensorParallel

ROPE_THETA = 10_000.0  # Llama 2's base; the base changes the angles, not the memory


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout through ``native_dropout`` on every device, so the mask kept for the backward is a
    bool tensor (one byte per element) on CPU as on CUDA (``F.dropout`` keeps a mask of the input's
    dtype on CPU). Identity when not training or p = 0."""
    if not training or p == 0:
        return x
    return torch.native_dropout(x, p, True)[0]


def norm(spec: ModelSpec) -> nn.Module:
    """LayerNorm (scale and shift) or RMSNorm (scale), torch's own."""
    return nn.RMSNorm(spec.hidden, eps=1e-5) if spec.norm == "rmsnorm" else nn.LayerNorm(spec.hidden)


class Positions(NamedTuple):
    """What every block of a stage shares for one micro-batch, made once per forward: the rotary
    tables (T, D) in the compute dtype, and eager attention's causal mask (T, T) of bools."""

    rope: tuple[torch.Tensor, torch.Tensor] | None
    mask: torch.Tensor | None


def positions(spec: ModelSpec, attention: Attention, seq_len: int, device: torch.device, dtype: torch.dtype = torch.float32) -> Positions:
    rope = None
    if spec.position == "rope":
        d = spec.head_dim
        inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
        angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # (T, D), HF's rotate-half layout
        # In the dtype q and k have (autocast's, or the hidden states' ``dtype``), so rotating them keeps their dtype.
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else dtype
        rope = (angles.cos().to(dtype), angles.sin().to(dtype))
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1) if attention == "eager" else None
    return Positions(rope, mask)


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotary embedding of (B, heads, T, D): x * cos + rotate_half(x) * sin. Its multiplications
    keep only the shared tables for the backward; the result is a new tensor."""
    cos, sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, mask: torch.Tensor | None) -> torch.Tensor:
    """torch's fused SDPA: keeps q, k, v, its output and the log-sum-exp, never the scores. With
    fewer key/value heads it is told so (``enable_gqa``) rather than given expanded copies, so
    K and V stay kv_heads wide. (On CPU, dropout makes SDPA fall back to its math kernel.)"""
    return F.scaled_dot_product_attention(q, k, v, None, dropout_p, True, enable_gqa=k.shape[1] != q.shape[1])


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention as Hugging Face's ``eager_attention_forward``: K and V expanded to every query head
    (``repeat_kv``), scores = q k^T / sqrt(D), the causal mask, softmax in fp32 (its output kept),
    cast back to q's dtype, dropout on the probabilities (a bool mask kept), then probs @ v."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * (1.0 / math.sqrt(q.shape[-1]))
    scores = scores.masked_fill(mask, float("-inf"))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(dropout(probs, dropout_p, dropout_p > 0), v)


class CausalSelfAttention(nn.Module):
    """Fused QKV (rows [q | k | v], k and v kv_heads wide), column-parallel over this rank's query
    and key/value heads; the output projection row-parallel, its bias added once (tp rank 0)."""

    def __init__(self, spec: ModelSpec, attention: Attention, recompute: Recompute, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.heads, self.kv_heads, self.head_dim = spec.heads // tp.size, spec.kv_heads // tp.size, spec.head_dim
        self.width, self.kv_width = spec.hidden // tp.size, spec.kv_width // tp.size
        self.qkv = nn.Linear(spec.hidden, self.width + 2 * self.kv_width, bias=spec.qkv_bias)
        self.proj = nn.Linear(self.width, spec.hidden, bias=spec.out_bias and tp.rank == 0)
        self.core = eager_attention if attention == "eager" else flash_attention
        self.dropout_p = spec.attention_dropout
        self.recompute_core = recompute == "selective"

    def forward(self, x: torch.Tensor, shared: Positions) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(self.tp.enter(x)).split([self.width, self.kv_width, self.kv_width], dim=2)
        q = q.view(B, T, self.heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k, v = (t.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2) for t in (k, v))  # (B, K, T, D)
        if shared.rope is not None:
            q, k = rotate(q, shared.rope), rotate(k, shared.rope)
        p = self.dropout_p if self.training else 0.0
        if self.recompute_core and self.training:  # selective: recompute only the attention core
            y = checkpoint(self.core, q, k, v, p, shared.mask, use_reentrant=False)
        else:
            y = self.core(q, k, v, p, shared.mask)
        return self.tp.leave(self.proj(y.transpose(1, 2).contiguous().view(B, T, self.width)))


class MLP(nn.Module):
    """GELU: fc -> gelu -> proj. SwiGLU: fc holds gate and up (rows [gate | up]), then
    silu(gate) * up -> proj. fc column-parallel, proj row-parallel (its bias on tp rank 0)."""

    def __init__(self, spec: ModelSpec, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.swiglu = spec.mlp == "swiglu"
        width = spec.ffn_hidden // tp.size
        self.fc = nn.Linear(spec.hidden, (2 if self.swiglu else 1) * width, bias=spec.mlp_bias)
        self.proj = nn.Linear(width, spec.hidden, bias=spec.mlp_bias and tp.rank == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(self.tp.enter(x))
        if self.swiglu:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        else:
            x = F.gelu(x, approximate="tanh")
        return self.tp.leave(self.proj(x))


class Block(nn.Module):
    """Pre-norm block; hidden dropout on each residual branch."""

    def __init__(self, spec: ModelSpec, attention: Attention, recompute: Recompute, tp: TensorParallel):
        super().__init__()
        self.ln1 = norm(spec)
        self.attn = CausalSelfAttention(spec, attention, recompute, tp)
        self.ln2 = norm(spec)
        self.mlp = MLP(spec, tp)
        self.dropout_p = spec.hidden_dropout

    def forward(self, x: torch.Tensor, shared: Positions) -> torch.Tensor:
        x = x + dropout(self.attn(self.ln1(x), shared), self.dropout_p, self.training)
        return x + dropout(self.mlp(self.ln2(x)), self.dropout_p, self.training)
