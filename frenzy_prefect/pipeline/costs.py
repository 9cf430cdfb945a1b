"""What each action of a pipeline schedule costs, per stage: the timeline's only input about time.

F, B and W are seconds per micro-batch of forward, input-gradient backward and weight-gradient
backward on one worker of the stage; ``p2p_s`` is one activation (or gradient) send between
stages; ``gradient_transfer_s`` is the stage's gradient bytes over one link, so a ring all-reduce
over n live peers takes 2(n - 1)/n of it; ``optimizer_s`` is the stage's optimizer step.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, model_validator

from frenzy_prefect.allocator.step_time import (
    boundary_activation_bytes,
    optimizer_step_s,
    predict_step,
    ring_all_reduce_factor,
    tensor_parallel_s,
)
from frenzy_prefect.memory.analytic import FP32
from frenzy_prefect.pipeline.workers import ScheduleInputError
from frenzy_prefect.spec.gpu import GpuType
from frenzy_prefect.spec.layout import stage_parameters
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.workload import Workload

# Zero Bubble's split: a transformer's backward is two matrix products per forward one, one for the
# input gradient (B) and one for the weight gradient (W), so F : B : W = 1 : 1 : 1 in FLOPs.
ZERO_BUBBLE_SPLIT = (1.0, 1.0, 1.0)
_COMPUTE_FIELD = {"F": "forward_s", "B": "backward_input_s", "W": "backward_weight_s"}


class StageCosts(BaseModel):
    """Frozen and made of tuples, so hashable: caches key on it directly."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    forward_s: tuple[NonNegativeFloat, ...] = Field(min_length=1)
    backward_input_s: tuple[NonNegativeFloat, ...] = Field(min_length=1)
    backward_weight_s: tuple[NonNegativeFloat, ...] = Field(min_length=1)
    p2p_s: NonNegativeFloat = 0.0
    gradient_transfer_s: tuple[NonNegativeFloat, ...] = Field(min_length=1)
    optimizer_s: tuple[NonNegativeFloat, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _same_length(self) -> StageCosts:
        lengths = {
            len(x) for x in (self.forward_s, self.backward_input_s, self.backward_weight_s, self.gradient_transfer_s, self.optimizer_s)
        }
        if len(lengths) != 1:
            raise ValueError(
                "forward_s, backward_input_s, backward_weight_s, gradient_transfer_s and optimizer_s need one entry per stage each"
            )
        return self

    @property
    def stages(self) -> int:
        return len(self.forward_s)

    def check_stages(self, pp: int) -> None:
        if self.stages != pp:
            raise ScheduleInputError(f"the costs describe {self.stages} stages but the schedule has pp={pp}")

    def compute_s(self, kind: str, stage: int) -> float:
        return getattr(self, _COMPUTE_FIELD[kind])[stage]

    def allreduce_s(self, stage: int, peers: int) -> float:
        """Ring all-reduce of the stage's gradients over its ``peers`` live workers."""
        return ring_all_reduce_factor(peers) * self.gradient_transfer_s[stage]

    @classmethod
    def uniform(
        cls,
        pp: int,
        forward: float = 1.0,
        backward_input: float = 1.0,
        backward_weight: float = 1.0,
        *,
        p2p: float = 0.0,
        gradient_transfer: float = 0.0,
        optimizer: float = 0.0,
    ) -> StageCosts:
        return cls(
            forward_s=[forward] * pp,
            backward_input_s=[backward_input] * pp,
            backward_weight_s=[backward_weight] * pp,
            p2p_s=p2p,
            gradient_transfer_s=[gradient_transfer] * pp,
            optimizer_s=[optimizer] * pp,
        )

    @classmethod
    def from_model(
        cls,
        model: ModelSpec,
        plan: ParallelPlan,
        work: Workload,
        *,
        gpu: GpuType,
        network_gbps: float | None = None,
        split: tuple[float, float, float] = ZERO_BUBBLE_SPLIT,
    ) -> StageCosts:
        """Costs from the allocator's throughput model (``predict_step`` and its pieces): its
        bubble-free compute of one GPU's step divided over the micro-batches and split F : B : W
        (balanced stages, as the model assumes), tensor-parallel all-reduces added to F and B, the
        stage boundary send, and each stage's own gradient bytes and optimizer step."""
        step = predict_step(model, plan, work, gpu=gpu, network_gbps=network_gbps)
        micro_batches = plan.accumulation(work.global_batch)
        compute = step.compute_at_peak_s / step.achievable_fraction / (1 + (plan.pp - 1) / micro_batches) / micro_batches
        tp = tensor_parallel_s(model, plan, work, gpu) / 2  # half in the forward, half in the backward
        between = network_gbps or gpu.link_gbps
        total = sum(split)
        params = [stage_parameters(model, plan, s) for s in range(plan.pp)]
        # each stage's share of the compute by its layers (an uneven split; the model's own pace is its largest stage's)
        layers = plan.layer_split(model.layers)
        weight = [n / max(layers) for n in layers]
        return cls(
            forward_s=[compute * split[0] / total * w + tp for w in weight],
            backward_input_s=[compute * split[1] / total * w + tp for w in weight],
            backward_weight_s=[compute * split[2] / total * w for w in weight],
            p2p_s=boundary_activation_bytes(model, plan, work) / (between * 1e9) if plan.pp > 1 else 0.0,
            gradient_transfer_s=[FP32 * n / (between * 1e9) for n in params],
            optimizer_s=[optimizer_step_s(n / (plan.dp if plan.zero else 1), gpu) for n in params],
        )
