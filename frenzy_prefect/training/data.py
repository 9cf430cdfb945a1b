"""Random training windows read from a token file in object storage (nanoGPT-style sampling)."""

from __future__ import annotations

import numpy as np
import torch

from frenzy_prefect.errors import DatasetError
from frenzy_prefect.profiling.dataset import token_dtype
from frenzy_prefect.storage import filesystem, reaching


class TokenWindows:
    """Samples (input, target) windows of ``seq_len`` tokens, uniformly over the file.

    Reads go through fsspec's mmap block cache, so a large remote file is fetched block by
    block as windows touch it and never held whole in memory.
    """

    def __init__(self, uri: str, seq_len: int):
        self.uri, self.seq_len = uri, seq_len
        _, self.dtype = token_dtype(uri)
        self.itemsize = np.dtype(self.dtype).itemsize
        fs, path = filesystem(uri)
        try:
            with reaching(uri):
                self.tokens = int(fs.info(path)["size"]) // self.itemsize
                self._file = fs.open(path, "rb", cache_type="mmap")
        except FileNotFoundError:
            raise DatasetError(f"dataset {uri} does not exist") from None
        if self.tokens < seq_len + 1:
            raise DatasetError(f"dataset {uri} holds {self.tokens} tokens; seq_len {seq_len} needs {seq_len + 1}")

    def _window(self, start: int) -> np.ndarray:
        self._file.seek(start * self.itemsize)
        raw = self._file.read((self.seq_len + 1) * self.itemsize)
        return np.frombuffer(raw, dtype=self.dtype).astype(np.int64)

    def batch(self, generator: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, self.tokens - self.seq_len, (size,), generator=generator).tolist()
        with reaching(self.uri):
            windows = torch.from_numpy(np.stack([self._window(s) for s in starts]))
        return windows[:, :-1], windows[:, 1:]

    def close(self) -> None:
        self._file.close()
