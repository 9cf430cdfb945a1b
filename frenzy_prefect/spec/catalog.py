"""Known GPU types. Numbers are vendor datasheet peaks (dense, no sparsity); memory is what
nvidia-smi reports. Clusters may declare types the catalog lacks (their own `gpu_types`)."""

from __future__ import annotations

from frenzy_prefect.spec.cluster import GpuType
from frenzy_prefect.units import GIB

def _gpu(name: str, memory_mib: int, half_tflops: float, fp32_tflops: float, link_gbps: float, bf16: bool = True) -> GpuType:
    return GpuType(
        name=name,
        memory_bytes=memory_mib * 1024**2,
        half_tflops=half_tflops,
        fp32_tflops=fp32_tflops,
        link_gbps=link_gbps,
        supports_bf16=bf16,
        # CUDA context, cuBLAS/cuDNN workspaces and allocator slack; calibrated per type later.
        runtime_overhead_bytes=int(0.75 * GIB),
    )


GPU_CATALOG: dict[str, GpuType] = {
    g.name: g
    for g in (
        _gpu("H200", 143_771, 989, 67, 450),
        _gpu("H100", 81_559, 989, 67, 450),
        _gpu("A100-80GB", 81_920, 312, 19.5, 300),
        _gpu("A100-40GB", 40_960, 312, 19.5, 300),
        _gpu("A10", 23_028, 125, 31.2, 32),
        _gpu("L4", 23_034, 121, 30.3, 32),
        _gpu("V100-32GB", 32_768, 125, 15.7, 150, bf16=False),
        _gpu("V100-16GB", 16_384, 125, 15.7, 150, bf16=False),
        _gpu("T4", 15_360, 65, 8.1, 16, bf16=False),
        _gpu("P100", 16_280, 18.7, 9.3, 16, bf16=False),
        _gpu("RTX-3090", 24_576, 71, 35.6, 32),
        _gpu("RTX-4090", 24_564, 165, 82.6, 32),
    )
}
