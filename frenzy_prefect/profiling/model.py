"""ModelSpec from a preset name, an HF-style config.json (path or URI), or an inline mapping."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from frenzy_prefect.errors import FrenzyError, describe_validation_error
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.names import did_you_mean
from frenzy_prefect.storage import open_uri

CONFIGS = Path(__file__).with_name("configs")  # published config.json files of real models (each names its source)


def _gpt(name: str, layers: int, hidden: int, heads: int, vocab: int, seq: int) -> ModelSpec:
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, vocab_size=vocab, max_seq_len=seq)


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int) -> ModelSpec:
    return ModelSpec(
        name=name,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        ffn_hidden=ffn,
        vocab_size=vocab,
        max_seq_len=seq,
        norm="rmsnorm",
        mlp="swiglu",
        position="rope",
        qkv_bias=False,
        out_bias=False,
        mlp_bias=False,
        tied_embeddings=False,
    )


# Byte-level presets (vocab 256) train on raw UTF-8 text on CPU; gpt-nano-bpe is gpt-nano with room
# for a small BPE trained on the data (prepare-dataset: 1024 tokens); the GPT-2 family uses GPT-2's
# BPE vocabulary; the real Llama-family models are their published config.json files.
PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _gpt("gpt-nano", 4, 128, 4, 256, 256),
        _gpt("gpt-nano-bpe", 4, 128, 4, 1024, 256),
        _gpt("gpt-micro", 6, 256, 8, 256, 512),
        _llama("llama-nano", 4, 128, 4, 2, 352, 256, 256),
        _llama("llama-micro", 6, 256, 8, 2, 688, 256, 512),
        _gpt("gpt2-small", 12, 768, 12, 50257, 1024),
        _gpt("gpt2-medium", 24, 1024, 16, 50257, 1024),
        _gpt("gpt2-large", 36, 1280, 20, 50257, 1024),
        _gpt("gpt2-xl", 48, 1600, 25, 50257, 1024),
        _gpt("gpt3-6.7b", 32, 4096, 32, 50257, 2048),
        _gpt("gpt3-13b", 40, 5120, 40, 50257, 2048),
    )
}

# The families whose config.json frenzy reads, and the keys each reads (GPT-2 names first).
GPT2_TYPES = {"gpt2"}
LLAMA_TYPES = {"llama", "mistral", "qwen2"}
_KEYS: dict[str, tuple[str, ...]] = {
    "layers": ("n_layer", "num_hidden_layers"),
    "hidden": ("n_embd", "hidden_size"),
    "heads": ("n_head", "num_attention_heads"),
    "kv_heads": ("num_key_value_heads",),
    "vocab_size": ("vocab_size",),
    "max_seq_len": ("n_positions", "max_position_embeddings"),
    "ffn_hidden": ("n_inner", "intermediate_size"),
    "tied_embeddings": ("tie_word_embeddings",),
    "vocab_multiple": ("make_vocab_size_divisible_by",),
    "attention_dropout": ("attn_pdrop", "attention_dropout"),
    "hidden_dropout": ("resid_pdrop", "hidden_dropout"),
}
_REQUIRED = ("layers", "hidden", "heads", "vocab_size", "max_seq_len")
_GELU = {"gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast"}
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_FRACTIONS = _KEYS["attention_dropout"] + _KEYS["hidden_dropout"]
# Every whole number frenzy reads from a config (the flag and the dropouts aside).
_WHOLE = (
    *(k for f, keys in _KEYS.items() if f not in ("tied_embeddings", "attention_dropout", "hidden_dropout") for k in keys),
    "head_dim",
    *_EXPERTS,
)


def _check_numbers(config: dict[str, Any], name: str) -> None:
    """Each number frenzy reads is a JSON number: a string ("64") or a fraction where a count goes
    would otherwise fail deep in the arithmetic, or be coerced without a word."""
    for key in (*_WHOLE, *_FRACTIONS):
        value = config.get(key)
        whole = key in _WHOLE
        if value is None or (type(value) is int if whole else type(value) in (int, float)):
            continue
        kind = "a whole number" if whole else "a number"
        try:
            example = int(float(value)) if whole else float(value)
        except (TypeError, ValueError):
            example = 768 if whole else 0.1
        raise FrenzyError(f'model config {name}: {key}={value!r} must be {kind}, written as a JSON number ("{key}": {example})')


def _family_fields(config: dict[str, Any], model_type: str | None) -> dict[str, Any]:
    """The block's design, which the HF families fix by model_type rather than by fields."""
    if model_type in LLAMA_TYPES:
        attention_bias = bool(config.get("attention_bias", False))
        return {
            "norm": "rmsnorm",
            "mlp": "swiglu",
            "position": "rope",
            "qkv_bias": model_type == "qwen2" or attention_bias,  # Qwen2 biases Q, K and V only
            "out_bias": attention_bias,
            "mlp_bias": bool(config.get("mlp_bias", False)),
            "tied_embeddings": bool(config.get("tie_word_embeddings", False)),  # the families' default: untied
        }
    return {}


