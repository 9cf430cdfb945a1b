"""Helpers shared by the tests of datasets."""

from __future__ import annotations

from frenzy_prefect.storage import filesystem
from tests.support.stack import sentences


def put(uri: str, data: bytes) -> None:
    fs, path = filesystem(uri)
    fs.pipe_file(path, data)


def texts(n: int, seed: int) -> list[str]:
    return [sentences(300 + 40 * (i % 5), seed=seed + i).decode() for i in range(n)]


TINY_BPE_MODEL = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 384, "n_positions": 64}
