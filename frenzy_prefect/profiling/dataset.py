"""What a dataset URI holds, checked once before any rank starts."""

from __future__ import annotations

import numpy as np

from frenzy_prefect.errors import DatasetError
from frenzy_prefect.spec.dataset import SUFFIX_FORMATS, TOKEN_DTYPES, DatasetInfo, TokenFormat
from frenzy_prefect.storage import filesystem, reaching


def token_format(uri: str) -> TokenFormat:
    for suffix, fmt in SUFFIX_FORMATS.items():
        if uri.endswith(suffix):
            return fmt
    raise DatasetError(f"dataset {uri} has an unknown format; accepted: " + ", ".join(f"*{s} ({f})" for s, f in SUFFIX_FORMATS.items()))


def profile_dataset(uri: str, seq_len: int, vocab_size: int) -> DatasetInfo:
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
