"""ModelSpec from a preset name, an HF-style config.json (path or URI), or an inline mapping."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from frenzy_prefect.errors import FrenzyError, describe_validation_error
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.storage import open_uri


def _preset(name: str, layers: int, hidden: int, heads: int, vocab: int, seq: int) -> ModelSpec:
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, vocab_size=vocab, max_seq_len=seq)


# Byte-level presets (vocab 256) train on raw UTF-8 text; the others use GPT-2's BPE vocabulary.
PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _preset("gpt-nano", 4, 128, 4, 256, 256),
        _preset("gpt-micro", 6, 256, 8, 256, 512),
        _preset("gpt2-small", 12, 768, 12, 50257, 1024),
        _preset("gpt2-medium", 24, 1024, 16, 50257, 1024),
        _preset("gpt2-large", 36, 1280, 20, 50257, 1024),
        _preset("gpt2-xl", 48, 1600, 25, 50257, 1024),
        _preset("gpt3-6.7b", 32, 4096, 32, 50257, 2048),
        _preset("gpt3-13b", 40, 5120, 40, 50257, 2048),
    )
}

# HF config keys (GPT-2 names first, then the generic ones) -> ModelSpec fields.
_HF_KEYS: dict[str, tuple[str, ...]] = {
    "layers": ("n_layer", "num_hidden_layers"),
    "hidden": ("n_embd", "hidden_size"),
    "heads": ("n_head", "num_attention_heads"),
    "vocab_size": ("vocab_size",),
    "max_seq_len": ("n_positions", "max_position_embeddings"),
    "ffn_hidden": ("n_inner", "intermediate_size"),
    "tied_embeddings": ("tie_word_embeddings",),
    "vocab_multiple": ("make_vocab_size_divisible_by",),
}
_REQUIRED = ("layers", "hidden", "heads", "vocab_size", "max_seq_len")


def _unmodelled(config: dict[str, Any]) -> list[str]:
    """What a config asks for that ModelSpec (a GPT-2-style block: learned positions, LayerNorm,
    GELU MLP, multi-head attention) does not model; each would silently misread the parameters
    and memory (Llama-2-7B reads as 5.3 B parameters instead of 6.7 B)."""
    heads = config.get("num_attention_heads") or config.get("n_head")
    kv_heads = config.get("num_key_value_heads")
    found = []
    if kv_heads is not None and kv_heads != heads:
        found.append(f"grouped-query attention (num_key_value_heads={kv_heads} of {heads} heads)")
    if str(config.get("hidden_act", "")).lower() in {"silu", "swish", "swiglu"}:
        found.append(f"a gated MLP (hidden_act={config['hidden_act']!r})")
    if config.get("rms_norm_eps") is not None:
        found.append("RMSNorm (rms_norm_eps)")
    if config.get("rope_theta") is not None or config.get("rope_scaling") is not None:
        found.append("rotary position embeddings (rope_theta), no learned position table")
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if config.get(key):
            found.append(f"a mixture of experts ({key}={config[key]})")
    if config.get("sliding_window"):
        found.append(f"sliding-window attention (sliding_window={config['sliding_window']})")
    return found


def from_hf_config(config: dict[str, Any], name: str = "config") -> ModelSpec:
    if unmodelled := _unmodelled(config):
        raise FrenzyError(
            f"model config {name} uses {'; '.join(unmodelled)}, which frenzy does not model yet: its parameters and memory "
            "would be misread. Supported: GPT-2-style configs (learned positions, LayerNorm, GELU MLP, multi-head attention)"
        )
    fields: dict[str, Any] = {"name": str(config.get("_name_or_path") or config.get("model_type") or name)}
    for field, keys in _HF_KEYS.items():
        for key in keys:
            if config.get(key) is not None:
                fields[field] = config[key]
                break
    missing = [" or ".join(_HF_KEYS[f]) for f in _REQUIRED if f not in fields]
    if missing:
        raise FrenzyError(f"model config {name} lacks {', '.join(missing)}")
    try:
        return ModelSpec.model_validate(fields)
    except ValidationError as exc:
        raise FrenzyError(f"model config {name}: {describe_validation_error(exc)}") from None


def resolve_model(model: str | dict[str, Any], seq_len: int | None = None) -> ModelSpec:
    """The model of a request: a preset name, a config.json path/URI, or an inline HF-style
    mapping; checked against the sequence length it will train on, when given."""
    spec = _load(model)
    if seq_len is not None and seq_len > spec.max_seq_len:
        raise FrenzyError(f"seq_len ({seq_len}) exceeds the model's max_seq_len ({spec.max_seq_len})")
    return spec


def _load(model: str | dict[str, Any]) -> ModelSpec:
    if isinstance(model, dict):
        return from_hf_config(model, name="inline config")
    if model in PRESETS:
        return PRESETS[model]
    if not model.endswith(".json"):
        raise FrenzyError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a path to an HF-style config.json")
    try:
        with open_uri(model, "r") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise FrenzyError(f"model config {model} does not exist") from None
    except json.JSONDecodeError as exc:
        raise FrenzyError(f"model config {model} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise FrenzyError(f"model config {model} must be a JSON object")
    return from_hf_config(config, name=model)
