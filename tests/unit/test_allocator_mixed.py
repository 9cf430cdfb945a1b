"""Plans across GPU types (issue 31; allocator/mixed.py, step_time.predict_mixed_step): the split
by speed under memory, the bounded search, and the goals the issue sets, by prediction, on the
scenarios of benchmarks/mixed_plans.py. The engine training such plans is tests/stack/test_mixed.py."""

from __future__ import annotations

import itertools

import pytest

from benchmarks.mixed_plans import NETWORK_GBPS, best_mixed, best_single, cluster_of, request
from frenzy_prefect import allocator
from frenzy_prefect.allocator.across import WAIT_BOUND, allocate_across
from frenzy_prefect.allocator.mixed import MIXED_GAIN, balanced, fit_layers, speed, worker_peaks, worth_mixing
from frenzy_prefect.allocator.step_time import predict_mixed_step, predict_step
from frenzy_prefect.errors import ClusterBusy, NoFeasiblePlan
from frenzy_prefect.profiling.model import PRESETS
from frenzy_prefect.spec.catalog import GPU_CATALOG
from frenzy_prefect.spec.cluster import ClusterSpec, ClusterState
from frenzy_prefect.spec.gpu import MemoryMargin
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.request import PlanPin


def best_single_s(model: str, req, gpu_type: str, count: int) -> float | None:
    found = best_single(model, req, gpu_type, count)
    return None if found is None else found.step_time_s


@pytest.mark.parametrize(("total", "speeds"), [(7, [3.0, 1.0]), (10, [1.0, 1.0, 1.0]), (9, [5.0, 2.0, 1.0])])
def test_balanced_deals_the_units_so_the_slowest_worker_is_least_slow(total, speeds):
    counts = balanced(total, speeds)
    assert sum(counts) == total and min(counts) >= 1
    best = min(
        max(c / s for c, s in zip(split, speeds, strict=True))
        for split in itertools.product(range(1, total + 1), repeat=len(speeds))
        if sum(split) == total
    )
    assert max(c / s for c, s in zip(counts, speeds, strict=True)) == pytest.approx(best)


def test_one_type_named_on_every_stage_predicts_what_the_single_type_model_does():
    model, work = PRESETS["gpt2-xl"], request("gpt2-xl", 64, "bf16").workload
    plan = ParallelPlan(dp=4, pp=2, micro_batch=4)
    mixed = plan.model_copy(update={"stage_types": ("A100-40GB", "A100-40GB")})
    expected = predict_step(model, plan, work, gpu=GPU_CATALOG["A100-40GB"], network_gbps=NETWORK_GBPS).seconds
    assert predict_mixed_step(model, mixed, work, gpus=GPU_CATALOG, network_gbps=NETWORK_GBPS).seconds == pytest.approx(expected)


def test_a_job_that_fits_neither_types_free_gpus_alone_fits_across_them():
    # gpt2-xl in fp32 with Adam: about 25 GB of model states, more than a free A10 or T4 holds.
    req = request("gpt2-xl", 16, "fp32")
    assert best_single_s("gpt2-xl", req, "A10", 1) is None and best_single_s("gpt2-xl", req, "T4", 1) is None
    found = best_mixed("gpt2-xl", req, A10=1, T4=1)
    assert found is not None and found.plan.stage_types == ("A10", "T4") and worth_mixing(found.step_s, None)
    a10, t4 = found.plan.stage_layers
    assert a10 > t4  # the faster type holds more of the model


def test_a_split_by_speed_that_does_not_fit_moves_layers_to_the_type_with_room():
    model, work = PRESETS["gpt2-xl"], request("gpt2-xl", 16, "fp32").workload
    plan = ParallelPlan(pp=2, micro_batch=1, recompute="full", stage_types=("A10", "T4"))
    by_speed = balanced(model.layers, [speed(GPU_CATALOG[t], "fp32") for t in plan.stage_types])
    found = fit_layers(model, plan, work, GPU_CATALOG, MemoryMargin())
    assert found is not None
    fitted, peaks = found
    assert fitted.stage_layers != by_speed and fitted.stage_layers[1] > by_speed[1]
    assert peaks == worker_peaks(model, fitted, work, GPU_CATALOG)
    for gpu_type, peak in zip(fitted.stage_types, peaks, strict=True):
        memory = GPU_CATALOG[gpu_type].memory_bytes
        assert peak <= memory - MemoryMargin().bytes_for(memory)


