"""A token dataset: where it is, how its tokens are stored, and how many there are; and how raw
text is prepared into one (options, and the manifest a preparation writes last)."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, model_validator

from frenzy_prefect.spec.names import named

TokenFormat = Literal["bytes", "uint16", "uint32"]
ShardFormat = Literal["uint16", "uint32"]

# Raw UTF-8 text is a byte-level tokenisation (ids 0-255); *.bin holds uint16 ids (nanoGPT's
# format, e.g. GPT-2 BPE produced offline).
SUFFIX_FORMATS: dict[str, TokenFormat] = {".txt": "bytes", ".bin": "uint16"}
TOKEN_DTYPES: dict[TokenFormat, type[np.generic]] = {"bytes": np.uint8, "uint16": np.uint16, "uint32": np.uint32}
MANIFEST = "manifest.json"


class TokenFile(BaseModel):
    """One file of token ids, and how many it holds."""

    model_config = ConfigDict(frozen=True)

    uri: str
    tokens: PositiveInt


class DatasetInfo(BaseModel):
    """A single token file (``uri`` is the file, ``shards`` empty) or a prepared dataset (``uri``
    is its manifest, ``shards`` its token files in order)."""

    model_config = ConfigDict(frozen=True)

    uri: str
    format: TokenFormat
    tokens: PositiveInt
    size_bytes: PositiveInt
    shards: tuple[TokenFile, ...] = ()

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(TOKEN_DTYPES[self.format])

    @property
    def files(self) -> tuple[TokenFile, ...]:
        """The token files windows are read from."""
        return self.shards or (TokenFile(uri=self.uri, tokens=self.tokens),)


RawSource = named("the URI of raw text: a prefix (or file) of *.txt, *.jsonl and *.parquet files, e.g. s3://bucket/raw/")
TokenizerUri = named("the URI of a tokenizer.json, or no value to train a BPE on the data")
TextField = named("the JSONL field or Parquet column holding the text, e.g. text")
EosToken = named("the token put after every document, e.g. <|endoftext|>, or no value for the default")
PreparedUri = named("a URI prefix, e.g. s3://bucket/prepared/, or no value for the default")


class Preparation(BaseModel):
    """How raw text (*.txt, *.jsonl, *.parquet under a prefix) becomes token shards."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokenizer: TokenizerUri | None = Field(
        default=None,
        description="URI of a Hugging Face tokenizer.json; default: a byte-level BPE trained on the data itself.",
    )
    vocab_size: PositiveInt | None = Field(
        default=None,
        description="The trained BPE's vocabulary size (with its end-of-text token); default in train-llm: the model's vocab_size.",
    )
    text_field: TextField = Field(default="text", description="The JSONL field, or Parquet column, that holds a document's text.")
    eos_token: EosToken | None = Field(
        default=None,
        description="The token put after every document; default: the first of <|endoftext|>, </s>, <|end_of_text|>, <eos>, [SEP].",
    )
    shard_tokens: PositiveInt = Field(default=2**26, description="Tokens per shard file (the last one holds the rest).")
    output: PreparedUri | None = Field(
        default=None,
        description="URI prefix the prepared dataset goes under, in <output>/<content hash>/; default: <prefix>/../frenzy-prepared.",
    )

    @model_validator(mode="after")
    def _vocab_size_is_for_a_trained_bpe(self) -> Preparation:
        if self.tokenizer is not None and self.vocab_size is not None:
            raise ValueError("vocab_size sizes a BPE trained on the data; a tokenizer.json brings its own vocabulary (set one, not both)")
        return self


class SourceFile(BaseModel):
    """A raw file as it was prepared: its path under the prefix, size and version (ETag or sha256)."""

    model_config = ConfigDict(frozen=True)

    path: str
    size: NonNegativeInt
    version: str


class ShardEntry(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    tokens: PositiveInt


class Manifest(BaseModel):
    """``manifest.json`` of a prepared dataset, written after every shard: its existence means complete."""

    model_config = ConfigDict(frozen=True)

    source: str
    content_hash: str
    format: ShardFormat
    vocab_size: PositiveInt
    eos_id: NonNegativeInt
    tokenizer: str = Field(description="The tokenizer.json used, beside the manifest.")
    documents: NonNegativeInt
    tokens: PositiveInt
    shards: tuple[ShardEntry, ...]
    files: tuple[SourceFile, ...]
