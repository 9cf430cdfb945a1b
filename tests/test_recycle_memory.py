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
from frenzy_prefect.training.measure import Measurement, measure, recycle_schedule

pytestmark = pytest.mark.recycle_memory
WITHIN = 0.05


def _measured_and_predicted(preset: str, dp: int, pp: int, microbatches: int, failed: tuple) -> tuple[dict, dict, ParallelPlan, Workload]:
    model = PRESETS[preset]
    plan = ParallelPlan(dp=dp, pp=pp, micro_batch=1)
    work = Workload(global_batch=dp * microbatches, seq_len=64, precision="fp32")
    measured = {r.rank: r.breakdown.total for r in measure(Measurement(model=model, plan=plan, work=work, recycle_failed=failed))}
    predicted = schedule_peaks(model, plan, work, recycle_schedule(plan, microbatches, failed))
    by_worker = {(p, s): measured[plan.rank_of(s, p, 0)] for p, s in predicted}
    return by_worker, predicted, plan, work


@pytest.mark.parametrize(
    ("preset", "dp", "pp", "microbatches", "failed", "rerouted"),
    [
        ("gpt-nano", 2, 2, 4, (), None),
        ("gpt-nano", 2, 2, 4, ((1, 1),), (0, 1)),  # the last stage takes its failed peer's micro-batches
        ("gpt-nano", 2, 3, 6, ((1, 2),), (0, 2)),
        ("llama-nano", 2, 2, 4, ((1, 1),), (0, 1)),  # RMSNorm, SwiGLU, grouped-query attention, untied
    ],
    ids=["gpt-pp2-fault-free", "gpt-pp2-last-failed", "gpt-pp3-last-failed", "llama-pp2-last-failed"],
)
def test_every_workers_peak_under_recycles_schedule_is_predicted_within_5_percent(preset, dp, pp, microbatches, failed, rerouted):
    measured, predicted, plan, work = _measured_and_predicted(preset, dp, pp, microbatches, failed)
    assert len(predicted) == plan.gpus - len(failed)  # every live worker runs something
    for worker, bytes_ in predicted.items():
        assert bytes_ == pytest.approx(measured[worker], rel=WITHIN), (worker, bytes_, measured[worker])
    if rerouted is not None:
        # the worker that re-routes holds the most of its stage, and more than 1F1B's estimate of it says
        stage = rerouted[1]
        plain = estimate(PRESETS[preset], plan, work).per_stage[stage].total
        assert measured[rerouted] > 1.15 * plain and max(v for (p, s), v in measured.items() if s == stage) == measured[rerouted]


def test_held_bytes_counts_deferred_ws_apart_from_fused_backwards():
    f, b, w = ActionKind.F, ActionKind.B, ActionKind.W
    program = [Action(k, 0, j) for k, j in [(f, 0), (f, 1), (b, 0), (w, 0), (b, 1), (f, 2), (b, 2), (w, 1), (w, 2)]]
    # micro-batch 0: B then W at once (fused, never deferred); 1 and 2 wait for their W's
    assert held_bytes(program, forwarded=10, deferred=100) == 200  # after B of 2: micro-batches 1 and 2 deferred
    assert held_bytes(program[:2], forwarded=10, deferred=100) == 20
