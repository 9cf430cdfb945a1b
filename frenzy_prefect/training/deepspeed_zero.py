"""ZeRO-2 through DeepSpeed's engine over the data-parallel group, with or without this project's
tensor parallelism: a Megatron-style model-parallel unit (``mpu``) tells DeepSpeed the groups, as
Megatron-DeepSpeed does. Not with pipeline parallelism: DeepSpeed itself refuses ZeRO-2 there
(deepspeed/runtime/pipe/engine.py: "ZeRO-2 and ZeRO-3 are incompatible with pipeline
parallelism"), since partitioned gradients are reduced after every micro-batch's backward."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from frenzy_prefect.spec.layout import zero_bucket_elements
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.request import OptimizerSettings
from frenzy_prefect.training.decoder import is_tp_sharded
from frenzy_prefect.training.tensor_parallel import TensorParallel


def zero_config(spec: ModelSpec, plan: ParallelPlan, accumulation: int, settings: OptimizerSettings) -> dict:
    bucket = zero_bucket_elements(spec)
    return {
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": settings.grad_clip,
        "steps_per_print": 2**31 - 1,
        "zero_optimization": {
            "stage": plan.zero,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "overlap_comm": False,
            "contiguous_gradients": True,
        },
    }


@dataclass
class ModelParallelUnit:
    """The part of Megatron's ``mpu`` interface DeepSpeed reads: the data-parallel group it
    partitions over, and the tensor-parallel group over which it sums the gradient norm (counting
    a parameter on every tp rank when it is split, on tp rank 0 only when it is replicated)."""

    tp: TensorParallel
    dp: object

    def get_data_parallel_group(self):
        return self.dp

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.dp)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.dp)

    def get_model_parallel_group(self):
        return self.tp.group

    def get_model_parallel_world_size(self) -> int:
        return self.tp.size

    def get_model_parallel_rank(self) -> int:
        return self.tp.rank

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank


def start_zero2(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule,
    config: dict,
    mpu: ModelParallelUnit | None,
):
    """Hand model, optimizer and schedule to DeepSpeed's ZeRO engine (its optimizer wraps ours)."""
    import deepspeed

    # Skip compiling DeepSpeed's shared-memory comm op (minutes on CPU; gloo is used instead).
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
    if mpu is not None:
        for name, p in model.named_parameters():
            p.tensor_model_parallel = is_tp_sharded(name)  # DeepSpeed's mark for the norm (runtime/utils.py)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule, config=config, mpu=mpu)
    return engine