def _refusals(config: dict[str, Any], model_type: str | None) -> list[str]:
    """What a config asks for that would change parameters or memory and frenzy does not model:
    each would be a silent misread (Llama-2-7B read GPT-2-style is 5.31 B parameters, not 6.74 B)."""
    found = [f"a mixture of experts ({key}={config[key]})" for key in _EXPERTS if config.get(key)]
    if model_type is not None and model_type not in GPT2_TYPES | LLAMA_TYPES:
        # A family frenzy does not read: what else it asks (its activation, Llama-style fields)
        # is its own design, not a misread of a supported family's config.
        return [f"model_type {model_type!r} (supported: {', '.join(sorted(GPT2_TYPES | LLAMA_TYPES))})", *found]
    act = config.get("hidden_act") or config.get("activation_function")
    expected = {"silu"} if model_type in LLAMA_TYPES else _GELU
    if act is not None and str(act).lower() not in expected:
        found.append(f"the activation {act!r} (accepted here: {', '.join(sorted(expected))})")
    heads, hidden, head_dim = config.get("num_attention_heads"), config.get("hidden_size"), config.get("head_dim")
    if head_dim is not None and heads and hidden and head_dim * heads != hidden:
        found.append(f"head_dim={head_dim} other than hidden_size / num_attention_heads ({hidden // heads})")
    if model_type not in LLAMA_TYPES:
        llama_fields = [k for k in ("rms_norm_eps", "rope_theta", "num_key_value_heads") if config.get(k) is not None]
        if llama_fields:
            found.append(f"Llama-family fields ({', '.join(llama_fields)}) without a Llama-family model_type")
    return found


def from_hf_config(config: dict[str, Any], name: str = "config") -> ModelSpec:
    """The spec of an HF config.json: GPT-2 (``model_type`` gpt2, or GPT-2-style fields without a
    model_type) or the Llama family (llama, mistral, qwen2). Sliding-window attention and RoPE
    scaling are accepted: they change which scores are computed, not what is stored."""
    _check_numbers(config, name)
    model_type = config.get("model_type")
    if refused := _refusals(config, model_type):
        raise FrenzyError(
            f"model config {name} uses {'; '.join(refused)}, which frenzy does not model: its parameters and memory would be misread. "
            f"Supported: model_type {', '.join(sorted(GPT2_TYPES | LLAMA_TYPES))} (dense decoders)"
        )
    fields: dict[str, Any] = {"name": str(config.get("_name_or_path") or model_type or name)}
    for field, keys in _KEYS.items():
        for key in keys:
            if config.get(key) is not None:
                fields[field] = config[key]
                break
    fields |= _family_fields(config, model_type)
    missing = [" or ".join(_KEYS[f]) for f in _REQUIRED if f not in fields]
    if missing:
        raise FrenzyError(f"model config {name} lacks {', '.join(missing)}")
    try:
        return ModelSpec.model_validate(fields)
    except ValidationError as exc:
        raise FrenzyError(f"model config {name}: {describe_validation_error(exc)}") from None


def _published(path: Path) -> ModelSpec:
    return from_hf_config(json.loads(path.read_text()), name=path.name).model_copy(update={"name": path.stem})


PRESETS |= {spec.name: spec for spec in map(_published, sorted(CONFIGS.glob("*.json")))}


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
    if found := [name for name in PRESETS if name.lower() == model.lower()]:  # (unique under case)
        return PRESETS[found[0]]
    if not model.endswith(".json"):
        raise FrenzyError(
            f"model {model!r} is neither a preset{did_you_mean(model, PRESETS)} nor a path to an HF-style config.json; "
            f"presets: {', '.join(PRESETS)}"
        )
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
