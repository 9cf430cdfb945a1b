"""Where this process sits in the job: rank, world size and local rank, from torchrun's environment."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveInt

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
    def from_env(cls) -> "DistributedContext":
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

    def init_process_group(self) -> None:
        """Join the job's process group (env:// under torchrun; a private one for a lone process)."""
        if torch.cuda.is_available():
            torch.cuda.set_device(self.device)
        if "MASTER_ADDR" in os.environ:
            init = "env://"
        else:
            init = f"tcp://127.0.0.1:{free_port()}"
        dist.init_process_group(self.backend, init_method=init, rank=self.rank, world_size=self.world_size, timeout=INIT_TIMEOUT)
