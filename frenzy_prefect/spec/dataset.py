"""A token dataset: where it is, how its tokens are stored, and how many there are."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, PositiveInt

TokenFormat = Literal["bytes", "uint16"]

# Raw UTF-8 text is a byte-level tokenisation (ids 0-255); *.bin holds uint16 ids (nanoGPT's
# format, e.g. GPT-2 BPE produced offline).
SUFFIX_FORMATS: dict[str, TokenFormat] = {".txt": "bytes", ".bin": "uint16"}
TOKEN_DTYPES: dict[TokenFormat, type[np.generic]] = {"bytes": np.uint8, "uint16": np.uint16}


class DatasetInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    uri: str
    format: TokenFormat
    tokens: PositiveInt
    size_bytes: PositiveInt

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(TOKEN_DTYPES[self.format])
