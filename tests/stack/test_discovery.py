"""Node discovery: NVML names map to catalog types, a machine without NVML says so and exits
non-zero, and a discovered node is added to (or replaces its namesake in) a cluster block."""

from frenzy_prefect.spec.cluster import Node


def test_a_discovered_node_is_added_to_or_replaced_in_the_cluster_block(stack, prefect_api):
    from frenzy_prefect.blocks import FrenzyCluster, save_node

    with stack.client_settings():
        first = save_node("discovered", Node(name="gpu-1", host="10.0.0.1", gpu_type="A10", gpu_count=2))
        save_node("discovered", Node(name="gpu-2", host="10.0.0.2", gpu_type="T4", gpu_count=4))
        save_node("discovered", Node(name="gpu-1", host="10.0.0.1", gpu_type="A10", gpu_count=4))
        spec = FrenzyCluster.load("discovered").cluster
    assert [n.name for n in first.nodes] == ["gpu-1"]
    assert [(n.name, n.gpu_count) for n in spec.nodes] == [("gpu-2", 4), ("gpu-1", 4)] and spec.name == "discovered"
