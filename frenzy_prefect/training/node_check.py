"""A node's smoke check (`frenzy cluster check`), on each of its ranks: what the rank sees (its
host, the CUDA devices it was given, their free memory), a GiB allocated and written on its GPU,
and one timed all-reduce over the node's ranks whose sum is checked. It trains nothing.

The ranks are started as a training job's are (the pool's queue, its GPU take, its launcher,
torchrun), so a check that passes has exercised what a training run on the node goes through:
rank 0 is the `node-check` flow run (flows/node_check.py), which gathers every rank's account.
"""

from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist
from pydantic import BaseModel

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.profiling.nodes import catalog_type
from frenzy_prefect.spec.plan import TrainingJob
from frenzy_prefect.training.distributed import DistributedContext
from frenzy_prefect.units import duration, gib

ALLOCATE_BYTES = 1 << 30  # written once on each rank's GPU: the allocator and the memory work
ALL_REDUCE_BYTES = 64 << 20  # float32: large enough that the time says something of the links


class RankCheck(BaseModel):
    """What one rank saw and did."""

    rank: int
    host: str
    cuda_visible_devices: str | None  # as the launcher (or Slurm, or the device plugin) set it
    cuda_devices: int  # how many CUDA devices the rank's torch sees
    device: str  # the one it used: "cuda:0", or "cpu"
    gpu_name: str | None = None  # its product name ("NVIDIA A10")
    torch_version: str = torch.__version__
    free_bytes: int | None = None  # free on its GPU before the allocation (None on CPU)
    total_bytes: int | None = None
    error: str | None = None  # what failed on this rank, if anything


class AllReduce(BaseModel):
    """The timed all-reduce over the node's ranks, as rank 0 saw it."""

    ranks: int
    nbytes: int
    seconds: float
    correct: bool

    @property
    def bus_gbps(self) -> float:
        """Bus bandwidth, GB/s (NCCL's convention: a ring moves 2 (n-1)/n of the buffer per rank)."""
        return self.nbytes * 2 * (self.ranks - 1) / self.ranks / self.seconds / 1e9 if self.ranks > 1 else 0.0


def check_ranks(job: TrainingJob, ctx: DistributedContext) -> tuple[list[RankCheck], AllReduce] | None:
    """This rank's part of its node's check; on rank 0 every rank's account and the all-reduce
    (None on the others)."""
    ctx.init_process_group()
    try:
        mine = _look(ctx)
        reduced = _all_reduce(ctx)
        every: list[RankCheck | None] = [None] * ctx.world_size
        dist.all_gather_object(every, mine)
    finally:
        dist.destroy_process_group()
    return ([r for r in every if r is not None], reduced) if ctx.rank == 0 else None


def _look(ctx: DistributedContext) -> RankCheck:
    seen = RankCheck(
        rank=ctx.rank,
        host=socket.gethostname(),
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        cuda_devices=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        device="cpu",
    )
    if not torch.cuda.is_available():
        return seen
    try:
        device = ctx.device
        free, total = torch.cuda.mem_get_info(device)
        block = torch.empty(ALLOCATE_BYTES, dtype=torch.uint8, device=device).fill_(1)
        torch.cuda.synchronize(device)
        del block
        torch.cuda.empty_cache()
        name = torch.cuda.get_device_name(device)
        return seen.model_copy(update={"device": str(device), "gpu_name": name, "free_bytes": free, "total_bytes": total})
    except Exception as exc:  # a rank's GPU that cannot be used: said, not raised (the others report too)
        return seen.model_copy(update={"error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]})


def _all_reduce(ctx: DistributedContext) -> AllReduce:
    """Every rank adds rank + 1: each element's sum must be n (n + 1) / 2."""
    device = ctx.device if torch.cuda.is_available() else torch.device("cpu")
    buffer = torch.full((ALL_REDUCE_BYTES // 4,), float(ctx.rank + 1), dtype=torch.float32, device=device)
    dist.all_reduce(torch.ones(1, device=device))  # (a first collective sets up the links: not timed)
    dist.barrier()
    started = time.perf_counter()
    dist.all_reduce(buffer)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    expected = ctx.world_size * (ctx.world_size + 1) / 2
    correct = bool((buffer == expected).all())
    return AllReduce(ranks=ctx.world_size, nbytes=ALL_REDUCE_BYTES, seconds=seconds, correct=correct)


def verdict(job: TrainingJob, ranks: list[RankCheck], reduced: AllReduce, allow_cpu: bool = False) -> tuple[bool, str]:
    """Whether the node passed, and why in a line: its ranks' errors; a wrong sum; ranks that see
    no GPU (unless ``allow_cpu``: a cluster of emulated GPUs) or another type than the node
    declares; else what it saw and how fast the all-reduce was."""
    node = next(n for n in job.cluster.nodes if n.name == job.allocation.placements[0].node)
    if errors := [f"rank {r.rank}: {r.error}" for r in ranks if r.error]:
        return False, "; ".join(errors)
    if not reduced.correct:
        return False, f"the all-reduce over its {reduced.ranks} ranks summed wrong: the links between its GPUs corrupt data"
    on_gpu = [r for r in ranks if r.gpu_name]
    if len(on_gpu) < len(ranks) and not (allow_cpu and not on_gpu):
        cpu = next(r for r in ranks if not r.gpu_name)
        return False, (
            f"{len(ranks) - len(on_gpu)} of its {len(ranks)} ranks see no CUDA device (rank {cpu.rank}: torch {cpu.torch_version}, "
            f"CUDA_VISIBLE_DEVICES={cpu.cuda_visible_devices}): training would run on CPU; install the NVIDIA driver and a CUDA "
            "build of torch there (or pass --allow-cpu for a cluster of emulated GPUs)"
        )
    if wrong := _other_type(node.gpu_type, on_gpu):
        return False, wrong
    seen = f"{len(on_gpu)} x {on_gpu[0].gpu_name}" if on_gpu else f"no GPU: {len(ranks)} ranks on CPU (--allow-cpu)"
    free = f", at least {gib(min(r.free_bytes or 0 for r in on_gpu), 1)} GiB free each" if on_gpu else ""
    speed = f" ({reduced.bus_gbps:.1f} GB/s bus)" if reduced.ranks > 1 else ""
    hosts = ", ".join(sorted({r.host for r in ranks}))
    return True, f"{seen}{free} on {hosts}; all-reduce of {reduced.nbytes >> 20} MiB in {duration(reduced.seconds)}{speed}"


def _other_type(declared: str, on_gpu: list[RankCheck]) -> str | None:
    """What to say when the ranks' GPUs are not the type the node declares (None: they are, or
    the product is one the catalog does not name, a type the cluster declares itself)."""
    for r in on_gpu:
        try:
            seen = catalog_type(r.gpu_name or "", r.total_bytes or 0)
        except FrenzyError:
            continue
        if seen != declared:
            return f"the node is declared {declared}, but rank {r.rank} sees {r.gpu_name} ({seen}): plans for it would be wrong"
    return None
