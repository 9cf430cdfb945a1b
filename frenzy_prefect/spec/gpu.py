"""A GPU type: memory, peaks and links. Below both the catalog of known types and the cluster
inventory that names them, so neither imports the other to get it."""

from __future__ import annotations

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
