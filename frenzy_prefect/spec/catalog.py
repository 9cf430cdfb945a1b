"""Known GPU types. Peaks are vendor datasheet numbers (dense, no sparsity; SXM parts where
both exist); memory is what nvidia-smi reports; ``link_gbps`` is one direction of the usual
GPU-to-GPU path in a node (NVLink where the part has it, else PCIe). ``achievable_fraction``
is an assumption until step times are measured on the type (``step_time.fit_achievable_fraction``):
~0.4 of peak is what well-tuned Megatron/DeepSpeed runs report on A100/H100, less on parts
whose tensor peak is harder to feed (T4 throttles, consumer cards lack the bandwidth), more on
P100, whose small fp16 peak is easy to reach. Clusters may declare types the catalog lacks or
override these (their own ``gpu_types``). What a GPU holds around the tensors (CUDA context,
NCCL buffers, cuBLAS workspaces, fragmentation) is not here but in ``memory/calibration.json``,
one documented entry per type."""

from __future__ import annotations

import re

from frenzy_prefect.spec.gpu import GpuType


def _gpu(
    name: str,
    memory_mib: int,
    half_tflops: float,
    fp32_tflops: float,
    link_gbps: float,
    memory_gbps: float,
    achievable: float,
    bf16: bool = True,
) -> GpuType:
    return GpuType(
        name=name,
        memory_bytes=memory_mib * 1024**2,
        half_tflops=half_tflops,
        fp32_tflops=fp32_tflops,
        link_gbps=link_gbps,
        memory_bandwidth_gbps=memory_gbps,
        achievable_fraction=achievable,
        supports_bf16=bf16,
    )


GPU_CATALOG: dict[str, GpuType] = {
    g.name: g
    for g in (
        _gpu("H200", 143_771, 989, 67, 450, 4800, 0.40),
        _gpu("H100", 81_559, 989, 67, 450, 3350, 0.40),
        _gpu("A100-80GB", 81_920, 312, 19.5, 300, 2039, 0.45),
        _gpu("A100-40GB", 40_960, 312, 19.5, 300, 1555, 0.45),
        _gpu("A10", 23_028, 125, 31.2, 32, 600, 0.35),
        _gpu("L4", 23_034, 121, 30.3, 32, 300, 0.30),
        _gpu("V100-32GB", 32_768, 125, 15.7, 150, 900, 0.40, bf16=False),
        _gpu("V100-16GB", 16_384, 125, 15.7, 150, 900, 0.40, bf16=False),
        _gpu("T4", 15_360, 65, 8.1, 16, 320, 0.30, bf16=False),
        _gpu("P100", 16_280, 18.7, 9.3, 16, 732, 0.50, bf16=False),
        _gpu("RTX-3090", 24_576, 71, 35.6, 32, 936, 0.35),
        _gpu("RTX-4090", 24_564, 165, 82.6, 32, 1008, 0.35),
    )
}


def type_key(name: str) -> str:
    """A GPU type's name as the clusters' managers spell it too: case and punctuation ignored."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def catalog_type(name: str, known: dict[str, GpuType]) -> str | None:
    """The known GPU type ``name`` names: itself, else the one type (and only one) whose name
    matches it ignoring case and punctuation (``h100``, ``a100_80gb``); None otherwise."""
    if name in known:
        return name
    matches = [k for k in known if type_key(k) == type_key(name)]
    return matches[0] if len(matches) == 1 else None
