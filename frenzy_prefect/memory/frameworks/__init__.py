"""Per-GPU peak memory of a plan as a given framework executes it, in the one MemoryEstimate
schema (per stage: params, grads, optimizer, activations, other):

- ``frenzy``: this project's engine (``memory.analytic``, MARP, unchanged);
- ``megatron``: Megatron-LM / Megatron-Core GPT training (``frameworks.megatron``);
- ``fsdp``: torchtitan's Llama on torch FSDP2, optionally with TP inside (``frameworks.fsdp``).

Each module's docstring states what it assumes and where that comes from.
"""

from __future__ import annotations

from typing import Literal

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.memory.calibration import assumed_constants
from frenzy_prefect.memory.frameworks import fsdp, megatron
from frenzy_prefect.memory.frameworks.fsdp import FsdpOptions
from frenzy_prefect.memory.frameworks.megatron import MegatronOptions
from frenzy_prefect.spec.gpu import GpuType
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import MemoryEstimate, ParallelPlan
from frenzy_prefect.spec.workload import Workload

Framework = Literal["frenzy", "megatron", "fsdp"]
FRAMEWORKS: tuple[str, ...] = ("frenzy", "megatron", "fsdp")


def check_framework(name: str) -> None:
    if name not in FRAMEWORKS:
        raise FrenzyError(f"unknown framework {name!r}; supported: {', '.join(FRAMEWORKS)}")


def estimate(
    framework: str,
    model: ModelSpec,
    plan: ParallelPlan,
    work: Workload,
    *,
    gpu: GpuType | None = None,
    options: MegatronOptions | FsdpOptions | None = None,
) -> MemoryEstimate:
    """Predicted peak bytes per GPU of every pipeline stage of ``plan`` under ``framework``:
    tensors only without ``gpu``; with it, this engine's calibrated overhead (frenzy) or the GPU
    type's assumed runtime terms (CUDA context, NCCL buffers, workspaces: ``memory.calibration``).
    Master weights are this engine's knob (frenzy only)."""
    check_framework(framework)
    if framework == "frenzy":
        if options is not None:
            raise FrenzyError("framework options (sequence parallelism, vpp) apply to megatron and fsdp only")
        from frenzy_prefect.memory.analytic import estimate as engine_estimate

        return engine_estimate(model, plan, work, gpu=gpu)
    # The CUDA context, NCCL buffers and library workspaces are the GPU's and PyTorch's, whatever
    # the framework: their documented assumption for the type (this engine's fitted entries are not applied).
    overhead = assumed_constants(gpu).overhead_for(plan.gpus) if gpu is not None else 0
    if framework == "megatron":
        if options is not None and not isinstance(options, MegatronOptions):
            raise FrenzyError("megatron takes MegatronOptions")
        return megatron.estimate(model, plan, work, options=options, overhead_bytes=overhead)
    if options is not None and not isinstance(options, FsdpOptions):
        raise FrenzyError("fsdp takes FsdpOptions")
    return fsdp.estimate(model, plan, work, options=options, overhead_bytes=overhead)


__all__ = ["FRAMEWORKS", "Framework", "FsdpOptions", "MegatronOptions", "check_framework", "estimate"]
