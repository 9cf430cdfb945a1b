"""The caching allocator replayed (frenzy_prefect/caching_allocator.py) and the engine's step traced on fake
tensors (training/allocation_trace.py): the allocator's rules one by one, the trace against the
engine's measured peak on real ranks, and `frenzy estimate --reserved`. What the replay predicts
against a real GPU's ``max_memory_reserved`` is benchmarks/reserved_replay.py's (docs/memory.md)."""

from __future__ import annotations

import pytest

from frenzy_prefect.memory import estimate
from frenzy_prefect.memory.calibration import Calibration, GpuConstants
from frenzy_prefect.spec.catalog import GPU_CATALOG
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.workload import Workload
from frenzy_prefect.training.allocation_trace import replayed
from frenzy_prefect.training.measure import Measurement, measure
from tests.support.training import NANO

# The trace is the engine's own step: a pipeline (two ranks, one traced per stage) and tensor
# parallelism with full recomputation, each against MemTracker on real ranks.
TRACED = [
    ("1F1B pipeline", ParallelPlan(pp=2, micro_batch=1), "fp32"),
    ("tensor parallel, full recompute, bf16", ParallelPlan(tp=2, micro_batch=2, recompute="full"), "bf16"),
]


@pytest.mark.parametrize(("name", "plan", "precision"), TRACED, ids=[t[0] for t in TRACED])
def test_the_traced_tensor_peak_is_what_the_engine_holds_on_real_ranks(name, plan, precision):
    """On CPU kernels the trace holds what MemTracker measures; with the GPU's foreach optimizer
    kernels, what MARP predicts for a GPU (their temporaries span every tensor)."""
    measurement = Measurement(model=NANO, plan=plan, work=Workload(global_batch=4, seq_len=64, precision=precision))
    measured = {m.rank: m.breakdown.total for m in measure(measurement)}
    neutral = Calibration(gpus={"A10": GpuConstants()})  # the tensors as on a GPU, no runtime terms
    on_gpu = estimate(NANO, plan, measurement.work, gpu=GPU_CATALOG["A10"], calibration=neutral).per_stage
    for cpu, gpu in zip(replayed(measurement, on_gpu=False), replayed(measurement), strict=True):
        assert cpu.tensors_bytes == pytest.approx(measured[cpu.rank], rel=0.005), (cpu, measured)
        assert gpu.tensors_bytes == pytest.approx(on_gpu[gpu.stage].total, rel=0.01), (gpu, on_gpu)
        assert gpu.tensors_bytes <= gpu.allocated_bytes <= gpu.reserved_bytes
        assert gpu.allocated_bytes <= gpu.reserved_expandable_bytes
