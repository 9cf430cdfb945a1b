"""Where this process sits in the job: rank, world size and local rank, from torchrun's environment."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveInt

from frenzy_prefect.errors import StorageUnreachable, exception_chain

T = TypeVar("T")

# Long enough for the slowest rank to import torch and read its first batch, short enough that
# a rank that never arrives fails the job instead of hanging it.
INIT_TIMEOUT = timedelta(minutes=5)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class DistributedContext(BaseModel):
    model_config = ConfigDict(frozen=True)

    rank: NonNegativeInt = 0
    world_size: PositiveInt = 1
    local_rank: NonNegativeInt = 0

    @classmethod
    def from_env(cls) -> DistributedContext:
        return cls(
            rank=int(os.environ.get("RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        )

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")

    @property
    def backend(self) -> str:
        return "nccl" if torch.cuda.is_available() else "gloo"

    def rendezvous(self) -> dist.Store:
        """A connection to the job's store (torchrun's agent hosts it under torchrun; a private
        one for a lone process), under this attempt's prefix: torchrun's agent keeps its store
        when it restarts the ranks (max_restarts), and each attempt needs its own keys, or its
        ranks would connect to the last attempt's addresses."""
        init = "env://" if "MASTER_ADDR" in os.environ else f"tcp://127.0.0.1:{free_port()}"
        store, _, _ = next(dist.rendezvous(init, self.rank, self.world_size, timeout=INIT_TIMEOUT))
        return dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)

    def init_process_group(self, store: dist.Store | None = None) -> None:
        """Join the job's process group on ``store`` (default: a new rendezvous)."""
        if torch.cuda.is_available():
            torch.cuda.set_device(self.device)
        store = store or self.rendezvous()
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world_size, timeout=INIT_TIMEOUT)


class PeerFailed(RuntimeError):
    """Another rank failed and rank 0 reports why. This rank ends quietly (exit 0): exiting
    non-zero would let torchrun stop rank 0 before it had reported the cause to Prefect."""


def broke_on_a_peer(exc: BaseException) -> bool:
    """``exc`` (or an exception it came from) is a collective broken by a dead or hung peer:
    torch raises NCCL's as DistError and gloo's as a bare RuntimeError naming its transport."""
    return any(isinstance(e, dist.DistError) or (type(e) is RuntimeError and "gloo/transport" in str(e)) for e in exception_chain(exc))


def together(ctx: DistributedContext, action: Callable[[], T]) -> T:
    """``action`` on this rank, then every rank learns whether any rank's failed (one small
    all-reduce; all ranks must call this at the same point). On a failure anywhere, rank 0
    raises it (its own, else the first failed rank's) and the other ranks raise PeerFailed, so
    that the run's state names the cause rather than 'aborted by a termination signal'."""
    try:
        result, error = action(), None
    except Exception as exc:
        if broke_on_a_peer(exc):
            # The group is broken: no agreement can complete on it, and a peer still inside the
            # action (a checkpoint's gather) waits on this rank, not on the dead one, until the
            # group's timeout. Raising lets this rank leave the group; its connections close,
            # which ends those waits at once (ReCycle's survivors then re-form without the dead).
            raise
        result, error = None, exc
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return result
    rank, world_size = dist.get_rank(), dist.get_world_size()  # (ReCycle may run on with fewer ranks than the job's)
    failed = torch.tensor([error is not None], dtype=torch.int32, device=ctx.device)
    dist.all_reduce(failed)
    if not failed.item():
        return result
    reports: list[tuple[bool, str] | None] = [None] * world_size
    report = None if error is None else (isinstance(error, StorageUnreachable), f"{type(error).__name__}: {error}")
    dist.all_gather_object(reports, report)
    failed_ranks = [r for r, rep in enumerate(reports) if rep is not None]
    if rank != 0:
        raise PeerFailed(f"rank {ctx.rank} stops: rank 0 reports the failure of rank(s) {failed_ranks}") from error
    if error is not None:
        raise error
    rank = failed_ranks[0]
    storage, message = reports[rank]
    if storage:
        raise StorageUnreachable(f"on rank {rank}, {message.removeprefix('StorageUnreachable: ')}")
    raise RuntimeError(f"rank {rank} failed: {message}")
