"""What a training run produced, and the report a pipeline gets back."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from frenzy_prefect.spec.plan import Allocation


class SurvivedFailure(BaseModel):
    """A change of the ranks a run trained through without a restart (resilience 'recycle'): ranks
    that failed (their stage's peers took their micro-batches), a re-plan of the live ranks to a
    smaller layout from a checkpoint, or ranks that rejoined (and, after a re-plan, the run's own
    plan resumed from a checkpoint)."""

    model_config = ConfigDict(frozen=True)

    at: str = Field(description="When the survivors had re-formed (UTC, ISO 8601).")
    step: int = Field(description="The step that was interrupted and run again, or (replanned, rejoined) the first step after the change.")
    kind: Literal["failed", "replanned", "rejoined"]
    ranks: list[int] = Field(description="The ranks that failed or rejoined; replanned: the ranks of the smaller layout.")
    downtime_s: float = Field(
        description="From the failure's detection to training again (rejoined: the state copy; replanned: the switch)."
    )
    tokens_per_s_before: float | None = Field(default=None, description="Over up to 5 steps before, as the writing rank timed them.")
    tokens_per_s_after: float | None = Field(default=None, description="Over up to 5 steps after (the interrupted step excluded).")
    in_flight: int | None = Field(
        default=None,
        description="When the planner's schedule for the ranks left would not fit the GPUs: the most micro-batches each worker "
        "held in flight under the schedule they ran instead.",
    )
    plan: str | None = Field(default=None, description="Replanned, or rejoined after a re-plan: the plan trained from this step.")


class RankPeak(BaseModel):
    """One rank's memory at its peak over the attempt, as its GPU's caching allocator counted it."""

    model_config = ConfigDict(frozen=True)

    rank: int
    allocated_bytes: int = Field(description="torch.cuda.max_memory_allocated: the tensors' blocks.")
    reserved_bytes: int = Field(description="torch.cuda.max_memory_reserved: what the allocator held.")
    outside_allocator_bytes: int = Field(description="Device memory in use beyond the allocator's (CUDA context, NCCL), at the end.")


class TrainingResult(BaseModel):
    """Written by rank 0 as metrics.json beside the checkpoint, once the checkpoint is complete."""

    model_config = ConfigDict(frozen=True)

    steps: int
    losses: list[float] = Field(description="Mean training loss per optimizer step, over all ranks.")
    checkpoint: str
    world_size: int
    backend: str
    wall_s: float = Field(description="From the start of training (joining the process group included) to the last step.")
    tokens_per_s: float = Field(description="Trained tokens over wall_s, all ranks together.")
    first_step: int = Field(default=1, description="The first step this attempt trained: 1, or the one after the checkpoint resumed from.")
    step_s: list[float] = Field(default=[], description="Rank 0's wall time of each step this attempt trained, checkpoints excluded.")
    checkpoint_s: list[float] = Field(default=[], description="Rank 0's wall time of each checkpoint this attempt wrote.")
    failures: list[SurvivedFailure] = Field(default=[], description="Failures trained through without a restart, and rejoins.")
    rank_peaks: list[RankPeak] = Field(default=[], description="Every rank's memory peak, on GPUs (none on CPU).")


class TrainingReport(BaseModel):
    """The whole `train_llm` run in one object (also written as report.json)."""

    model_config = ConfigDict(frozen=True)

    model: str
    parameters: int
    allocation: Allocation
    result: TrainingResult
    training_flow_run: str

    @property
    def loss_start(self) -> float:
        return self.result.losses[0]

    @property
    def loss_end(self) -> float:
        return self.result.losses[-1]
