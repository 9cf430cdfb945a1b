"""Node discovery: NVML names map to catalog types, a machine without NVML says so and exits
non-zero, and a discovered node is added to (or replaces its namesake in) a cluster block."""

import pytest

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.profiling.nodes import GpuInfo, catalog_type, node_of
from frenzy_prefect.units import GIB
from tests.support.cli import frenzy


@pytest.mark.parametrize(
    ("nvml_name", "memory_gib", "expected"),
    [
        ("NVIDIA H200", 141, "H200"),
        ("NVIDIA H100 80GB HBM3", 80, "H100"),
        ("NVIDIA A100-SXM4-80GB", 80, "A100-80GB"),
        ("NVIDIA A100-PCIE-40GB", 40, "A100-40GB"),
        ("NVIDIA A10", 22.5, "A10"),
        ("NVIDIA L4", 22.5, "L4"),
        ("Tesla V100-SXM2-32GB", 32, "V100-32GB"),
        ("Tesla V100-PCIE-16GB", 16, "V100-16GB"),
        ("Tesla T4", 15, "T4"),
        ("Tesla P100-PCIE-16GB", 16, "P100"),
        ("NVIDIA GeForce RTX 4090", 24, "RTX-4090"),
        ("NVIDIA GeForce RTX 3090", 24, "RTX-3090"),
    ],
)
def test_nvml_product_names_map_to_catalog_types(nvml_name, memory_gib, expected):
    assert catalog_type(nvml_name, int(memory_gib * GIB)) == expected


def gpu(i: int, name: str, gib: float) -> GpuInfo:
    return GpuInfo(index=i, name=name, memory_bytes=int(gib * GIB), nvlinks=0, pcie_generation=4, pcie_width=16)


def test_a_node_is_one_gpu_type_with_its_smallest_memory():
    node = node_of("n1", "10.0.0.5", [gpu(0, "NVIDIA A10", 22.49), gpu(1, "NVIDIA A10", 22.5)])
    assert (node.gpu_type, node.gpu_count, node.gpu_memory_gib, node.host) == ("A10", 2, 22.49, "10.0.0.5")
    with pytest.raises(FrenzyError, match="mixes GPU types \\(A10, T4\\)"):
        node_of("n1", "h", [gpu(0, "NVIDIA A10", 22.5), gpu(1, "Tesla T4", 15)])
    with pytest.raises(FrenzyError, match="'NVIDIA B200' is not in the catalog \\(H200, H100"):
        node_of("n1", "h", [gpu(0, "NVIDIA B200", 180)])


def _nvml_loads() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.skipif(_nvml_loads(), reason="an NVIDIA driver is loaded here: discovery would succeed")
def test_without_nvml_discovery_says_so_and_exits_non_zero():
    out = frenzy("discover", "--json")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("error: NVML is not available on this machine") and "declare the node in a cluster file" in out.stderr
