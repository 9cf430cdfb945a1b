"""ReCycle's schedules in memory (issue 30 item 4): the schedules the live runtime runs, fault-free
and re-routed around a failed worker, executed by the engine on real gloo ranks under MemTracker;
every worker's measured tensor peak against MARP's (``pipeline.in_flight.schedule_peaks``).

ReCycle's planner defers W's (a split backward), so its workers hold more micro-batches than
1F1B, and a worker that takes a failed peer's micro-batches more still; the deferred ones keep
the gradients their W needs. The plain 1F1B estimate misses both (shown below)."""

import pytest

from frenzy_prefect.memory.analytic import estimate
from frenzy_prefect.pipeline.in_flight import schedule_peaks
from frenzy_prefect.profiling.model import PRESETS
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.workload import Workload
from frenzy_prefect.training.measure import Measurement, measure, recycle_schedule

pytestmark = pytest.mark.recycle_memory

WITHIN = 0.05


def _measured_and_predicted(
    preset: str, dp: int, pp: int, microbatches: int, failed: tuple, precision: str = "fp32"
) -> tuple[dict, dict, ParallelPlan, Workload]:
    model = PRESETS[preset]
    plan = ParallelPlan(dp=dp, pp=pp, micro_batch=1)
    work = Workload(global_batch=dp * microbatches, seq_len=64, precision=precision)
    measured = {r.rank: r.breakdown.total for r in measure(Measurement(model=model, plan=plan, work=work, recycle_failed=failed))}
    predicted = schedule_peaks(model, plan, work, recycle_schedule(plan, microbatches, failed))
    by_worker = {(p, s): measured[plan.rank_of(s, p, 0)] for p, s in predicted}
    return by_worker, predicted, plan, work


@pytest.mark.parametrize(
    ("preset", "dp", "pp", "microbatches", "failed", "rerouted", "precision"),
    [
        ("gpt-nano", 2, 2, 4, (), None, "fp32"),
        ("gpt-nano", 2, 2, 4, ((1, 1),), (0, 1), "fp32"),  # the last stage takes its failed peer's micro-batches
        ("gpt-nano", 2, 3, 6, ((1, 2),), (0, 2), "fp32"),
        ("llama-nano", 2, 2, 4, ((1, 1),), (0, 1), "fp32"),  # RMSNorm, SwiGLU, grouped-query attention, untied
        # bf16 weights: the deferred W's projection gradients in the compute dtype, the norms' in fp32
        ("gpt-nano", 2, 2, 4, ((1, 1),), (0, 1), "bf16"),
        ("llama-nano", 2, 2, 4, ((1, 1),), (0, 1), "bf16"),
    ],
    ids=["gpt-pp2-fault-free", "gpt-pp2-last-failed", "gpt-pp3-last-failed", "llama-pp2-last-failed", "gpt-bf16", "llama-bf16"],
)
def test_every_workers_peak_under_recycles_schedule_is_predicted_within_5_percent(
    preset, dp, pp, microbatches, failed, rerouted, precision
):
    measured, predicted, plan, work = _measured_and_predicted(preset, dp, pp, microbatches, failed, precision)
    assert len(predicted) == plan.gpus - len(failed)  # every live worker runs something
    for worker, bytes_ in predicted.items():
        assert bytes_ == pytest.approx(measured[worker], rel=WITHIN), (worker, bytes_, measured[worker])
    if rerouted is not None:
        # the worker that re-routes holds the most of its stage, and more than 1F1B's estimate of it says
        stage = rerouted[1]
        plain = estimate(PRESETS[preset], plan, work).per_stage[stage].total
        assert measured[rerouted] > 1.15 * plain and max(v for (p, s), v in measured.items() if s == stage) == measured[rerouted]
