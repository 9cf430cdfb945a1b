"""The shape of a GPT-style decoder: everything the memory model and the trainer need."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator


class ModelSpec(BaseModel):
    """A pre-LayerNorm GPT decoder (GPT-2 family): learned positions, GELU MLP, biases.

    Field names follow Megatron's symbols: l layers, h hidden, a heads, V vocabulary (padded:
    ``padded_vocab``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Preset name or where the config came from.")
    layers: PositiveInt
    hidden: PositiveInt
    heads: PositiveInt
    vocab_size: PositiveInt
    max_seq_len: PositiveInt = Field(description="Learned position embeddings (n_positions).")
    ffn_hidden: PositiveInt = Field(description="MLP width; defaults to 4 * hidden.")
    tied_embeddings: bool = True
    vocab_multiple: PositiveInt = Field(
        default=1,
        description="Pad the embedding and head to a multiple of this many rows (Megatron's make_vocab_size_divisible_by).",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_ffn(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("ffn_hidden") and isinstance(data.get("hidden"), int):
            data = {**data, "ffn_hidden": 4 * data["hidden"]}
        return data

    @model_validator(mode="after")
    def _check_shape(self) -> ModelSpec:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads}); accepted head counts divide {self.hidden}")
        return self

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding and the head: the vocabulary padded to ``vocab_multiple``."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def layer_parameters(self) -> int:
        """One transformer block: QKV + projection (4h^2 + 4h), MLP (2hf + f + h), 2 LayerNorms (4h)."""
        h, f = self.hidden, self.ffn_hidden
        return 4 * h * h + 2 * h * f + 9 * h + f

    @property
    def embedding_parameters(self) -> int:
        """Token and position embeddings (the first pipeline stage)."""
        return (self.padded_vocab + self.max_seq_len) * self.hidden

    @property
    def head_parameters(self) -> int:
        """Final LayerNorm plus an untied output projection (the last pipeline stage)."""
        return 2 * self.hidden + (0 if self.tied_embeddings else self.padded_vocab * self.hidden)

    @property
    def parameters(self) -> int:
        """Exact parameter count; with ffn = 4h it is Frenzy's W = V*h + l*(12h^2 + 13h) plus positions and the final norm."""
        return self.embedding_parameters + self.layers * self.layer_parameters + self.head_parameters
