"""The plans the allocator searches: every (dp, tp, pp, micro-batch, ZeRO, recompute) the memory
model covers within a GPU count, from the divisors of the global batch (found by trial division
up to its square root, never by scanning 1..N), grouped by shape so that a search can be counted,
and refused with its size named, before it is run."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

from frenzy_prefect.spec.layout import tp_splits, zero_runs_with
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import ParallelPlan

RECOMPUTES = ("none", "selective", "full")
# What one search evaluates at the most: about a second of estimates on one quiet core (some
# 70 us a plan). Powers of two stay below it (gpt2-small, global batch 4096, fp32, on the three
# types of examples/clusters/three-types-64.yaml: 6,381 plans); a batch with many divisors on
# many GPUs may not (5040 there, bf16: 13,416), and is refused with its size named.
MAX_PLANS = 10_000


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending: the pairs (d, n / d) for d up to the square root."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def tp_degrees(model: ModelSpec, node_gpus: int) -> list[int]:
    """Tensor parallelism inside one node, splitting heads, key/value heads, hidden and ffn evenly."""
    return [t for t in divisors(min(node_gpus, model.heads)) if tp_splits(model, t)]


def pp_depths(model: ModelSpec) -> list[int]:
    """Pipeline depths in powers of two, up to the layers."""
    return [1 << k for k in range(model.layers.bit_length()) if 1 << k <= model.layers]


class Shape(NamedTuple):
    """The plans of one (dp, tp, pp): each micro-batch, with each ZeRO stage, with each recomputation."""

    dp: int
    tp: int
    pp: int
    micro_batches: tuple[int, ...]
    zeros: tuple[int, ...]
    recomputes: tuple[str, ...] = RECOMPUTES

    @property
    def size(self) -> int:
        return len(self.micro_batches) * len(self.zeros) * len(self.recomputes)

    def plans(self) -> Iterator[ParallelPlan]:
        # Validated: pydantic 2.14 validates a plan faster than model_construct builds one.
        for micro_batch in self.micro_batches:
            for zero in self.zeros:
                for recompute in self.recomputes:
                    yield ParallelPlan(dp=self.dp, tp=self.tp, pp=self.pp, micro_batch=micro_batch, zero=zero, recompute=recompute)


def shapes(model: ModelSpec, global_batch: int, max_gpus: int, node_gpus: int) -> Iterator[Shape]:
    """The plan space by (dp, tp, pp), within ``max_gpus``: ZeRO-1 with any of them, ZeRO-2
    without pipelines, ZeRO-3 over data parallelism alone; micro-batches dividing the replica's share."""
    tps, pps, batch_divisors = tp_degrees(model, node_gpus), pp_depths(model), divisors(global_batch)
    for dp in batch_divisors:
        if dp > max_gpus:
            return
        share = global_batch // dp
        micro_batches = tuple(d for d in batch_divisors if d <= share and share % d == 0)
        for tp in tps:
            for pp in pps:
                if dp * tp * pp > max_gpus:
                    break
                zeros = tuple(z for z in (0, 1, 2, 3) if zero_runs_with(z, tp, pp)) if dp > 1 else (0,)
                yield Shape(dp, tp, pp, micro_batches, zeros)


def plan_space(model: ModelSpec, global_batch: int, max_gpus: int, node_gpus: int) -> Iterator[ParallelPlan]:
    """Every plan the memory model covers within ``max_gpus`` (``shapes``), dp, tp, pp,
    micro-batch, ZeRO and recomputation in that order."""
    for shape in shapes(model, global_batch, max_gpus, node_gpus):
        yield from shape.plans()
