"""Random training windows read from token files in object storage (nanoGPT-style sampling), and
each step's share of them by replica."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from frenzy_prefect.spec.dataset import DatasetInfo
from frenzy_prefect.spec.plan import TrainingJob
from frenzy_prefect.storage import filesystem, reaching


class TokenWindows:
    """Samples (input, target) windows of ``seq_len`` tokens, uniformly over a profiled dataset.

    A prepared dataset's windows each lie within one shard (none spans two), drawn uniformly over
    every window any shard holds; a single token file is the one-shard case, sampled as before.
    Reads go through fsspec's mmap block cache, so a large remote file is fetched block by
    block as windows touch it and never held whole in memory; a shard is opened when first read.
    """

    def __init__(self, dataset: DatasetInfo, seq_len: int):
        self.dataset, self.seq_len = dataset, seq_len
        # Window starts available in each file, cumulated: a global start indexes into them.
        self._ends = np.cumsum([max(0, f.tokens - seq_len) for f in dataset.files])
        self._files: dict[int, Any] = {}
        self._open(0)  # now, so that an unreadable dataset fails where the ranks open it together

    def _open(self, index: int) -> Any:
        """File ``index``, opened (a HEAD) the first time it is read."""
        if index not in self._files:
            uri = self.dataset.files[index].uri
            fs, path = filesystem(uri)
            with reaching(uri):
                self._files[index] = fs.open(path, "rb", cache_type="mmap")
        return self._files[index]

    def _window(self, start: int) -> np.ndarray:
        index = int(np.searchsorted(self._ends, start, side="right"))
        offset = start - (int(self._ends[index - 1]) if index else 0)
        itemsize = self.dataset.dtype.itemsize
        with reaching(self.dataset.files[index].uri):
            file = self._open(index)
            file.seek(offset * itemsize)
            raw = file.read((self.seq_len + 1) * itemsize)
        return np.frombuffer(raw, dtype=self.dataset.dtype).astype(np.int64)

    def starts(self, generator: torch.Generator, count: int) -> list[int]:
        """``count`` window starts, uniform over every window the files hold."""
        return torch.randint(0, int(self._ends[-1]), (count,), generator=generator).tolist()

    def windows(self, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the windows at ``starts``, each (len(starts), seq_len)."""
        windows = torch.from_numpy(np.stack([self._window(s) for s in starts]))
        return windows[:, :-1], windows[:, 1:]

    def batch(self, generator: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.windows(self.starts(generator, size))

    def close(self) -> None:
        for file in self._files.values():
            file.close()


def step_seed(seed: int, step: int) -> int:
    return seed * 1_000_003 + step


def replica_batches(job: TrainingJob, data: TokenWindows, replica: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Data-parallel replica ``replica``'s micro-batches of optimizer step ``step``. The step's
    global batch is a function of (seed, step) alone, and replica r takes its r-th share of it in
    order: any plan (dp, micro-batch) trains on the same sequences at the same step, and a resumed
    run (on this plan or another) on what the uninterrupted one would have."""
    request, plan = job.request, job.allocation.plan
    starts = data.starts(torch.Generator().manual_seed(step_seed(request.seed, step)), request.global_batch)
    counts = plan.replica_accumulation(request.global_batch)
    first, share = sum(counts[:replica]) * plan.micro_batch, counts[replica] * plan.micro_batch
    mine = starts[first : first + share]
    return [data.windows(mine[i : i + plan.micro_batch]) for i in range(0, share, plan.micro_batch)]


def step_batches(job: TrainingJob, data: TokenWindows, rank: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s micro-batches of step ``step`` (its replica's)."""
    return replica_batches(job, data, job.allocation.plan.coordinates(rank)[1], step)
