"""A bounded sample of a dataset's token ids, checked against the model's vocabulary before any
GPU is reserved: an id at or above vocab_size otherwise fails every rank's first step with a
bare IndexError, after the GPUs were reserved and the ranks started.

The sample is each file's head and tail, and a few blocks at seeded positions over the whole
dataset: the same bytes for a file of 1 MB or 100 GB, read with ranged GETs of all the files at
once. It finds a file of another tokenizer or dtype (its ids are wrong throughout), not a lone
wrong id somewhere; training reads the rest."""

from __future__ import annotations

import numpy as np
from fsspec.utils import merge_offset_ranges

from frenzy_prefect.errors import DatasetError
from frenzy_prefect.spec.dataset import TokenFile
from frenzy_prefect.storage import filesystem, reaching

EDGE_BYTES = 2**13  # read at the head and at the tail of every file (a prepared dataset's every shard)
BLOCK_BYTES = 2**16  # each block between
BLOCKS = 16  # blocks between, over the whole dataset (a file is drawn as often as its share of tokens)
SEED = 0  # the same sample every time a dataset is profiled


def sample_ranges(files: tuple[TokenFile, ...], itemsize: int) -> list[tuple[int, int, int]]:
    """(file index, first token, tokens) of every part of ``files`` the sample reads."""
    edge, block = EDGE_BYTES // itemsize, BLOCK_BYTES // itemsize
    ranges = []
    for index, f in enumerate(files):
        ranges += [(index, 0, min(edge, f.tokens)), (index, max(0, f.tokens - edge), min(edge, f.tokens))]
    ends = np.cumsum([f.tokens for f in files])
    for at in np.random.default_rng(SEED).integers(0, int(ends[-1]), BLOCKS):
        index = int(np.searchsorted(ends, at, side="right"))
        tokens = files[index].tokens
        offset = int(at) - (int(ends[index - 1]) if index else 0)
        ranges.append((index, min(offset, max(0, tokens - block)), min(block, tokens)))
    return ranges


def check_token_ids(files: tuple[TokenFile, ...], dtype: np.dtype, vocab_size: int) -> None:
    """Refuse ``files`` (of ``dtype`` ids) if the sample holds an id that is not below
    ``vocab_size``, naming the file, the id and its position."""
    ranges = sample_ranges(files, dtype.itemsize)
    fs, _ = filesystem(files[0].uri)
    file_paths = [filesystem(f.uri)[1] for f in files]
    by_path = dict(zip(file_paths, files, strict=True))
    paths, starts, ends = merge_offset_ranges(
        [file_paths[i] for i, _, _ in ranges],
        [first * dtype.itemsize for _, first, _ in ranges],
        [(first + tokens) * dtype.itemsize for _, first, tokens in ranges],
    )
    with reaching(files[0].uri):
        blocks = fs.cat_ranges(paths, starts, ends, on_error="raise")
    largest = max(int(np.frombuffer(raw, dtype).max(initial=0)) for raw in blocks)
    for path, start, raw in zip(paths, starts, blocks, strict=True):
        ids = np.frombuffer(raw, dtype)
        bad = np.flatnonzero(ids >= vocab_size)
        if bad.size:
            f = by_path[path]
            raise DatasetError(
                f"dataset file {f.uri}: token id {ids[bad[0]]} at position {start // dtype.itemsize + int(bad[0]):,} (of {f.tokens:,}) "
                f"is not below the model's vocab_size {vocab_size} (accepted: ids 0 to {vocab_size - 1}; the largest id sampled is "
                f"{largest}): tokenise with the model's tokenizer, or use a model whose vocab_size is above {largest}"
            )
