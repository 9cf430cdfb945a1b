"""A GPU type: memory, peaks and links. Below both the catalog of known types and the cluster
inventory that names them, so neither imports the other to get it."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt


class GpuType(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    memory_bytes: PositiveInt
    half_tflops: PositiveFloat = Field(description="Dense bf16/fp16 tensor peak.")
    fp32_tflops: PositiveFloat
    link_gbps: PositiveFloat = Field(description="GPU-to-GPU bandwidth inside a node, GB/s (NVLink or PCIe).")
    memory_bandwidth_gbps: PositiveFloat = Field(default=900, description="Device memory bandwidth, GB/s.")
    achievable_fraction: float = Field(
        default=0.4, gt=0, le=1, description="Fraction of the dense peak a large training kernel mix reaches (model FLOPs utilisation)."
    )
    supports_bf16: bool = True
    runtime_overhead_bytes: NonNegativeInt | None = Field(
        default=None,
        description=(
            "CUDA context, NCCL buffers and library workspaces per GPU, in one number, for a type the packaged calibration "
            "(memory/calibration.json) lacks; None: the calibration's entry, or its assumption for unknown types."
        ),
    )


class MemoryMargin(BaseModel):
    """GPU memory a plan must leave unused: max(``fraction`` of the GPU, ``floor_bytes``).

    The default, 5% of the GPU with a 1 GiB floor (4 GiB of an 80 GB H100, 1 GiB of a 16 GB
    T4), covers what the prediction does not: the GPU terms are documented assumptions until
    ``frenzy calibrate`` fits them on the type; NCCL is charged for about two communicators
    while a plan with tp, pp and dp groups opens more (about 0.5-1 GB each on NVLink parts,
    NVIDIA/nccl#964, #1685: the floor is one of them); and what the caching allocator reserves
    beyond the largest of the replayed configurations (docs/memory.md). The tensors themselves
    are predicted to a median 0.04% and at worst 4.84% (FSDP2's ZeRO-3; 73 of the 80 within
    1.4%) against MemTracker on 80 CPU configurations of this engine (docs/memory.md, "Accuracy
    on this engine"). Set per cluster (``memory_margin`` in the cluster file)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fraction: float = Field(default=0.05, ge=0, lt=0.5, description="Share of each GPU's memory kept free.")
    floor_bytes: NonNegativeInt = Field(default=1024**3, description="Kept free at least, in bytes.")

    def bytes_for(self, memory_bytes: int) -> int:
        return max(math.ceil(self.fraction * memory_bytes), self.floor_bytes)
