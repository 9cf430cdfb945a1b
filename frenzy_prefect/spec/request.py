"""What a data team asks for: train this model on this dataset with this global batch."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from frenzy_prefect.spec.dataset import Preparation
from frenzy_prefect.spec.names import NOT_BLANK_SCHEMA, named, refuse_blank

Precision = Literal["fp32", "bf16", "fp16"]
# flash: fused SDPA that keeps only the log-sum-exp for its backward; eager: scores and softmax
# materialised (and their dropout mask), as HF "eager" attention does.
Attention = Literal["flash", "eager"]


class OptimizerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Literal["adamw", "adam", "sgd"] = "adamw"
    lr: PositiveFloat = 1e-3
    weight_decay: NonNegativeFloat = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    momentum: NonNegativeFloat = Field(default=0.9, description="SGD only; 0 keeps no momentum buffer.")
    grad_clip: NonNegativeFloat = Field(default=1.0, description="Global gradient-norm clip; 0 disables.")
    warmup_steps: NonNegativeInt = 0
    schedule: Literal["constant", "cosine"] = "cosine"

    @property
    def state_bytes_per_parameter(self) -> int:
        """fp32 optimizer state per parameter: Adam keeps m and v, SGD a momentum buffer if any."""
        if self.name in ("adam", "adamw"):
            return 8
        return 4 if self.momentum > 0 else 0


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
    user pins part of it (``plan``)."""

    model_config = ConfigDict(extra="forbid")

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
    global_batch: PositiveInt = Field(description="Sequences per optimizer step, over all replicas.")
    seq_len: PositiveInt = Field(description="Tokens per sequence.")
    steps: PositiveInt = Field(description="Optimizer steps to train.")
    precision: Precision = "bf16"
    attention: Attention = "flash"
    master_weights: bool = Field(
        default=False,
        description=(
            "bf16/fp16 weights with fp32 master copies in the optimizer and fp32 gradient accumulation (Megatron-LM's and "
            "DeepSpeed's bf16 training); false: fp32 weights under autocast. Needs precision bf16 or fp16."
        ),
    )
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

    @model_validator(mode="after")
    def _master_weights_need_half_precision(self) -> TrainingRequest:
        check_master_weights(self.precision, self.master_weights)
        return self


def check_master_weights(precision: Precision, master_weights: bool) -> None:
    if master_weights and precision == "fp32":
        raise ValueError("master_weights keeps bf16 or fp16 weights beside fp32 masters: set precision bf16 or fp16 (got fp32)")
