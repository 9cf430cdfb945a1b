"""Random training windows read from a token file in object storage (nanoGPT-style sampling)."""

from __future__ import annotations

import numpy as np
import torch

from frenzy_prefect.spec.dataset import DatasetInfo
from frenzy_prefect.storage import filesystem, reaching


class TokenWindows:
    """Samples (input, target) windows of ``seq_len`` tokens, uniformly over a profiled dataset.

    Reads go through fsspec's mmap block cache, so a large remote file is fetched block by
    block as windows touch it and never held whole in memory.
    """

    def __init__(self, dataset: DatasetInfo, seq_len: int):
        self.dataset, self.seq_len = dataset, seq_len
        fs, path = filesystem(dataset.uri)
        with reaching(dataset.uri):
            self._file = fs.open(path, "rb", cache_type="mmap")

    def _window(self, start: int) -> np.ndarray:
        itemsize = self.dataset.dtype.itemsize
        self._file.seek(start * itemsize)
        raw = self._file.read((self.seq_len + 1) * itemsize)
        return np.frombuffer(raw, dtype=self.dataset.dtype).astype(np.int64)

    def starts(self, generator: torch.Generator, count: int) -> list[int]:
        """``count`` window starts, uniform over the file."""
        return torch.randint(0, self.dataset.tokens - self.seq_len, (count,), generator=generator).tolist()

    def windows(self, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the windows at ``starts``, each (len(starts), seq_len)."""
        with reaching(self.dataset.uri):
            windows = torch.from_numpy(np.stack([self._window(s) for s in starts]))
        return windows[:, :-1], windows[:, 1:]

    def batch(self, generator: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.windows(self.starts(generator, size))

    def close(self) -> None:
        self._file.close()
