"""What a data team asks for: train this model on this dataset with this global batch."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from frenzy_prefect.spec.dataset import Preparation
from frenzy_prefect.spec.names import NOT_BLANK_SCHEMA, named, refuse_blank
from frenzy_prefect.spec.workload import (
    Attention,
    GlobalBatch,
    MasterWeights,
    OptimizerSettings,
    Precision,
    SeqLen,
    Workload,
    check_master_weights,
)


class PlanPin(BaseModel):
    """Parts of the parallel plan a user fixes (a Megatron user's tp and pp, say); the allocator
    chooses the rest, the GPU type and the nodes, and still refuses a plan that does not fit."""

    model_config = ConfigDict(extra="forbid")

    dp: PositiveInt | None = None
    tp: PositiveInt | None = None
    pp: PositiveInt | None = None
    micro_batch: PositiveInt | None = None
    zero: Literal[0, 1, 2, 3] | None = None
    recompute: Literal["none", "selective", "full"] | None = None

    def admits(self, plan: Any) -> bool:
        """Whether ``plan`` (a ParallelPlan) has every field pinned here."""
        return all(getattr(plan, name) == value for name, value in self.model_dump(exclude_none=True).items())

    def label(self) -> str:
        return " ".join(f"{name}={value}" for name, value in self.model_dump(exclude_none=True).items()) or "nothing pinned"


# A mapping is a config itself; a string names one, so it may not be blank (refused before the
# union tries both, for one error rather than one per member).
ModelField = Annotated[
    Annotated[str, NOT_BLANK_SCHEMA] | dict[str, Any],
    refuse_blank("a preset name (see `frenzy presets`), the path or URI of a config.json, or the config as a mapping"),
]
DatasetUri = named("the dataset's URI, e.g. s3://bucket/data/train.bin or a prefix of raw text")
OutputUri = named("a URI prefix, e.g. s3://bucket/runs/, or no value for the default beside the dataset")

Resilience = Literal["restart", "recycle"]
Objective = Literal["time", "cost"]


class TrainingRequest(BaseModel):
    """The serverless interface: no GPU type or count is named here, nor parallelism unless the
    user pins part of it (``plan``). Its numbers are finite (no inf or NaN: no value means none)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: ModelField = Field(
        description=("A preset name (see `frenzy presets`), a path or URI of an HF-style config.json, or the config itself as a mapping."),
    )
    dataset: DatasetUri = Field(
        description=(
            "URI of the dataset: *.txt (UTF-8 bytes as tokens), *.bin (uint16 token ids), a prepared dataset (its manifest.json "
            "or folder), or raw text to prepare first: a prefix (or file) of *.txt, *.jsonl and *.parquet files."
        ),
    )
    prepare: Preparation | None = Field(
        default=None,
        description=(
            "How to prepare raw text into token shards (tokenizer, text_field, ...). A dataset that is not token data is prepared "
            "with the defaults (a byte-level BPE of the model's vocab_size trained on it); set this to prepare a *.txt file too."
        ),
    )
    global_batch: GlobalBatch
    seq_len: SeqLen
    steps: PositiveInt = Field(description="Optimizer steps to train.")
    precision: Precision = "bf16"
    attention: Attention = "flash"
    master_weights: MasterWeights = False
    optimizer: OptimizerSettings = Field(default_factory=OptimizerSettings)
    plan: PlanPin | None = Field(
        default=None,
        description="Fix parts of the parallel plan, e.g. {'tp': 2, 'pp': 2}; the allocator chooses the rest. Default: all of it.",
    )
    seed: NonNegativeInt = 0
    output: OutputUri | None = Field(
        default=None,
        description="URI prefix for the checkpoint and metrics; default: beside the dataset under frenzy-runs/.",
    )
    log_every: PositiveInt = Field(default=10, description="Log the loss every this many steps.")
    checkpoint_every: PositiveInt | None = Field(
        default=None,
        description=(
            "Write a sharded checkpoint every this many steps (and after the last). Default: after the first step, then "
            "as often as keeps checkpointing within 5% of training time (the last checkpoint's measured save time "
            "over 5% of a step's)."
        ),
    )
    keep_checkpoints: PositiveInt = Field(default=2, description="Complete checkpoints kept; older ones are deleted.")
    max_restarts: NonNegativeInt = Field(
        default=0,
        description="Restarts of all ranks after a rank fails (torchrun's --max-restarts); each resumes from the last checkpoint.",
    )

    resilience: Resilience = Field(
        default="restart",
        description=(
            "What a rank's failure does. 'restart': the run fails, or torchrun restarts every rank from the last checkpoint "
            "(max_restarts). 'recycle' (ReCycle): the failed stage's micro-batches run on its live peers in the other "
            "pipelines, without a restart, and a replacement rank rejoins at an iteration boundary; needs a ZeRO-0 "
            "pipeline plan with dp >= 2 and pp >= 2."
        ),
    )
    recycle_failures: NonNegativeInt = Field(
        default=1,
        description=(
            "With resilience 'recycle': how many failed workers of one stage a plan must hold in memory, their micro-batches "
            "re-routed to the stage's survivors (the allocator's fit test; 0: only the fault-free schedule)."
        ),
    )
    objective: Objective = Field(
        default="time",
        description="Which fitting plan to run: the fastest ('time') or the cheapest ('cost': needs prices in the cluster).",
    )
    deadline_hours: PositiveFloat | None = Field(
        default=None,
        description="Only plans predicted to finish all steps within this many hours (with objective 'cost': the cheapest such).",
    )
    max_replacements: NonNegativeInt = Field(
        default=3,
        description="Resilience 'recycle': how many times a failed rank's trainer is started again to rejoin (0: train on without it).",
    )
    replan_after_s: NonNegativeFloat | Literal["auto"] | None = Field(
        default="auto",
        description=(
            "Resilience 'recycle': how long a failed rank may stay away before the live ranks re-plan to a smaller layout "
            "over themselves from a checkpoint, when one is predicted faster than re-routing ('auto': once re-routing has "
            "lost what switching there and back costs; None: re-route until it returns). A returning rank is absorbed."
        ),
    )

    @model_validator(mode="after")
    def _master_weights_need_half_precision(self) -> TrainingRequest:
        check_master_weights(self.precision, self.master_weights)
        if self.optimizer.warmup_steps > self.steps:
            raise ValueError(
                f"optimizer.warmup_steps ({self.optimizer.warmup_steps}) exceeds steps ({self.steps}): "
                f"the learning rate would never reach lr; accepted: 0 to {self.steps}"
            )
        return self

    @property
    def workload(self) -> Workload:
        """What each of the request's optimizer steps computes (the estimators' and the engine's input)."""
        return Workload(
            global_batch=self.global_batch,
            seq_len=self.seq_len,
            precision=self.precision,
            optimizer=self.optimizer,
            attention=self.attention,
            master_weights=self.master_weights,
        )


__all__ = ["Attention", "OptimizerSettings", "PlanPin", "Precision", "TrainingRequest", "Workload", "check_master_weights"]
