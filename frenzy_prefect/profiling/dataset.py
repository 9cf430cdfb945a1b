"""What a dataset URI holds, checked once before any rank starts: a token file (*.txt, *.bin) or a
prepared dataset (its manifest.json, or the folder holding it). Every file's size must be a whole
number of ids (a prepared shard's, the number its manifest says), and a sample of the ids must
lie within the model's vocabulary (``token_sample``)."""

from __future__ import annotations

import numpy as np

from frenzy_prefect.errors import DatasetError
from frenzy_prefect.profiling.token_sample import check_token_ids
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
    itemsize = np.dtype(TOKEN_DTYPES[fmt]).itemsize
    if size % itemsize:
        raise DatasetError(
            f"dataset {uri} is {size:,} bytes, not a whole number of {fmt} token ids ({itemsize} bytes each): "
            f"a *.bin holds {fmt} ids, so its size is a multiple of {itemsize} (a truncated file, or ids of another dtype?)"
        )
    tokens = size // itemsize
    if tokens < seq_len + 1:
        raise DatasetError(f"dataset {uri} holds {tokens} tokens; seq_len {seq_len} needs at least {seq_len + 1}")
    if fmt == "bytes" and vocab_size < 256:
        raise DatasetError(f"dataset {uri} is byte-level text (token ids up to 255) but the model's vocab_size is {vocab_size}")
    info = DatasetInfo(uri=uri, format=fmt, tokens=tokens, size_bytes=size)
    if fmt != "bytes":  # (bytes are below 256, checked above)
        check_token_ids(info.files, info.dtype, vocab_size)
    return info


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
    info = DatasetInfo(
        uri=uri,
        format=manifest.format,
        tokens=manifest.tokens,
        size_bytes=manifest.tokens * np.dtype(TOKEN_DTYPES[manifest.format]).itemsize,
        shards=tuple(TokenFile(uri=f"{folder}/{s.name}", tokens=s.tokens) for s in manifest.shards),
    )
    _check_shard_sizes(info)
    check_token_ids(info.files, info.dtype, vocab_size)
    return info


def _check_shard_sizes(info: DatasetInfo) -> None:
    """Every shard of a prepared dataset exists and holds the tokens its manifest says (one listing)."""
    fs, folder = filesystem(info.uri.rsplit("/", 1)[0])
    with reaching(info.uri):
        sizes = {entry["name"].rstrip("/").rsplit("/", 1)[-1]: int(entry["size"]) for entry in fs.ls(folder, detail=True, refresh=True)}
    for shard in info.shards:
        name, expected = shard.uri.rsplit("/", 1)[-1], shard.tokens * info.dtype.itemsize
        if name not in sizes:
            raise DatasetError(f"dataset {info.uri}: its shard {shard.uri} does not exist (prepare the dataset again)")
        if sizes[name] != expected:
            raise DatasetError(
                f"dataset {info.uri}: its shard {shard.uri} is {sizes[name]:,} bytes, not the {expected:,} of the "
                f"{shard.tokens:,} {info.format} ids its manifest says (prepare the dataset again)"
            )
