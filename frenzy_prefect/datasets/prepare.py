"""Raw text under a prefix -> token shards and a manifest, at most once per content.

The output goes to ``<root>/<content hash>/`` (root: ``<prefix>/../frenzy-prepared`` unless the
preparation names one): ``tokenizer.json``, ``shard-00000.bin`` ... (flat arrays of uint16 ids
when the vocabulary fits, else uint32; documents in file order, each followed by the end-of-text
token, cut into shards of ``shard_tokens``), then ``manifest.json``, written last: a manifest that
exists means a complete preparation. The content hash covers every raw file's path, size and
version (ETag), the tokenizer's identity and the options, so preparing the same data again
finds the manifest and does no work, and any change prepares afresh. Two preparations of the
same content at once write the same objects; the manifest is still written after all shards.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator

import numpy as np
from pydantic import BaseModel, Field
from tokenizers import Tokenizer

from frenzy_prefect.datasets import tokenizer as tokenizers_
from frenzy_prefect.datasets.sources import Listing, list_sources, pieces
from frenzy_prefect.errors import DatasetError
from frenzy_prefect.profiling.dataset import read_manifest
from frenzy_prefect.spec.dataset import MANIFEST, Manifest, Preparation, ShardEntry, ShardFormat
from frenzy_prefect.storage import exists, write_bytes

VERSION = 1  # of the shard layout: part of the content hash, so a change never reuses old shards
# Pieces of text tokenised per call (in parallel, by the tokenizers library), and at most about
# this much text held at once (a plain-text file's pieces are up to 1 MiB each).
ENCODE_BATCH = 256
ENCODE_CHARS = 2**24


class Prepared(BaseModel):
    manifest_uri: str
    manifest: Manifest
    cached: bool = Field(description="Found complete: nothing was read or written but the listing, the tokenizer and the manifest.")


def for_model(options: Preparation | None, vocab_size: int) -> Preparation:
    """``options`` (default: all defaults) with a BPE trained on the data sized to the model's vocabulary unless set."""
    options = options or Preparation()
    return options.model_copy(update={"vocab_size": vocab_size}) if options.tokenizer is None and options.vocab_size is None else options


def default_root(source: str) -> str:
    """``<prefix>/../frenzy-prepared``: beside the raw data, not under it (at a bucket's root, under it)."""
    base = source.rstrip("/")
    below_bucket = "/" in base.partition("://")[2] if "://" in base else "/" in base
    return f"{base.rsplit('/', 1)[0] if below_bucket else base}/frenzy-prepared"


def content_hash(listing: Listing, tokenizer_identity: str, options: Preparation) -> str:
    described = {
        "version": VERSION,
        "files": [f.model_dump() for f in listing.files],
        "tokenizer": tokenizer_identity,
        "options": options.model_dump(include={"text_field", "eos_token", "shard_tokens"}),
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:20]


def shard_format(vocab_size: int) -> ShardFormat:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def prepare(source: str, options: Preparation) -> Prepared:
    """Prepare the raw files under ``source`` (or find them prepared) with ``options``."""
    if options.tokenizer is None and options.vocab_size is None:
        raise DatasetError(f"preparing {source} with a BPE trained on the data needs its vocab_size (or a tokenizer URI)")
    listing = list_sources(source)
    tokenizer, identity = tokenizers_.load(options.tokenizer) if options.tokenizer else (None, tokenizers_.bpe_identity(options.vocab_size))
    digest = content_hash(listing, identity, options)
    folder = f"{(options.output or default_root(source)).rstrip('/')}/{digest}"
    manifest_uri = f"{folder}/{MANIFEST}"
    if exists(manifest_uri):
        return Prepared(manifest_uri=manifest_uri, manifest=read_manifest(manifest_uri), cached=True)
    if tokenizer is None:
        tokenizer = tokenizers_.train_bpe((text for text, _ in _all_pieces(listing, options)), options.vocab_size)
    eos = tokenizers_.eos_id(tokenizer, options.eos_token)
    vocab = tokenizers_.vocab_size(tokenizer)
    fmt = shard_format(vocab)
    write_bytes(f"{folder}/tokenizer.json", tokenizer.to_str().encode())
    shards = _Shards(folder, np.dtype(fmt), options.shard_tokens)
    documents = 0
    for ids, ends in _encoded(tokenizer, _all_pieces(listing, options)):
        shards.add(np.append(ids, eos) if ends else ids)
        documents += ends
    entries = shards.close()
    if not entries:
        raise DatasetError(f"raw dataset {source} holds no text to prepare")
    manifest = Manifest(
        source=source,
        content_hash=digest,
        format=fmt,
        vocab_size=vocab,
        eos_id=eos,
        tokenizer="tokenizer.json",
        documents=documents,
        tokens=sum(e.tokens for e in entries),
        shards=tuple(entries),
        files=listing.files,
    )
    write_bytes(manifest_uri, manifest.model_dump_json(indent=2).encode())
    return Prepared(manifest_uri=manifest_uri, manifest=manifest, cached=False)


def _all_pieces(listing: Listing, options: Preparation) -> Iterator[tuple[str, bool]]:
    for file in listing.files:
        yield from pieces(listing.uri(file), options.text_field)


def _encoded(tokenizer: Tokenizer, texts: Iterator[tuple[str, bool]]) -> Iterator[tuple[np.ndarray, bool]]:
    """Each piece's ids (no special tokens added), tokenised a batch at a time."""
    batch: list[tuple[str, bool]] = []
    chars = 0
    for piece in texts:
        batch.append(piece)
        chars += len(piece[0])
        if len(batch) == ENCODE_BATCH or chars >= ENCODE_CHARS:
            yield from _encode(tokenizer, batch)
            batch, chars = [], 0
    yield from _encode(tokenizer, batch)


def _encode(tokenizer: Tokenizer, batch: list[tuple[str, bool]]) -> Iterator[tuple[np.ndarray, bool]]:
    if batch:
        encodings = tokenizer.encode_batch([text for text, _ in batch], add_special_tokens=False)
        yield from ((np.asarray(e.ids, dtype=np.int64), ends) for e, (_, ends) in zip(encodings, batch, strict=True))


class _Shards:
    """Token ids in, shard files of ``size`` tokens out (one PUT each), the last with the rest."""

    def __init__(self, folder: str, dtype: np.dtype, size: int):
        self.folder, self.dtype, self.size = folder, dtype, size
        self.pending: list[np.ndarray] = []
        self.count = 0
        self.written: list[ShardEntry] = []

    def add(self, ids: np.ndarray) -> None:
        self.pending.append(ids.astype(self.dtype))
        self.count += len(ids)
        if self.count < self.size:
            return
        joined = np.concatenate(self.pending)
        full = len(joined) // self.size * self.size
        for start in range(0, full, self.size):
            self._write(joined[start : start + self.size])
        self.pending, self.count = [joined[full:]], len(joined) - full

    def close(self) -> list[ShardEntry]:
        if self.count:
            self._write(np.concatenate(self.pending))
        return self.written

    def _write(self, ids: np.ndarray) -> None:
        name = f"shard-{len(self.written):05d}.bin"
        write_bytes(f"{self.folder}/{name}", ids.tobytes())
        self.written.append(ShardEntry(name=name, tokens=len(ids)))
