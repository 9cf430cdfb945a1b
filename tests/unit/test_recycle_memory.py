"""ReCycle's schedules in memory (issue 30 item 4): the schedules the live runtime runs, fault-free
and re-routed around a failed worker, executed by the engine on real gloo ranks under MemTracker;
every worker's measured tensor peak against MARP's (``pipeline.in_flight.schedule_peaks``).

ReCycle's planner defers W's (a split backward), so its workers hold more micro-batches than
1F1B, and a worker that takes a failed peer's micro-batches more still; the deferred ones keep
the gradients their W needs. The plain 1F1B estimate misses both (shown below)."""

import pytest

from frenzy_prefect.memory.analytic import estimate
from frenzy_prefect.pipeline.in_flight import held_bytes, schedule_peaks
from frenzy_prefect.pipeline.schedule import Action, ActionKind
from frenzy_prefect.profiling.model import PRESETS
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.workload import Workload

pytestmark = pytest.mark.recycle_memory


def test_held_bytes_counts_deferred_ws_apart_from_fused_backwards():
    f, b, w = ActionKind.F, ActionKind.B, ActionKind.W
    program = [Action(k, 0, j) for k, j in [(f, 0), (f, 1), (b, 0), (w, 0), (b, 1), (f, 2), (b, 2), (w, 1), (w, 2)]]
    # micro-batch 0: B then W at once (fused, never deferred); 1 and 2 wait for their W's
    assert held_bytes(program, forwarded=10, deferred=100) == 200  # after B of 2: micro-batches 1 and 2 deferred
    assert held_bytes(program[:2], forwarded=10, deferred=100) == 20


@pytest.mark.parametrize(
    ("preset", "dp", "pp", "microbatches", "micro_batch", "seq_len", "precision"),
    [
        ("gpt-nano", 2, 3, 6, 1, 64, "fp32"),
        ("llama-nano", 3, 2, 4, 1, 64, "fp32"),
        ("gpt2-small", 2, 4, 8, 1, 1024, "bf16"),
        ("llama-3.1-8b", 4, 4, 8, 1, 4096, "bf16"),
    ],
)
def test_the_allocators_recycle_estimate_bounds_every_one_failure_schedule(preset, dp, pp, microbatches, micro_batch, seq_len, precision):
    """``recycle_estimate`` (what the allocator fits with ``resilience: recycle``) is at least every
    worker's predicted peak under every schedule ReCycle's planner makes with up to one failure,
    without planning them, and not far above (at most 1.5x); MARP's 1F1B estimate is below them."""
    from frenzy_prefect.memory.analytic import recycle_estimate
    from frenzy_prefect.pipeline.costs import StageCosts
    from frenzy_prefect.recycle.cache import PlanCache

    model = PRESETS[preset]
    plan = ParallelPlan(dp=dp, pp=pp, micro_batch=micro_batch)
    work = Workload(global_batch=dp * microbatches * micro_batch, seq_len=seq_len, precision=precision)
    worst = [0] * pp
    for cached in PlanCache(dp, pp, microbatches, StageCosts.uniform(pp), max_failures=1).plans.values():
        for (_, stage), peak in schedule_peaks(model, plan, work, cached.schedule).items():
            worst[stage] = max(worst[stage], peak)
    bound = [b.total for b in recycle_estimate(model, plan, work, failures=1).per_stage]
    plain = [b.total for b in estimate(model, plan, work).per_stage]
    assert all(w <= b <= 1.5 * w for w, b in zip(worst, bound, strict=True)), (worst, bound)
    assert all(p < w for p, w in zip(plain, worst, strict=True)), (plain, worst)


def test_a_recycle_request_is_fitted_with_its_schedules_memory():
    """The allocator fits a `resilience: recycle` request with recycle_estimate (the request's
    recycle_failures), so a plan whose 1F1B estimate fits but whose ReCycle schedules do not is
    not ranked as fitting."""
    from frenzy_prefect.allocator.plans import candidate_plans
    from frenzy_prefect.memory.analytic import recycle_estimate
    from frenzy_prefect.spec.cluster import ClusterSpec, Node
    from frenzy_prefect.spec.request import TrainingRequest

    cluster = ClusterSpec(name="four", nodes=[Node(name="n0", host="n0", gpu_type="A100-40GB", gpu_count=4)])
    pin = {"dp": 2, "pp": 2, "tp": 1, "zero": 0, "micro_batch": 1, "recompute": "none"}
    base = {"model": "gpt2-small", "dataset": "-", "global_batch": 64, "seq_len": 1024, "steps": 1, "plan": pin}
    plain = candidate_plans(PRESETS["gpt2-small"], TrainingRequest(**base), cluster)[0]
    for failures in (0, 1):
        request = TrainingRequest(**base, resilience="recycle", recycle_failures=failures)
        [chosen] = [c for c in candidate_plans(PRESETS["gpt2-small"], request, cluster) if c.plan == plain.plan]
        gpu = cluster.gpu_of(cluster.nodes[0])
        expected = recycle_estimate(PRESETS["gpt2-small"], chosen.plan, request.workload, failures=failures, gpu=gpu)
        assert chosen.memory == expected and chosen.memory.peak_bytes > plain.memory.peak_bytes
    assert plain.fits and not chosen.fits  # 32 micro-batches in flight per rank do not fit 40 GB; 1F1B's two do
