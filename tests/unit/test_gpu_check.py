"""scripts/gpu-check, run here as CI runs it: on a machine without a GPU it says so, measures its
CPU part and writes a calibration store (memory/run_records.py) that validates."""

from __future__ import annotations

from benchmarks.gpu_check import catalog_type
from frenzy_prefect.memory.run_records import KEEP_PER_SHAPE, CalibrationStore, RankRecord, RunRecord
from frenzy_prefect.profiling.model import PRESETS
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.workload import Workload


def test_a_cuda_devices_name_is_its_catalog_type():
    names = {
        "NVIDIA H200": "H200",
        "NVIDIA H100 80GB HBM3": "H100",
        "NVIDIA A100-SXM4-40GB": "A100-40GB",
        "NVIDIA A100-SXM4-80GB": "A100-80GB",
        "NVIDIA A10": "A10",
        "Tesla V100-SXM2-32GB": "V100-32GB",
        "NVIDIA GeForce RTX 4090": "RTX-4090",
        "Some Future GPU": None,
    }
    assert {name: catalog_type(name) for name in names} == names


def test_the_store_keeps_the_newest_records_of_each_shape():
    def record(source: str, micro_batch: int) -> RunRecord:
        rank = RankRecord(rank=0, stage=0, predicted_tensors_bytes=1)
        work = Workload(global_batch=micro_batch, seq_len=64)
        return RunRecord(
            source=source, gpu_type="A10", model=PRESETS["gpt-nano"], plan=ParallelPlan(micro_batch=micro_batch), work=work, ranks=[rank]
        )

    store = CalibrationStore(cluster="c").add(*(record(f"r{i}", 1) for i in range(KEEP_PER_SHAPE + 3)), record("other", 2))
    assert [r.source for r in store.records] == [f"r{i}" for i in range(3, KEEP_PER_SHAPE + 3)] + ["other"]
    assert CalibrationStore.model_validate_json(store.model_dump_json()) == store
    assert store.on("A10") == store.records and store.on(None) == []
