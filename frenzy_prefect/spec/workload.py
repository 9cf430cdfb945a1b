"""What one optimizer step computes, apart from how it is split over GPUs: the batch, the sequence
length, the number formats, the optimizer and the attention kernel.

Every estimator (analytic, FSDP, Megatron), the step-time model, the pipeline's stage costs and
the training engine take one ``Workload`` beside the model and the plan; a ``TrainingRequest``
gives its own (``TrainingRequest.workload``), and ``frenzy estimate`` builds one from its options.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, model_validator

Precision = Literal["fp32", "bf16", "fp16"]
# flash: fused SDPA that keeps only the log-sum-exp for its backward; eager: scores and softmax
# materialised (and their dropout mask), as HF "eager" attention does.
Attention = Literal["flash", "eager"]

# Bounds beyond which a number describes no training run; they keep every search over them
# (the allocator's plans, the estimator's ranks) answering in about a second.
MAX_GLOBAL_BATCH = 1 << 24  # sequences per optimizer step (16,777,216; large published runs use a few thousand)
GlobalBatch = Annotated[int, Field(gt=0, le=MAX_GLOBAL_BATCH, description="Sequences per optimizer step, over all replicas.")]
SeqLen = Annotated[int, Field(gt=0, description="Tokens per sequence.")]
MasterWeights = Annotated[
    bool,
    Field(
        description=(
            "bf16/fp16 weights with fp32 master copies in the optimizer and fp32 gradient accumulation (Megatron-LM's and "
            "DeepSpeed's bf16 training); false: fp32 weights under autocast. Needs precision bf16 or fp16."
        )
    ),
]


# An Adam beta: the decay of a moving average, which torch's Adam and AdamW take in [0, 1).
Beta = Annotated[float, Field(ge=0.0, lt=1.0)]


class OptimizerSettings(BaseModel):
    """Frozen (and so hashable, like the Workload that holds it). Its numbers are finite: an
    infinite or NaN learning rate, decay or clip trains nothing."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: Literal["adamw", "adam", "sgd"] = "adamw"
    lr: PositiveFloat = 1e-3
    weight_decay: NonNegativeFloat = 0.0
    betas: tuple[Beta, Beta] = (0.9, 0.95)
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


def check_master_weights(precision: Precision, master_weights: bool) -> None:
    if master_weights and precision == "fp32":
        raise ValueError("master_weights keeps bf16 or fp16 weights beside fp32 masters: set precision bf16 or fp16 (got fp32)")


class Workload(BaseModel):
    """Frozen, so hashable: the estimators' caches key on it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    global_batch: GlobalBatch
    seq_len: SeqLen
    precision: Precision = "bf16"
    optimizer: OptimizerSettings = OptimizerSettings()
    attention: Attention = "flash"
    master_weights: MasterWeights = False

    @model_validator(mode="after")
    def _master_weights_need_half_precision(self) -> Workload:
        check_master_weights(self.precision, self.master_weights)
        return self

    @property
    def optimizer_bytes_per_param(self) -> int:
        """The optimizer's fp32 state per parameter it updates (Adam: 8, SGD with momentum: 4)."""
        return self.optimizer.state_bytes_per_parameter

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step."""
        return self.global_batch * self.seq_len
