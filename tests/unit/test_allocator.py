"""HAS on the example cluster and on generated ones: it picks a type that fits and is fast,
never places more GPUs than a node has free, and says why when nothing fits."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frenzy_prefect import allocator
from frenzy_prefect.allocator.placement import place
from frenzy_prefect.allocator.space import divisors, plan_space, shapes
from frenzy_prefect.errors import ClusterBusy, NoFeasiblePlan
from frenzy_prefect.profiling.model import PRESETS
from frenzy_prefect.spec.cluster import ClusterSpec, ClusterState, Node
from frenzy_prefect.spec.gpu import MemoryMargin
from frenzy_prefect.spec.plan import PlanCandidate
from frenzy_prefect.spec.request import PlanPin, TrainingRequest
from frenzy_prefect.spec.workload import MAX_GLOBAL_BATCH
from frenzy_prefect.units import GIB
from tests.support.stack import EXAMPLE_CLUSTER, ROOT

CLUSTER = ClusterSpec.from_file(EXAMPLE_CLUSTER)


def _allocate(model="gpt-nano", state=None, **request):
    req = TrainingRequest(
        model=model, dataset="s3://b/d.txt", steps=1, **({"global_batch": 32, "seq_len": 128, "precision": "fp32"} | request)
    )
    cands = allocator.candidate_plans(PRESETS[model], req, CLUSTER)
    return allocator.allocate(cands, state or ClusterState.idle(CLUSTER)), cands


def test_the_faster_type_wins_and_is_placed_on_one_node():
    chosen, _ = _allocate()
    assert chosen.gpu_type == "A10"  # 31.2 fp32 TFLOPS against the T4's 8.1
    assert chosen.plan.gpus == 2 and [p.node for p in chosen.placements] == ["a10-node"]
    assert chosen.memory.peak_bytes <= chosen.gpu_memory_bytes


def test_bf16_excludes_types_without_bf16():
    _, cands = _allocate(precision="bf16")
    assert {c.gpu_type for c in cands} == {"A10"}


def test_bf16_on_a_cluster_without_bf16_says_which_precisions_would_work():
    t4_only = ClusterSpec(nodes=[Node(name="t4", host="127.0.0.1", gpu_type="T4", gpu_count=4)])
    req = TrainingRequest(model="gpt-nano", dataset="s3://b/d.txt", steps=1, global_batch=8, seq_len=64, precision="bf16")
    with pytest.raises(
        NoFeasiblePlan, match=r"bf16 needs GPUs with bf16 support, and cluster 'cluster' has none \(T4\); request fp16 or fp32"
    ):
        allocator.candidate_plans(PRESETS["gpt-nano"], req, t4_only)


def test_busy_fast_type_falls_back_to_the_other_type():
    state = ClusterState(cluster=CLUSTER, free_gpus={"a10-node": [], "t4-node": [0, 1]})
    chosen, _ = _allocate(state=state)
    assert chosen.gpu_type == "T4" and chosen.placements[0].node == "t4-node"


def test_no_free_gpus_is_busy_not_infeasible():
    state = ClusterState(cluster=CLUSTER, free_gpus={"a10-node": [], "t4-node": []})
    with pytest.raises(ClusterBusy, match="not its free GPUs now; the smallest needs 1 x"):
        _allocate(state=state)


def test_a_job_no_gpu_can_hold_names_the_smallest_need_and_the_largest_gpu():
    with pytest.raises(NoFeasiblePlan) as exc:
        _allocate(model="gpt3-13b", global_batch=8, seq_len=2048)
    message = str(exc.value)
    assert "the smallest per-GPU requirement found is" in message
    assert "the largest GPU available is A10 with 22.49 GiB (node a10-node)" in message
    assert "GiB short:" in message and "GiB margin > 22.49 GiB" in message


def test_a_plan_fits_only_with_its_margin_kept():
    chosen, _ = _allocate()
    exact = chosen.gpu_memory_bytes - chosen.memory.peak_bytes
    assert chosen.margin_bytes == MemoryMargin().bytes_for(chosen.gpu_memory_bytes) > GIB  # 5% of an A10: 1.12 GiB
    assert chosen.spare_bytes == exact - chosen.margin_bytes >= 0
    keep = dict(chosen)
    assert PlanCandidate(**keep | {"margin_bytes": exact}).fits
    assert not PlanCandidate(**keep | {"margin_bytes": exact + 1}).fits  # fits only by eating the margin: rejected
    assert MemoryMargin().bytes_for(80 * GIB) == 4 * GIB and MemoryMargin().bytes_for(16 * GIB) == GIB  # the floor


def test_the_cluster_file_sets_the_margin_and_a_margin_too_large_rejects_every_plan():
    greedy = CLUSTER.model_copy(update={"memory_margin": MemoryMargin(fraction=0.49)})
    req = TrainingRequest(model="gpt2-small", dataset="s3://b/d.txt", steps=1, global_batch=64, seq_len=1024, precision="fp32")
    fitting = [c for c in allocator.candidate_plans(PRESETS["gpt2-small"], req, CLUSTER) if c.fits]
    kept = [c for c in allocator.candidate_plans(PRESETS["gpt2-small"], req, greedy) if c.fits]
    assert 0 < len(kept) < len(fitting) and all(c.memory.peak_bytes <= 0.51 * c.gpu_memory_bytes for c in kept)
    assert ClusterSpec.from_file(H100_CLUSTER).memory_margin == MemoryMargin()


H100_CLUSTER = ROOT / "examples" / "clusters" / "h100x16.yaml"


def _llama_on_h100():
    cluster = ClusterSpec.from_file(H100_CLUSTER)
    req = TrainingRequest(model="llama-3.1-8b", dataset="s3://b/d.bin", steps=1, global_batch=64, seq_len=8192)
    cands = allocator.candidate_plans(PRESETS["llama-3.1-8b"], req, cluster)
    return allocator.allocate(cands, ClusterState.idle(cluster)), cands


def test_llama_3_1_8b_on_two_h100_nodes_gets_a_plan_a_megatron_user_would_recognise():
    """What makes a plan sensible here, not a plan: it fits with the margin kept, its tensor
    parallelism stays inside an NVLink node, it uses the 16 GPUs (each fewer-GPU plan is
    predicted slower), and it is the fastest fitting plan."""
    chosen, cands = _llama_on_h100()
    assert chosen.fits and chosen.memory.peak_bytes + chosen.margin_bytes <= chosen.gpu_memory_bytes
    assert chosen.margin_bytes == MemoryMargin().bytes_for(chosen.gpu_memory_bytes) > 3.9 * GIB
    assert chosen.plan.tp <= 8 and all(len(p.gpus) % chosen.plan.tp == 0 for p in chosen.placements)
    assert chosen.plan.gpus == 16 and sorted(len(p.gpus) for p in chosen.placements) == [8, 8]
    fitting = [c for c in cands if c.fits]
    assert chosen.step_time_s == min(c.step_time_s for c in fitting)
    assert min(c.step_time_s for c in fitting if c.plan.gpus <= 8) > chosen.step_time_s
    # 16 bytes of fp32 model state per parameter (weights, gradients, Adam): 8B parameters
    # need their model states split over at least two GPUs before any activation.
    assert chosen.plan.tp * chosen.plan.pp > 1 or chosen.plan.zero >= 2


def test_llama_3_1_70b_on_one_h100_node_is_refused_with_the_shortfall_named():
    # 16 bytes of fp32 model state per parameter: 1.1 TB over 8 x 80 GB, however it is split.
    one_node = ClusterSpec.from_file(H100_CLUSTER)
    one_node = one_node.model_copy(update={"nodes": one_node.nodes[:1]})
    req = TrainingRequest(model="llama-3.1-70b", dataset="s3://b/d.bin", steps=1, global_batch=8, seq_len=4096)
    with pytest.raises(NoFeasiblePlan) as exc:
        allocator.allocate(allocator.candidate_plans(PRESETS["llama-3.1-70b"], req, one_node), ClusterState.idle(one_node))
    assert "GiB short:" in str(exc.value) and "GiB margin > 79.65 GiB" in str(exc.value)


def test_every_ranked_candidate_that_fits_comes_before_any_that_does_not():
    _, cands = _allocate(model="gpt2-small", global_batch=64, seq_len=1024)
    fits = [c.fits for c in cands]
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)


def _node(name, count):
    return Node(name=name, host="127.0.0.1", gpu_type="A10", gpu_count=count)


def test_placement_prefers_an_exact_fit_then_the_tightest_fit():
    nodes = [(_node("big", 8), list(range(8))), (_node("exact", 4), [0, 1, 2, 3]), (_node("snug", 6), [1, 2, 3, 4, 5])]
    assert [p.node for p in place(4, nodes)] == ["exact"]
    assert place(5, nodes)[0].node == "snug" and place(5, nodes)[0].gpus == [1, 2, 3, 4, 5]
    assert place(3, nodes[:1] + nodes[2:])[0].node == "snug"


def test_placement_splits_greedily_when_no_node_fits():
    nodes = [(_node("a", 4), [0, 1]), (_node("b", 4), [0, 1, 2]), (_node("c", 4), [3])]
    placed = place(5, nodes)
    assert [(p.node, p.gpus) for p in placed] == [("b", [0, 1, 2]), ("a", [0, 1])]


def test_tensor_parallel_groups_stay_inside_a_node():
    nodes = [(_node("a", 4), [0, 1, 2]), (_node("b", 4), [0, 1, 2])]
    placed = place(4, nodes, group=2)
    assert all(len(p.gpus) % 2 == 0 for p in placed) and sum(len(p.gpus) for p in placed) == 4


@settings(max_examples=200, deadline=None)
@given(
    free=st.lists(st.lists(st.integers(0, 7), unique=True, max_size=8), min_size=1, max_size=6),
    groups=st.integers(1, 12),
    group=st.sampled_from([1, 2, 4]),
)
def test_placement_never_over_books_a_node(free, groups, group):
    gpus = groups * group  # a plan's GPU count is a multiple of its tensor-parallel degree
    nodes = [(_node(f"n{i}", 8), sorted(idx)) for i, idx in enumerate(free)]
    placed = place(gpus, nodes, group=group)
    usable = sum(len(idx) // group * group for _, idx in nodes)
    if placed is None:
        assert usable < gpus
        return
    assert all(len(p.gpus) % group == 0 for p in placed)
    assert sum(len(p.gpus) for p in placed) == gpus
    assert len({p.node for p in placed}) == len(placed)
    by_name = {n.name: idx for n, idx in nodes}
    for p in placed:
        assert set(p.gpus) <= set(by_name[p.node]) and len(set(p.gpus)) == len(p.gpus)


def test_master_weights_candidates_leave_out_zero_2_and_count_half_weights():
    """DeepSpeed's ZeRO-2 runs fp32 weights only; every other plan is estimated with bf16
    weights beside fp32 masters (the same 2 + 4 + 4 + 8 bytes per parameter without ZeRO)."""
    req = TrainingRequest(model="gpt-nano", dataset="s3://b/d.txt", steps=1, global_batch=8, seq_len=64, master_weights=True)
    cands = allocator.candidate_plans(PRESETS["gpt-nano"], req, CLUSTER)
    assert cands and all(c.plan.zero != 2 for c in cands)
    plain = next(c for c in cands if c.plan.gpus == 1 and c.plan.recompute == "none")
    n = PRESETS["gpt-nano"].parameters
    assert (plain.memory.peak_stage.params, plain.memory.peak_stage.grads, plain.memory.peak_stage.optimizer) == (2 * n, 4 * n, 12 * n)


def test_a_pinned_part_of_the_plan_is_kept_and_the_allocator_chooses_the_rest():
    req = TrainingRequest(model="gpt-nano", dataset="s3://b/d.txt", steps=1, global_batch=32, seq_len=128, precision="fp32", plan={"pp": 2})
    cands = allocator.candidate_plans(PRESETS["gpt-nano"], req, CLUSTER)
    assert cands and all(c.plan.pp == 2 for c in cands)
    assert len({(c.plan.dp, c.plan.micro_batch, c.plan.zero, c.plan.recompute) for c in cands}) > 1  # the rest is chosen
    impossible = req.model_copy(update={"plan": PlanPin(tp=3)})  # gpt-nano's 4 heads do not split three ways
    with pytest.raises(NoFeasiblePlan, match=r"^no plan with tp=3 runs on cluster .*: tp=3 does not split gpt-nano's heads \(4\)"):
        allocator.candidate_plans(PRESETS["gpt-nano"], impossible, CLUSTER)


@pytest.mark.parametrize(
    ("pin", "request_", "reason"),
    [
        ({"tp": 5}, {}, "tp=5 does not split gpt2-small's heads (12), kv_heads, hidden and ffn evenly; accepted on this cluster: [1, 2]"),
        ({"tp": 4}, {}, "tp=4 does not fit in one node (the largest has 2 GPUs); accepted on this cluster: [1, 2]"),
        ({"pp": 64}, {}, "pp=64 exceeds gpt2-small's 12 layers; accepted: [1, 2, 4, 8]"),
        ({"pp": 3}, {}, "pp=3 is not a power of two; accepted: [1, 2, 4, 8]"),
        ({"dp": 3}, {}, "dp=3 does not divide global_batch (64)"),
        ({"dp": 2, "micro_batch": 64}, {}, "dp x micro_batch = 2 x 64 does not divide global_batch (64); micro-batches that do: [1, 2, 4"),
        ({"dp": 2, "pp": 2}, {}, "dp x tp x pp is at least 2 x 1 x 2 = 4 GPUs, and cluster 'local-hetero' has at most 2 of one type"),
        ({"zero": 2, "pp": 2}, {}, "zero=2 runs through DeepSpeed, which refuses it with pipelines"),
        ({"zero": 1, "dp": 1}, {}, "zero=1 shards over data-parallel replicas: it needs dp >= 2"),
        ({"tp": 2}, {"resilience": "recycle"}, "resilience 'recycle' cannot run plan dp=2 tp=2 pp=2"),
        ({"tp": 2}, {"precision": "fp16"}, "fp16 loss scaling is implemented for plain data parallelism"),
    ],
)
def test_a_pin_no_plan_can_keep_is_refused_naming_the_one_constraint_it_breaks(pin, request_, reason):
    fields = {"global_batch": 64, "seq_len": 256, "precision": "fp32", "plan": pin} | request_
    req = TrainingRequest(model="gpt2-small", dataset="s3://b/d.txt", steps=1, **fields)
    with pytest.raises(NoFeasiblePlan) as exc:
        allocator.candidate_plans(PRESETS["gpt2-small"], req, CLUSTER)
    message = str(exc.value)
    assert message.startswith(f"no plan with {req.plan.label()} runs on cluster 'local-hetero': ") and reason in message
    assert "pp at most the layers" not in message  # the constraint it breaks, not the list of every constraint


def test_a_search_larger_than_the_bound_is_refused_with_its_size_before_it_runs():
    many = ClusterSpec.from_file(ROOT / "examples" / "clusters" / "three-types-64.yaml")
    req = TrainingRequest(model="gpt2-small", dataset="s3://b/d.txt", steps=1, global_batch=5040, seq_len=1024, precision="bf16")
    with pytest.raises(NoFeasiblePlan, match=r"spans 13,416 plans, more than the 10,000 it covers .* \(5,040 has 60\)"):
        allocator.candidate_plans(PRESETS["gpt2-small"], req, many)
    pinned = req.model_copy(update={"plan": PlanPin(tp=1, pp=1)})  # what the refusal suggests: a pin narrows the search
    assert all(c.plan.tp == c.plan.pp == 1 for c in allocator.candidate_plans(PRESETS["gpt2-small"], pinned, many))


def test_the_plan_space_is_the_divisors_of_the_batch_found_without_scanning_it():
    assert divisors(1) == [1] and divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(49) == [1, 7, 49]
    assert divisors(MAX_GLOBAL_BATCH) == [1 << k for k in range(25)]
    for n in range(1, 300):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    plans = list(plan_space(PRESETS["gpt-nano"], 12, 4, 2))
    assert {(p.dp, p.micro_batch) for p in plans} == {(d, m) for d in (1, 2, 3, 4) for m in divisors(12 // d)}
    assert len(plans) == sum(s.size for s in shapes(PRESETS["gpt-nano"], 12, 4, 2))


PRICED = CLUSTER.model_copy(update={"prices": {"A10": 1.0, "T4": 0.2}})  # the T4 much cheaper than the example's


def _priced(**request):
    req = TrainingRequest(model="gpt-nano", dataset="s3://b/d.txt", **({"global_batch": 32, "seq_len": 128, "precision": "fp32"} | request))
    cands = allocator.candidate_plans(PRESETS["gpt-nano"], req, PRICED)
    return allocator.allocate(cands, ClusterState.idle(PRICED)), cands


@pytest.mark.pipelines
def test_the_cost_objective_runs_the_cheapest_fitting_plan_and_a_deadline_excludes_the_slow_ones():
    fastest, _ = _priced(steps=1000)
    cheapest, cands = _priced(steps=1000, objective="cost")
    fitting = [c for c in cands if c.fits]
    assert all(c.total_time_s == pytest.approx(c.step_time_s * 1000) for c in fitting)
    assert all(c.cost == pytest.approx(c.total_time_s / 3600 * c.plan.gpus * PRICED.prices[c.gpu_type]) for c in fitting)
    assert cheapest.cost == min(c.cost for c in fitting) and cheapest.cost < fastest.cost
    assert (fastest.gpu_type, cheapest.gpu_type) == ("A10", "T4")  # the T4 is slower, and cheaper per step

    deadline = (fastest.total_time_s + cheapest.total_time_s) / 2 / 3600  # the cheap plan misses it
    within, cands = _priced(steps=1000, objective="cost", deadline_hours=deadline)
    assert within.total_time_s <= deadline * 3600 and all(c.total_time_s <= deadline * 3600 for c in cands)
    assert within.cost == min(c.cost for c in cands if c.fits) and within.cost > cheapest.cost


@pytest.mark.pipelines
def test_a_deadline_no_plan_meets_and_a_cost_objective_without_prices_say_what_to_change():
    with pytest.raises(
        NoFeasiblePlan, match=r"no plan on cluster 'local-hetero' is predicted to finish 1000 steps within 1e-06 h: the fastest"
    ):
        _priced(steps=1000, deadline_hours=1e-6)
    unpriced = CLUSTER.model_copy(update={"prices": {"A10": 1.0}})
    req = TrainingRequest(model="gpt-nano", dataset="s3://b/d.txt", global_batch=32, seq_len=128, steps=1, objective="cost")
    with pytest.raises(NoFeasiblePlan, match=r"objective 'cost' needs the price of a GPU-hour of every type .* add prices for T4"):
        allocator.candidate_plans(PRESETS["gpt-nano"], req, unpriced)
