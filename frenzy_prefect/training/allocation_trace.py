"""What a GPU would reserve for a plan, without a GPU: each rank's training step is traced on fake
tensors (shapes and storage sizes, no data, no compute; collectives through torch's fake process
group), every storage's allocation and free recorded in order, and the sequence replayed through
the caching allocator's rules (frenzy_prefect/caching_allocator.py).

The trace is the engine's own step, so the tensors are exactly those a GPU run allocates, in the
order it allocates them, with two differences the GPU type supplies or that stay out of reach:
the cuBLAS workspaces (allocated through the caching allocator at the first matrix multiply, here
at the start) and the kernels' internal scratch buffers (flash attention's backward accumulators),
which a fake kernel does not allocate. Plans whose gradient reduction runs in C++ on real buffers
(DDP's reducer: data parallelism without ZeRO) or which shard through DeepSpeed or FSDP2 cannot be
traced this way and are refused.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, NonNegativeInt
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from frenzy_prefect.caching_allocator import replay
from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.spec.layout import check_engine_plan, uses_ddp
from frenzy_prefect.torch_private import fake_store, fake_tensors
from frenzy_prefect.training.measure import STEPS, Measurement

Events = list[tuple[int, int]]


class AllocationRecorder(TorchDispatchMode):
    """Records (storage id, bytes) when an op's output brings a new storage and (storage id, -1)
    when that storage is freed, in the order they happen."""

    def __init__(self) -> None:
        super().__init__()
        self.events: Events = []
        self._live: dict[int, int] = {}
        self._ids = itertools.count()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)  # (torch keeps one Python object per live storage)
        if key in self._live:
            return
        self._live[key] = event = next(self._ids)
        self.events.append((event, storage.nbytes()))
        weakref.finalize(storage, self._freed, key, event)

    def _freed(self, key: int, event: int) -> None:
        self._live.pop(key, None)
        self.events.append((event, -1))


class ReplayedRank(BaseModel):
    """One rank's step as the caching allocator would hold it."""

    model_config = ConfigDict(frozen=True)

    rank: NonNegativeInt
    stage: NonNegativeInt
    tensors_bytes: NonNegativeInt  # the peak of live tensor storage (MemTracker's figure)
    allocated_bytes: NonNegativeInt  # torch.cuda.max_memory_allocated: blocks as the allocator rounds them
    reserved_bytes: NonNegativeInt  # torch.cuda.max_memory_reserved
    reserved_expandable_bytes: NonNegativeInt  # the same with expandable_segments:True


def traceable(measurement: Measurement) -> str | None:
    """Why ``measurement``'s plan cannot be traced, or None."""
    plan, work = measurement.plan, measurement.work
    if uses_ddp(plan, work.master_weights):
        return "data parallelism without ZeRO reduces through DDP's C++ reducer, which needs real buffers"
    if plan.zero in (2, 3):
        return f"ZeRO-{plan.zero} shards through {'DeepSpeed' if plan.zero == 2 else 'FSDP2'}, whose kernels need real buffers"
    return None


def trace_rank(measurement: Measurement, rank: int, *, on_gpu: bool = True, workspace_bytes: int = 0) -> Events:
    """``rank``'s allocations over STEPS optimizer steps of ``measurement`` (its first steps
    allocate what later steps reuse), after ``workspace_bytes`` of cuBLAS workspaces: one per
    handle, and torch keeps a handle per thread (the forward's and autograd's backward's).
    ``on_gpu``: the optimizer's foreach kernels, which torch picks for CUDA tensors (their
    temporaries span every tensor); off, the per-tensor loop it runs on CPU."""
    model, plan, work = measurement.model, measurement.plan, measurement.work
    check_engine_plan(model, plan, work.precision, work.master_weights)
    if (why := traceable(measurement)) is not None:
        raise FrenzyError(f"cannot trace {plan.label()}: {why}; plans with dp = 1, or ZeRO-1, can be traced")
    from frenzy_prefect.training.engine import Engine

    if dist.is_initialized():
        raise FrenzyError("tracing needs a process without a process group of its own")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=plan.gpus)
    try:
        with fake_tensors(), AllocationRecorder() as recorder:
            halves = (workspace_bytes // 2, workspace_bytes - workspace_bytes // 2) if workspace_bytes else ()
            keep = [torch.empty(n, dtype=torch.uint8) for n in halves]
            # The model is built on its device; fake tensors cannot be moved (swapped) in place.
            with mock.patch.object(torch.nn.Module, "to", lambda module, *a, **k: module):
                engine = Engine(model, plan, work, rank=rank, device=torch.device("cpu"))
            for group in engine.optimizer.param_groups:
                group["foreach"] = on_gpu
            # Fake scalars have no value: the loss and the optimizer's step count read as 1.
            with mock.patch.object(torch.Tensor, "item", lambda tensor: 1.0):
                for _ in range(STEPS):
                    engine.step([_micro_batch(measurement) for _ in range(plan.accumulation(work.global_batch))])
            del engine, keep
        return recorder.events
    finally:
        dist.destroy_process_group()


def _micro_batch(measurement: Measurement) -> tuple[Any, Any]:
    ids = torch.randint(0, measurement.model.vocab_size, (measurement.plan.micro_batch, measurement.work.seq_len + 1))
    return ids[:, :-1], ids[:, 1:]


def tensor_peak(events: Events) -> int:
    live: dict[int, int] = {}
    current = peak = 0
    for event, nbytes in events:
        if nbytes >= 0:
            live[event] = nbytes
            current += nbytes
            peak = max(peak, current)
        else:
            current -= live.pop(event)
    return peak


def replayed(measurement: Measurement, *, on_gpu: bool = True, workspace_bytes: int = 0) -> list[ReplayedRank]:
    """The first rank of every pipeline stage (data-parallel replica 0, tensor-parallel rank 0),
    traced and replayed through the caching allocator, with and without expandable segments."""
    plan = measurement.plan
    ranks = []
    for stage in range(plan.pp):
        rank = plan.rank_of(stage, 0, 0)
        events = trace_rank(measurement, rank, on_gpu=on_gpu, workspace_bytes=workspace_bytes)
        segments, expandable = replay(events), replay(events, expandable_segments=True)
        ranks.append(
            ReplayedRank(
                rank=rank,
                stage=stage,
                tensors_bytes=tensor_peak(events),
                allocated_bytes=segments.peak_allocated,
                reserved_bytes=segments.peak_reserved,
                reserved_expandable_bytes=expandable.peak_reserved,
            )
        )
    return ranks
