"""Parallel plans, their predicted memory, and the allocator's decision."""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    computed_field,
    model_validator,
)

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.spec.cluster import ClusterSpec
from frenzy_prefect.spec.dataset import DatasetInfo
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.request import TrainingRequest
from frenzy_prefect.units import gib

Recompute = Literal["none", "selective", "full"]
# More GPUs than one job is given anywhere (the largest published training runs used about
# 16,000): it bounds every loop over a plan's ranks (estimate's JSON lists each one).
MAX_GPUS = 1 << 16


@lru_cache(maxsize=1024)
def even_layers(layers: int, pp: int) -> tuple[int, ...]:
    """Layers per pipeline stage, split evenly; the first stages take the remainder."""
    base, extra = divmod(layers, pp)
    return tuple(base + (1 if s < extra else 0) for s in range(pp))


class ParallelPlan(BaseModel):
    """How one job is split: global_batch = dp * micro_batch * accumulation steps."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dp: PositiveInt = 1
    tp: PositiveInt = 1
    pp: PositiveInt = 1
    micro_batch: PositiveInt = 1
    zero: Literal[0, 1, 2, 3] = 0
    recompute: Recompute = "none"
    stage_layers: tuple[PositiveInt, ...] | None = Field(
        default=None,
        description="Layers of each pipeline stage, first to last, summing to the model's (an uneven split: a faster stage "
        "takes more); None: even, the first stages taking the remainder.",
    )
    replica_micro_batches: tuple[PositiveInt, ...] | None = Field(
        default=None,
        description="Micro-batches of each data-parallel replica per step, first to last, which with micro_batch add up to "
        "the global batch (uneven: a faster replica takes more); None: the global batch split evenly.",
    )
    stage_types: tuple[str, ...] | None = Field(
        default=None,
        description="A plan across GPU types: the type of each pipeline stage, first to last (every replica alike); None: "
        "the allocation's one type.",
    )
    replica_types: tuple[str, ...] | None = Field(
        default=None,
        description="A plan across GPU types: the type of each data-parallel replica (every stage of it); None: the "
        "allocation's one type. At most one of stage_types and replica_types.",
    )

    @model_validator(mode="after")
    def _within_max_gpus(self) -> ParallelPlan:
        if self.gpus > MAX_GPUS:
            raise ValueError(f"dp x tp x pp = {self.dp} x {self.tp} x {self.pp} = {self.gpus:,} GPUs; a plan has at most {MAX_GPUS:,} GPUs")
        for name, values, size, axis in (
            ("stage_layers", self.stage_layers, self.pp, "stage"),
            ("replica_micro_batches", self.replica_micro_batches, self.dp, "replica"),
            ("stage_types", self.stage_types, self.pp, "stage"),
            ("replica_types", self.replica_types, self.dp, "replica"),
        ):
            if values is not None and len(values) != size:
                degree = "pp" if axis == "stage" else "dp"
                raise ValueError(f"{name} gives {len(values)} values and {degree} is {size}: give one per {axis}")
        if self.stage_types is not None and self.replica_types is not None:
            raise ValueError("a plan gives stage_types or replica_types, not both: its types differ along the pipeline or across replicas")
        return self

    def layer_split(self, layers: int) -> tuple[int, ...]:
        """Layers of each stage of a model of ``layers`` layers."""
        if self.pp > layers:
            raise FrenzyError(f"pp ({self.pp}) must not exceed the number of layers ({layers}); accepted: 1..{layers}")
        if self.stage_layers is None:
            return even_layers(layers, self.pp)
        if sum(self.stage_layers) != layers:
            split = "+".join(map(str, self.stage_layers))
            raise FrenzyError(f"stage_layers ({split} = {sum(self.stage_layers)}) must add up to the model's {layers} layers")
        return self.stage_layers

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def worker_types(self) -> tuple[str, ...]:
        """A plan across types: the type of each stage (``stage_types``) or replica (``replica_types``), in order; () on one type."""
        return self.stage_types or self.replica_types or ()

    def gpus_by_type(self) -> dict[str, int]:
        """A plan across types: how many GPUs of each type, in the order the plan first names
        them ({} for a plan on the allocation's one type)."""
        counts: dict[str, int] = {}
        for t in self.stage_types or ():
            counts[t] = counts.get(t, 0) + self.dp * self.tp
        for t in self.replica_types or ():
            counts[t] = counts.get(t, 0) + self.pp * self.tp
        return counts

    def accumulation(self, global_batch: int) -> int:
        """Micro-batches per replica per step: the most any replica runs (with an even split, each's)."""
        if self.replica_micro_batches is not None:
            return max(self.replica_accumulation(global_batch))
        per_step = self.dp * self.micro_batch  # (the plan search asks this of every plan: no tuple)
        if global_batch % per_step:
            raise FrenzyError(
                f"global_batch ({global_batch}) must be divisible by dp * micro_batch ({self.dp} * {self.micro_batch} = {per_step})"
            )
        return global_batch // per_step

    def replica_accumulation(self, global_batch: int) -> tuple[int, ...]:
        """Micro-batches of each replica per step."""
        if self.replica_micro_batches is None:
            return (self.accumulation(global_batch),) * self.dp
        counts, total = self.replica_micro_batches, sum(self.replica_micro_batches) * self.micro_batch
        if total != global_batch:
            split = "+".join(map(str, counts))
            raise FrenzyError(
                f"replica_micro_batches ({split}) x micro_batch ({self.micro_batch}) = {total} samples, "
                f"not the global_batch ({global_batch}): give counts that add up to {global_batch // self.micro_batch}"
            )
        return counts

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(pipeline stage, data-parallel replica, tensor-parallel rank) of a global rank; ranks
        are numbered stage-major with tensor parallelism innermost, so a TP group is adjacent."""
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp

    def rank_of(self, stage: int, replica: int, tp_rank: int) -> int:
        return (stage * self.dp + replica) * self.tp + tp_rank

    def label(self) -> str:
        def each(name: str, values: tuple | None) -> str:
            return f" {name}={'/'.join(map(str, values))}" if values else ""

        replicas = each("batches", self.replica_micro_batches) + each("on", self.replica_types)
        stages = each("layers", self.stage_layers) + each("on", self.stage_types)
        return f"dp={self.dp}{replicas} tp={self.tp} pp={self.pp}{stages} mb={self.micro_batch} zero={self.zero} recompute={self.recompute}"


class MemoryBreakdown(BaseModel):
    """Peak bytes on one GPU, by what holds them."""

    model_config = ConfigDict(frozen=True)

    params: NonNegativeInt
    grads: NonNegativeInt
    optimizer: NonNegativeInt
    activations: NonNegativeInt
    other: NonNegativeInt

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.other


class MemoryEstimate(BaseModel):
    """One breakdown per pipeline stage (every rank of a stage holds the same)."""

    model_config = ConfigDict(frozen=True)

    per_stage: list[MemoryBreakdown] = Field(min_length=1)

    @property
    def peak_bytes(self) -> int:
        return max(b.total for b in self.per_stage)

    @property
    def peak_stage(self) -> MemoryBreakdown:
        return max(self.per_stage, key=lambda b: b.total)


class WorkerFit(BaseModel):
    """A plan across GPU types: one stage (``stage_types``) or replica (``replica_types``) on its
    type, its predicted peak there (tensors and that type's runtime) and that type's memory and margin."""

    model_config = ConfigDict(frozen=True)

    gpu_type: str
    peak_bytes: NonNegativeInt
    gpu_memory_bytes: PositiveInt
    margin_bytes: NonNegativeInt

    @property
    def spare_bytes(self) -> int:
        return self.gpu_memory_bytes - self.margin_bytes - self.peak_bytes


class PlanCandidate(BaseModel):
    """A plan on a GPU type, with its predicted memory and step time. It fits when its
    predicted peak (tensors and the GPU around them) plus the safety margin is within the GPU's
    memory: ``spare_bytes`` is what is left beyond both (negative: the shortfall). A plan across
    types (``gpu_type`` names them, e.g. ``A10+T4``) fits when each of its ``workers`` does;
    its memory and margin fields are then those of the worker with the least to spare."""

    model_config = ConfigDict(frozen=True)

    gpu_type: str
    plan: ParallelPlan
    memory: MemoryEstimate
    gpu_memory_bytes: PositiveInt
    step_time_s: PositiveFloat
    margin_bytes: NonNegativeInt = Field(default=0, description="Memory kept free beyond the predicted peak (spec.gpu.MemoryMargin).")
    total_time_s: PositiveFloat | None = Field(default=None, description="Predicted time of all the request's steps.")
    cost: NonNegativeFloat | None = Field(default=None, description="Predicted cost of that time on its GPUs (the cluster's prices).")
    workers: list[WorkerFit] | None = Field(
        default=None, description="A plan across GPU types: each stage's or replica's fit on its own type, in rank order."
    )

    @computed_field  # type: ignore[prop-decorator]
    @property
    def spare_bytes(self) -> int:
        if self.workers:
            return min(w.spare_bytes for w in self.workers)
        return self.gpu_memory_bytes - self.margin_bytes - self.memory.peak_bytes

    @property
    def fits(self) -> bool:
        return self.spare_bytes >= 0

    def gpus_by_type(self) -> dict[str, int]:
        """GPUs of each type it needs, in rank order (one type: all of them)."""
        return self.plan.gpus_by_type() or {self.gpu_type: self.plan.gpus}

    def fit_summary(self) -> str:
        """How it fits, in a sentence: its peak against its GPU, or across types each worker's on its own type."""
        spare = f"fits with {gib(self.spare_bytes, 1)} GiB to spare"
        if self.workers:
            each = ", ".join(f"{w.gpu_type} {gib(w.peak_bytes, 1)} of {gib(w.gpu_memory_bytes, 1)} GiB" for w in self.workers)
            return f"predicted peak per stage or replica, on its type: {each}; {spare} (each type's margin kept)"
        return (
            f"predicted peak {gib(self.memory.peak_bytes, 1)} GiB of {gib(self.gpu_memory_bytes, 1)} GiB per GPU: "
            f"{spare} (margin {gib(self.margin_bytes, 1)} GiB kept)"
        )


class Placement(BaseModel):
    """GPUs of one node given to a job."""

    model_config = ConfigDict(frozen=True)

    node: str
    host: str
    gpus: list[NonNegativeInt] = Field(min_length=1)


class Allocation(PlanCandidate):
    """The allocator's decision: a candidate plan, placed on nodes."""

    placements: list[Placement] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_count(self) -> Allocation:
        placed = sum(len(p.gpus) for p in self.placements)
        if placed != self.plan.gpus:
            raise ValueError(f"placements hold {placed} GPUs but the plan needs {self.plan.gpus}")
        return self


JOB_ENV = "FRENZY_TRAINING_JOB"  # the environment variable that carries a TrainingJob (JSON) to its ranks


class TrainingJob(BaseModel):
    """Everything the ranks need to train: the request, the resolved model and dataset, and the allocation."""

    model_config = ConfigDict(frozen=True)

    request: TrainingRequest
    model: ModelSpec
    dataset: DatasetInfo
    allocation: Allocation
    cluster: ClusterSpec = Field(description="The inventory it was allocated on; its name scopes the GPU reservations.")
    output: str = Field(description="URI prefix that receives the checkpoints, metrics.json and report.json.")
    run: str = Field(
        default="local",
        description="The run the checkpoints belong to (the train-llm flow run's id, which a retry keeps): it resumes from "
        "its own checkpoints only.",
    )
    purpose: Literal["train", "check"] = Field(
        default="train", description="check: `frenzy cluster check`'s smoke check of a node, its ranks training nothing."
    )
    pinned: bool = Field(
        default=False,
        description="The pool's queue places it on its placements' nodes only (a node's check), not on any of its GPU type.",
    )

    def _under_output(self, name: str) -> str:
        return f"{self.output.rstrip('/')}/{name}"

    @property
    def checkpoint_uri(self) -> str:
        """This run's checkpoints: one step-NNNNNN/ directory each (see training/checkpoint.py)."""
        return self._under_output(f"checkpoints/{self.run}")

    @property
    def metrics_uri(self) -> str:
        return self._under_output("metrics.json")

    @property
    def report_uri(self) -> str:
        return self._under_output("report.json")
