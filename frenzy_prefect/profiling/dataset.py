"""What a dataset URI holds: its token format and size, checked before any rank starts."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, PositiveInt

from frenzy_prefect.errors import DatasetError
from frenzy_prefect.storage import filesystem, reaching

TokenFormat = Literal["bytes", "uint16"]

# By suffix: raw UTF-8 text is a byte-level tokenisation (ids 0-255); *.bin holds uint16 ids
# (nanoGPT's format, e.g. GPT-2 BPE produced offline).
TOKEN_FORMATS: dict[str, tuple[TokenFormat, type[np.generic]]] = {
    ".txt": ("bytes", np.uint8),
    ".bin": ("uint16", np.uint16),
}


class DatasetInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    uri: str
    format: TokenFormat
    tokens: PositiveInt
    size_bytes: PositiveInt


def token_dtype(uri: str) -> tuple[TokenFormat, type[np.generic]]:
    for suffix, fmt in TOKEN_FORMATS.items():
        if uri.endswith(suffix):
            return fmt
    raise DatasetError(
        f"dataset {uri} has an unknown format; accepted: "
        + ", ".join(f"*{s} ({f})" for s, (f, _) in TOKEN_FORMATS.items())
    )


def profile_dataset(uri: str, seq_len: int, vocab_size: int) -> DatasetInfo:
    fmt, dtype = token_dtype(uri)
    fs, path = filesystem(uri)
    try:
        with reaching(uri):
            size = int(fs.info(path)["size"])
    except FileNotFoundError:
        raise DatasetError(f"dataset {uri} does not exist") from None
    tokens = size // np.dtype(dtype).itemsize
    if tokens < seq_len + 1:
        raise DatasetError(f"dataset {uri} holds {tokens} tokens; seq_len {seq_len} needs at least {seq_len + 1}")
    if fmt == "bytes" and vocab_size < 256:
        raise DatasetError(f"dataset {uri} is byte-level text (token ids up to 255) but the model's vocab_size is {vocab_size}")
    return DatasetInfo(uri=uri, format=fmt, tokens=tokens, size_bytes=size)
