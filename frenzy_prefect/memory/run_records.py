"""What a training run measured, kept so the next plan can learn from it: per rank the predicted
and measured peaks, and the predicted and measured step time, with the model, the plan, the
workload and the GPU type. A cluster's records form its calibration store, one JSON document
(``CalibrationStore``), bounded by keeping the newest records per (GPU type, model, plan shape).
``scripts/gpu-check`` writes its measurements in this format.
"""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.workload import Workload
from frenzy_prefect.storage import open_uri

KEEP_PER_SHAPE = 5  # records kept per (GPU type, model, plan, workload): the newest


class RankRecord(BaseModel):
    """One rank's peak: MARP's prediction of the tensors beside what was measured (MemTracker's
    tensors on CPU; on a GPU also the caching allocator's peaks and the memory outside it)."""

    model_config = ConfigDict(frozen=True)

    rank: NonNegativeInt
    stage: NonNegativeInt
    predicted_tensors_bytes: NonNegativeInt
    measured_tensors_bytes: NonNegativeInt | None = None
    predicted_reserved_bytes: NonNegativeInt | None = Field(
        default=None, description="The caching allocator replayed over the traced step."
    )
    allocated_bytes: NonNegativeInt | None = None  # torch.cuda.max_memory_allocated
    reserved_bytes: NonNegativeInt | None = None  # torch.cuda.max_memory_reserved
    outside_allocator_bytes: NonNegativeInt | None = None  # the CUDA context and what else the driver holds

    @property
    def device_bytes(self) -> int | None:
        """What the GPU held at the peak."""
        return None if self.reserved_bytes is None else self.reserved_bytes + (self.outside_allocator_bytes or 0)


class RunRecord(BaseModel):
    model_config = ConfigDict(frozen=True)

    source: str = Field(description="What ran: a flow run's id, or the check that measured it.")
    recorded_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    gpu_type: str | None = Field(description="The catalog type it ran on; None: CPU.")
    device_name: str | None = None
    model: ModelSpec
    plan: ParallelPlan
    work: Workload
    ranks: list[RankRecord] = Field(min_length=1)
    predicted_step_s: PositiveFloat | None = None
    measured_step_s: PositiveFloat | None = Field(default=None, description="Median of the steps after the first.")
    tokens_per_s: PositiveFloat | None = None
    baseline_tokens_per_s: PositiveFloat | None = Field(default=None, description="A bare training loop of the same model and batch.")

    @property
    def worst_rank(self) -> RankRecord:
        """The rank whose GPU held most (on CPU: whose measured tensors were largest)."""
        return max(self.ranks, key=lambda k: (k.device_bytes or 0, k.measured_tensors_bytes or 0))

    def shape(self) -> tuple:
        return (self.gpu_type, self.model.name, self.plan.label(), self.work.precision, self.work.seq_len, self.work.global_batch)


class CalibrationStore(BaseModel):
    """A cluster's records, newest last."""

    cluster: str
    records: list[RunRecord] = Field(default_factory=list)

    def add(self, *records: RunRecord) -> CalibrationStore:
        """This store with ``records`` appended, keeping the newest KEEP_PER_SHAPE of each shape."""
        merged = [*self.records, *records]
        kept: dict[tuple, int] = {}
        out = []
        for record in reversed(merged):
            n = kept.get(record.shape(), 0)
            if n < KEEP_PER_SHAPE:
                kept[record.shape()] = n + 1
                out.append(record)
        return self.model_copy(update={"records": out[::-1]})

    def on(self, gpu_type: str | None) -> list[RunRecord]:
        return [r for r in self.records if r.gpu_type == gpu_type]

    @classmethod
    def load(cls, uri: str) -> CalibrationStore:
        """The store at ``uri`` (a path or fsspec URI); an unreadable one is named in the error."""
        try:
            with open_uri(uri, "r") as f:
                return cls.model_validate_json(f.read())
        except (OSError, ValueError) as exc:
            raise FrenzyError(f"cannot read calibration store {uri}: {' '.join(str(exc).split())[:300]}") from None
