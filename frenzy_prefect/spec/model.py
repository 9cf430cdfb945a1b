"""The shape of a decoder-only transformer: everything the memory model and the trainer need."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

Norm = Literal["layernorm", "rmsnorm"]
Mlp = Literal["gelu", "swiglu"]
Position = Literal["learned", "rope"]


class ModelSpec(BaseModel):
    """A pre-norm decoder: the GPT-2 family (learned positions, LayerNorm, GELU MLP, biases) by
    default, or the Llama family (rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention,
    no biases), or any mix of the two that a config describes.

    Field names follow Megatron's symbols: l layers, h hidden, a heads, V vocabulary (padded:
    ``padded_vocab``); ``kv_heads`` are Megatron's query groups.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Preset name or where the config came from.")
    layers: PositiveInt
    hidden: PositiveInt
    heads: PositiveInt
    kv_heads: PositiveInt = Field(description="Key/value heads (grouped-query attention); defaults to heads.")
    vocab_size: PositiveInt
    max_seq_len: PositiveInt = Field(description="The longest sequence; with learned positions, the rows of their table.")
    ffn_hidden: PositiveInt = Field(description="MLP width (each of SwiGLU's gate and up projections); defaults to 4 * hidden.")
    norm: Norm = "layernorm"
    mlp: Mlp = "gelu"
    position: Position = "learned"
    qkv_bias: bool = True
    out_bias: bool = Field(default=True, description="A bias on the attention's output projection.")
    mlp_bias: bool = True
    tied_embeddings: bool = True
    attention_dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="Dropout on the attention probabilities.")
    hidden_dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="Dropout on the embeddings and each residual branch.")
    vocab_multiple: PositiveInt = Field(
        default=1,
        description="Pad the embedding and head to a multiple of this many rows (Megatron's make_vocab_size_divisible_by).",
    )

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if not data.get("ffn_hidden") and isinstance(data.get("hidden"), int):
                data = {**data, "ffn_hidden": 4 * data["hidden"]}
            if not data.get("kv_heads") and data.get("heads"):
                data = {**data, "kv_heads": data["heads"]}
        return data

    @model_validator(mode="after")
    def _check_shape(self) -> ModelSpec:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads}); accepted head counts divide {self.hidden}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads}); accepted kv_heads divide {self.heads}"
            )
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        """Width of the key (and of the value) projection: kv_heads * head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding and the head: the vocabulary padded to ``vocab_multiple``."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def norm_parameters(self) -> int:
        """One normalisation: a scale (RMSNorm), or a scale and a shift (LayerNorm)."""
        return self.hidden if self.norm == "rmsnorm" else 2 * self.hidden

    @property
    def attention_parameters(self) -> int:
        """Q, K and V (K and V over kv_heads) and the output projection, with their biases."""
        h, kv = self.hidden, self.kv_width
        return h * (h + 2 * kv) + h * h + (h + 2 * kv if self.qkv_bias else 0) + (h if self.out_bias else 0)

    @property
    def mlp_parameters(self) -> int:
        """GELU: up and down projections; SwiGLU: gate, up and down."""
        h, f = self.hidden, self.ffn_hidden
        inputs = 2 if self.mlp == "swiglu" else 1
        return (inputs + 1) * h * f + ((inputs * f + h) if self.mlp_bias else 0)

    @property
    def layer_parameters(self) -> int:
        """One transformer block: two norms, attention and MLP (GPT-2: 12h^2 + 13h)."""
        return 2 * self.norm_parameters + self.attention_parameters + self.mlp_parameters

    @property
    def embedding_parameters(self) -> int:
        """Token embeddings, and the position table when positions are learned (the first pipeline stage)."""
        return (self.padded_vocab + (self.max_seq_len if self.position == "learned" else 0)) * self.hidden

    @property
    def head_parameters(self) -> int:
        """Final norm plus an untied output projection (the last pipeline stage)."""
        return self.norm_parameters + (0 if self.tied_embeddings else self.padded_vocab * self.hidden)

    @property
    def parameters(self) -> int:
        """Exact parameter count; for GPT-2 with ffn = 4h it is Frenzy's W = V*h + l*(12h^2 + 13h) plus positions and the final norm."""
        return self.embedding_parameters + self.layers * self.layer_parameters + self.head_parameters
