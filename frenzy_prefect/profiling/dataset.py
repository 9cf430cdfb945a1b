"""What a dataset URI holds, checked once before any rank starts: a token file (*.txt, *.bin) or a
prepared dataset (its manifest.json, or the folder holding it)."""

from __future__ import annotations

import numpy as np

from frenzy_prefect.errors import DatasetError
from frenzy_prefect.spec.dataset import MANIFEST, SUFFIX_FORMATS, TOKEN_DTYPES, DatasetInfo, Manifest, TokenFile, TokenFormat
from frenzy_prefect.storage import exists, filesystem, open_uri, reaching


def token_format(uri: str) -> TokenFormat:
    for suffix, fmt in SUFFIX_FORMATS.items():
        if uri.endswith(suffix):
            return fmt
    raise DatasetError(
        f"dataset {uri} has an unknown format; accepted: "
        + ", ".join(f"*{s} ({f})" for s, f in SUFFIX_FORMATS.items())
        + f", a prepared dataset's {MANIFEST} or its folder (raw text: prepare it first)"
    )


def prepared_manifest(uri: str) -> str | None:
    """The manifest of the prepared dataset ``uri`` names (the manifest, or its folder), if it is one."""
    if uri.endswith(f"/{MANIFEST}"):
        return uri
    if any(uri.endswith(suffix) for suffix in SUFFIX_FORMATS):
        return None
    candidate = f"{uri.rstrip('/')}/{MANIFEST}"
    return candidate if exists(candidate) else None


def is_token_data(uri: str) -> bool:
    """Whether training can read ``uri`` as it is (a token file or a prepared dataset), or it is raw data to prepare."""
    return any(uri.endswith(suffix) for suffix in SUFFIX_FORMATS) or prepared_manifest(uri) is not None


def read_manifest(uri: str) -> Manifest:
    try:
        with open_uri(uri, "r") as f:
            return Manifest.model_validate_json(f.read())
    except FileNotFoundError:
        raise DatasetError(f"dataset {uri} does not exist") from None


def profile_dataset(uri: str, seq_len: int, vocab_size: int) -> DatasetInfo:
    manifest_uri = prepared_manifest(uri)
    if manifest_uri is not None:
        return _profile_prepared(manifest_uri, seq_len, vocab_size)
    fmt = token_format(uri)
    fs, path = filesystem(uri)
    try:
        with reaching(uri):
            size = int(fs.info(path)["size"])
    except FileNotFoundError:
        raise DatasetError(f"dataset {uri} does not exist") from None
    tokens = size // np.dtype(TOKEN_DTYPES[fmt]).itemsize
    if tokens < seq_len + 1:
        raise DatasetError(f"dataset {uri} holds {tokens} tokens; seq_len {seq_len} needs at least {seq_len + 1}")
    if fmt == "bytes" and vocab_size < 256:
        raise DatasetError(f"dataset {uri} is byte-level text (token ids up to 255) but the model's vocab_size is {vocab_size}")
    return DatasetInfo(uri=uri, format=fmt, tokens=tokens, size_bytes=size)


def _profile_prepared(uri: str, seq_len: int, vocab_size: int) -> DatasetInfo:
    manifest = read_manifest(uri)
    if manifest.vocab_size > vocab_size:
        raise DatasetError(
            f"dataset {uri} was tokenised with a vocabulary of {manifest.vocab_size} tokens but the model's vocab_size is "
            f"{vocab_size}; use a model with vocab_size >= {manifest.vocab_size} or another tokenizer"
        )
    longest = max(s.tokens for s in manifest.shards)
    if longest < seq_len + 1:
        raise DatasetError(f"dataset {uri}: its longest shard holds {longest} tokens; seq_len {seq_len} needs at least {seq_len + 1}")
    folder = uri.rsplit("/", 1)[0]
    return DatasetInfo(
        uri=uri,
        format=manifest.format,
        tokens=manifest.tokens,
        size_bytes=manifest.tokens * np.dtype(TOKEN_DTYPES[manifest.format]).itemsize,
        shards=tuple(TokenFile(uri=f"{folder}/{s.name}", tokens=s.tokens) for s in manifest.shards),
    )