def test_where_two_types_are_balanced_a_mixed_plan_is_predicted_at_least_1_2x_faster():
    # 2 A100-40GB and 6 A10: about 280 and 260 dense bf16 TFLOP/s at their achievable fractions.
    req = request("gpt2-xl", 64, "bf16")
    single = min(s for s in (best_single_s("gpt2-xl", req, "A100-40GB", 2), best_single_s("gpt2-xl", req, "A10", 6)) if s)
    found = best_mixed("gpt2-xl", req, **{"A100-40GB": 2, "A10": 6})
    assert found is not None and single >= 1.2 * found.step_s, (found.plan.label(), found.step_s, single)
    assert worth_mixing(found.step_s, single)


def test_a_mixed_plan_is_not_worth_it_where_a_single_type_is_about_as_fast():
    # gpt2-large fits one A10; adding a T4 is predicted about 1% faster, within the model's doubt.
    req = request("gpt2-large", 16, "fp32")
    single = best_single_s("gpt2-large", req, "A10", 1)
    found = best_mixed("gpt2-large", req, A10=1, T4=1)
    assert single is not None and found is not None and found.step_s < single
    assert not worth_mixing(found.step_s, single)


def _allocate(model: str, req, cluster: ClusterSpec, state: ClusterState | None = None):
    """What the train-llm flow's allocate task decides: HAS's single-type allocation (None where
    none starts now), then the plan across types it may prefer."""
    state = state or ClusterState.idle(cluster)
    try:
        chosen = allocator.allocate(allocator.candidate_plans(PRESETS[model], req, cluster), state)
    except (ClusterBusy, NoFeasiblePlan):
        chosen = None
    return chosen, allocate_across(PRESETS[model], req, state, chosen)


def test_where_no_single_type_holds_the_job_has_allocates_it_across_types_in_rank_order():
    chosen, across = _allocate("gpt2-xl", request("gpt2-xl", 16, "fp32"), cluster_of(T4=1, A10=1))
    assert chosen is None and across is not None
    assert across.gpu_type == "A10+T4" and across.plan.stage_types == ("A10", "T4")  # the faster type first
    assert [p.node for p in across.placements] == ["A10-0", "T4-0"] and across.fits
    assert [w.gpu_type for w in across.workers] == ["A10", "T4"] and across.spare_bytes == min(w.spare_bytes for w in across.workers)


def test_a_mixed_plan_is_chosen_over_a_single_type_one_only_when_it_is_worth_it():
    chosen, across = _allocate("gpt2-xl", request("gpt2-xl", 64, "bf16"), cluster_of(**{"A100-40GB": 2, "A10": 6}))
    assert chosen is not None and across is not None and chosen.step_time_s >= MIXED_GAIN * across.step_time_s
    chosen, across = _allocate("gpt2-large", request("gpt2-large", 16, "fp32"), cluster_of(A10=1, T4=1))
    assert chosen is not None and chosen.gpu_type == "A10" and across is None  # 1.01x: one type is as good


def test_has_places_a_mixed_plan_only_on_free_gpus_and_keeps_pinned_or_recycle_runs_on_one_type():
    cluster = cluster_of(T4=1, A10=1)
    busy = ClusterState(cluster=cluster, free_gpus={"A10-0": [], "T4-0": [0]})
    assert _allocate("gpt2-xl", request("gpt2-xl", 16, "fp32"), cluster, busy) == (None, None)
    pinned = request("gpt2-xl", 16, "fp32").model_copy(update={"plan": PlanPin(pp=2)})
    recycle = request("gpt2-xl", 16, "fp32").model_copy(update={"resilience": "recycle"})
    for req in (pinned, recycle):
        assert allocate_across(PRESETS["gpt2-xl"], req, ClusterState.idle(cluster), None) is None


def test_a_run_that_would_wait_for_its_gpus_starts_across_types_only_within_twice_that_plans_step():
    cluster, req = cluster_of(A10=2, T4=1), request("gpt2-xl", 16, "fp32")
    waits_for = next(c for c in allocator.candidate_plans(PRESETS["gpt2-xl"], req, cluster) if c.fits)  # 2 A10s, pp 2
    busy = ClusterState(cluster=cluster, free_gpus={"A10-0": [], "A10-1": [0], "T4-0": [0]})
    with pytest.raises(ClusterBusy):
        allocator.allocate([waits_for], busy)
    # Across the free A10 and T4: 38.5 s a step against the 10.3 s it would wait for: it waits.
    assert allocate_across(PRESETS["gpt2-xl"], req, busy, None, waits_for) is None
    slower = waits_for.model_copy(update={"step_time_s": waits_for.step_time_s * 4})
    across = allocate_across(PRESETS["gpt2-xl"], req, busy, None, slower)
    assert across is not None and across.step_time_s <= WAIT_BOUND * slower.step_time_s
