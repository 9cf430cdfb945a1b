"""The training engine: this rank's share of one optimizer step under any parallel plan.

- ZeRO 0: the project's decoder (``decoder.py``), sharded Megatron-style over ``tp`` and into ``pp`` stages run with
  the 1F1B schedule (Narayanan et al. 2021), gradients averaged over ``dp`` after the last
  micro-batch. The schedule is written here rather than taken from torch.distributed.pipelining
  because that module's backward (``autograd.grad`` over stage inputs) cannot run under
  MemTracker, which must measure this engine.
- ZeRO 1 (with any tp and pp): the same, with torch's ZeroRedundancyOptimizer over the data-parallel
  group: each replica keeps the optimizer states of its share of whole tensors and broadcasts
  what it updated (Megatron's distributed optimizer, over fp32 weights).
- ZeRO 2: DeepSpeed's engine over ``dp`` ranks, with the same model, with tp (no pp: DeepSpeed
  refuses ZeRO-2 with pipelines) (``deepspeed_zero.py``).
- ZeRO 3: torch's FSDP2 over ``dp`` ranks (no tp or pp), one block gathered at a time
  (``fully_sharded.py``).
Bf16 and fp16 use torch autocast over fp32 weights in every path, so activations are alike, unless
``master_weights``: then the weights themselves are bf16/fp16 and no autocast runs (Megatron-LM's
and DeepSpeed's bf16 training). Each parameter's half gradient is added after every backward
into an fp32 ``main_grad`` and freed (a post-accumulate-grad hook, as Megatron does); the
optimizer steps fp32 master copies whose ``.grad`` is that main gradient, and the masters are
copied back into the half weights after the step. The main gradients are all-reduced after the
backward (not through DDP, whose buckets would hold the half gradients and reduce them in half
precision). ZeRO-1 (Megatron's distributed optimizer): each replica keeps the masters, and the
optimizer states, of the whole tensors ZeroRedundancyOptimizer would deal it (``layout.deal_out``),
steps them, refreshes its own half weights from them and broadcasts those to the other replicas,
so every replica's half weights are current (ZeroRedundancyOptimizer itself would need every
master on every replica, to broadcast them).
ZeRO-3 uses FSDP2's own mixed precision (its sharded fp32 parameters are the masters); ZeRO-2
(DeepSpeed) is not offered with master weights.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from frenzy_prefect.spec.layout import check_engine_plan, deal_out, padded_vocab, uses_ddp
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.request import Attention, OptimizerSettings, Precision
from frenzy_prefect.training.decoder import Decoder, is_tp_sharded, shard_state
from frenzy_prefect.training.deepspeed_zero import ModelParallelUnit, start_zero2, zero_config
from frenzy_prefect.training.fully_sharded import clip_sharded_gradients, shard_fully
from frenzy_prefect.training.tensor_parallel import TensorParallel

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_optimizer(params: list[torch.nn.Parameter], settings: OptimizerSettings, shard_over=None) -> torch.optim.Optimizer:
    """The optimizer ``settings`` name; ``shard_over`` a process group: ZeRO-1 over it."""
    if settings.name == "sgd":
        cls, kwargs = torch.optim.SGD, {"momentum": settings.momentum}
    else:
        cls, kwargs = (torch.optim.AdamW if settings.name == "adamw" else torch.optim.Adam), {"betas": settings.betas}
    kwargs |= {"lr": settings.lr, "weight_decay": settings.weight_decay}
    if shard_over is None:
        return cls(params, **kwargs)
    return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=shard_over, **kwargs)


def half_weights(params: list[torch.nn.Parameter], dtype: torch.dtype, keep: list[bool]) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """Give each of ``params`` an fp32 ``main_grad``, into which a hook adds (and then frees) each
    half gradient, and cast it to ``dtype`` in place; returns (parameter, fp32 master) for those
    ``keep`` marks, each master's ``.grad`` the parameter's main gradient."""

    def accumulate(p: torch.nn.Parameter) -> None:
        p.main_grad.add_(p.grad)
        p.grad = None

    masters = []
    for p, kept in zip(params, keep, strict=True):
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        if kept:
            master = p.detach().clone()
            master.grad = p.main_grad
            masters.append((p, master))
        p.data = p.data.to(dtype)
        p.register_post_accumulate_grad_hook(accumulate)
    return masters


@dataclass
class Groups:
    """This rank's process groups: its tensor-parallel group, its data-parallel group (the same
    stage and tp rank in every replica), and its pipeline neighbours."""

    tp: TensorParallel
    dp: object
    prev_rank: int | None
    next_rank: int | None
    tied: object  # first and last stage of this pipeline, which share the embedding

    @classmethod
    def build(cls, plan: ParallelPlan, rank: int) -> Groups:
        stage, replica, tp_rank = plan.coordinates(rank)
        # Every rank creates every group, in the same order (torch.distributed requires it).
        tp_groups = {
            (s, d): dist.new_group([plan.rank_of(s, d, t) for t in range(plan.tp)]) for s in range(plan.pp) for d in range(plan.dp)
        }
        dp_groups = {
            (s, t): dist.new_group([plan.rank_of(s, d, t) for d in range(plan.dp)]) for s in range(plan.pp) for t in range(plan.tp)
        }
        tied = (
            {
                (d, t): dist.new_group([plan.rank_of(0, d, t), plan.rank_of(plan.pp - 1, d, t)])
                for d in range(plan.dp)
                for t in range(plan.tp)
            }
            if plan.pp > 1
            else {}
        )
        return cls(
            tp=TensorParallel(rank=tp_rank, size=plan.tp, group=tp_groups[stage, replica]),
            dp=dp_groups[stage, tp_rank],
            prev_rank=plan.rank_of(stage - 1, replica, tp_rank) if stage > 0 else None,
            next_rank=plan.rank_of(stage + 1, replica, tp_rank) if stage < plan.pp - 1 else None,
            tied=tied.get((replica, tp_rank)),
        )


class Engine:
    """Builds this rank's model shard and optimizer; ``step`` runs one optimizer step."""

    def __init__(
        self,
        spec: ModelSpec,
        plan: ParallelPlan,
        *,
        precision: Precision,
        optimizer: OptimizerSettings,
        accumulation: int,
        attention: Attention = "flash",
        master_weights: bool = False,
        seed: int = 0,
        rank: int = 0,
        device: torch.device = torch.device("cpu"),
        lr_factor: Callable[[int], float] = lambda step: 1.0,
    ):
        check_engine_plan(spec, plan, precision, master_weights)
        self.spec, self.plan, self.settings, self.device = spec, plan, optimizer, device
        self.stage, _, _ = plan.coordinates(rank)
        self.first, self.last = self.stage == 0, self.stage == plan.pp - 1
        half = AUTOCAST_DTYPES.get(precision)
        # Autocast over fp32 weights, or (master weights) half weights and no autocast.
        self.amp_dtype = None if master_weights else half
        self.hidden_dtype = half if master_weights else torch.float32  # the residual stream a stage passes on
        self.groups = Groups.build(plan, rank) if dist.is_initialized() else None
        torch.manual_seed(seed)  # the whole model drawn alike on every rank (and sliced, when split)
        if plan.tp == 1 and plan.pp == 1:
            self.model = Decoder(spec, plan.recompute, attention=attention)
        else:
            vocab = padded_vocab(spec, plan.tp)  # the whole model drawn with the plan's padding, then sliced
            full = Decoder(spec, vocab=vocab)
            tp = self.groups.tp if self.groups else TensorParallel()
            self.model = Decoder(spec, plan.recompute, attention=attention, tp=tp, stage=self.stage, stages=plan.pp, vocab=vocab)
            self.model.load_state_dict(shard_state(full.state_dict(), spec, tp, self.stage, plan.pp))
            del full
        self.model.to(device)
        if self.groups and plan.zero == 3:  # (replaces the parameters by their shards)
            shard_fully(self.model, self.model.blocks, self.groups.dp, device, param_dtype=half if master_weights else None)
        params = [p for p in self.model.parameters() if p.requires_grad]
        sharded = self.groups.dp if self.groups and plan.zero == 1 and plan.dp > 1 else None
        # Master weights outside FSDP: half weights with fp32 main gradients (``main_grad``), and
        # (parameter, fp32 master) for the parameters this rank steps (ZeRO-1: its share).
        self.main_grads = master_weights and plan.zero != 3
        self.owners = deal_out([p.numel() for p in params], plan.dp) if self.main_grads and sharded else None
        self.masters: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        if self.main_grads:
            mine = dist.get_rank(sharded) if self.owners else None
            self.masters = half_weights(params, half, [owner == mine for owner in self.owners or [None] * len(params)])
        # Plain data parallelism overlaps the gradient all-reduce with the backward through DDP
        # (its buckets are the gradients: gradient_as_bucket_view); other plans reduce after it.
        self.ddp = None
        if self.groups and uses_ddp(plan, master_weights):
            self.ddp = DistributedDataParallel(
                self.model,
                device_ids=[device.index] if device.type == "cuda" else None,
                process_group=self.groups.dp,
                gradient_as_bucket_view=True,
            )
        if self.main_grads:
            self.optimizer = make_optimizer([master for _, master in self.masters], optimizer)
        else:
            self.optimizer = make_optimizer(params, optimizer, sharded)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor)
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        self.deepspeed = None
        if plan.zero == 2:
            mpu = ModelParallelUnit(self.groups.tp, self.groups.dp) if plan.tp > 1 else None
            config = zero_config(spec, plan, accumulation, optimizer)
            self.deepspeed = start_zero2(self.model, self.optimizer, self.schedule, config, mpu)

    def _grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The gradient the optimizer reads: the fp32 main gradient with master weights."""
        return p.main_grad if self.main_grads else p.grad

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights, in fp32 from the masters this rank holds."""
        by_param = {id(p): master for p, master in self.masters}
        return {name: by_param.get(id(t), t).detach() for name, t in self.model.state_dict(keep_vars=True).items()}

    @torch.no_grad()
    def _refresh_half_weights(self) -> None:
        """Copy the stepped masters into their half weights; ZeRO-1: each owner broadcasts its
        tensors' new half weights to the other replicas."""
        for p, master in self.masters:
            p.copy_(master)
        if self.owners:
            params = [p for p in self.model.parameters() if p.requires_grad]
            for p, owner in zip(params, self.owners, strict=True):
                dist.broadcast(p, dist.get_global_rank(self.groups.dp, owner), group=self.groups.dp)

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One optimizer step over this replica's micro-batches; returns their mean loss (the
        last stage's; other stages return 0.0)."""
        if self.deepspeed is not None:
            return self._zero_step(micro_batches)
        if self.plan.pp == 1:
            loss = self._local_step(micro_batches)
        else:
            loss = self._pipeline_step(micro_batches)
        self._reduce_gradients()
        if self.settings.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            self._clip_gradients(self.settings.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.main_grads:
            self._refresh_half_weights()
            for p in self.model.parameters():
                p.main_grad.zero_()
        else:
            self.optimizer.zero_grad(set_to_none=False)  # gradient buffers persist, as in Megatron/DeepSpeed
        self.schedule.step()
        return loss

    def _zero_step(self, micro_batches) -> float:
        total = 0.0
        for x, y in micro_batches:
            with self._autocast():
                loss = self.deepspeed(x, y)
            self.deepspeed.backward(loss)
            self.deepspeed.step()  # DeepSpeed steps the optimizer at the accumulation boundary
            total += loss.item()
        return total / len(micro_batches)

    def _local_step(self, micro_batches) -> float:
        total = torch.zeros((), device=self.device)
        net = self.ddp or self.model
        for i, (x, y) in enumerate(micro_batches):
            # DDP all-reduces during the last micro-batch's backward only.
            with self.ddp.no_sync() if self.ddp and i < len(micro_batches) - 1 else nullcontext():
                with self._autocast():
                    loss = net(x, y) / len(micro_batches)
                self.scaler.scale(loss).backward()
            total += loss.detach()
        return total.item()

    def _pipeline_step(self, micro_batches) -> float:
        """1F1B: stage s runs pp - s - 1 warm-up forwards, then alternates one forward and one
        backward, then drains; each exchange with a neighbour posts its send and receive together."""
        count = len(micro_batches)
        warmup = min(self.plan.pp - self.stage - 1, count)
        shape = (self.plan.micro_batch, micro_batches[0][0].shape[1], self.spec.hidden)
        in_flight: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        total = torch.zeros((), device=self.device)

        def forward(i: int, received: torch.Tensor | None) -> torch.Tensor:
            nonlocal total
            x, y = micro_batches[i]
            with self._autocast():
                out = self.model(x if self.first else received, y if self.last else None)
            if self.last:
                out = out / count
                total += out.detach()
            in_flight.append((received, out))
            return out

        def backward(grad: torch.Tensor | None) -> torch.Tensor | None:
            received, out = in_flight.pop(0)
            if self.last:
                self.scaler.scale(out).backward()
            else:
                out.backward(grad)
            return None if self.first else received.grad

        for i in range(warmup):
            out = forward(i, self._exchange(recv_prev=shape))
            self._exchange(send_next=out)
        received = self._exchange(recv_prev=shape) if count > warmup else None
        for i in range(warmup, count):
            out = forward(i, received)
            grad = self._exchange(send_next=out, recv_next=shape)
            grad_in = backward(grad)
            received = self._exchange(send_prev=grad_in, recv_prev=shape if i < count - 1 else None)
        for _ in range(warmup):
            self._exchange(send_prev=backward(self._exchange(recv_next=shape)))
        return total.item()

    def _exchange(self, send_next=None, send_prev=None, recv_next=None, recv_prev=None) -> torch.Tensor | None:
        """Post the sends and the receive with the pipeline neighbours, then wait for all of them.
        Sends to a missing neighbour (past either end of the pipeline) are dropped."""
        works, received = [], None
        if send_next is not None and self.groups.next_rank is not None:
            works.append(dist.isend(send_next.detach().contiguous(), self.groups.next_rank))
        if send_prev is not None and self.groups.prev_rank is not None:
            works.append(dist.isend(send_prev.contiguous(), self.groups.prev_rank))
        peer = self.groups.next_rank if recv_next is not None else self.groups.prev_rank if recv_prev is not None else None
        if peer is not None:
            received = torch.empty(recv_next or recv_prev, device=self.device, dtype=self.hidden_dtype)
            works.append(dist.irecv(received, peer))
        for work in works:
            work.wait()
        if received is not None and recv_prev is not None:
            received.requires_grad_()
        return received

    def _reduce_gradients(self) -> None:
        """Average over data-parallel replicas; sum the tied embedding's two copies (first and last stage)."""
        if self.groups is None:
            return
        if self.groups.tied is not None and self.spec.tied_embeddings:
            shared = self.model.tok_emb.weight if self.first else self.model.head.weight
            dist.all_reduce(self._grad(shared), group=self.groups.tied)
        if self.plan.dp > 1 and self.ddp is None and self.plan.zero < 3:  # FSDP reduce-scatters in the backward
            for p in self.model.parameters():
                dist.all_reduce(self._grad(p), group=self.groups.dp)
                self._grad(p).div_(self.plan.dp)

    def _clip_gradients(self, max_norm: float) -> None:
        """Clip by the norm of the whole model's gradient: each tensor counted once over the tp
        ranks that share it (a split tensor, the vocabulary slices included, on every tp rank) and
        the two copies of a tied embedding."""
        plan = self.plan
        if plan.zero == 3:
            clip_sharded_gradients(self.model, max_norm)
            return
        squares = torch.zeros((), device=self.device)
        for name, p in self.model.named_parameters():
            if self.groups and self.groups.tp.rank > 0 and not is_tp_sharded(name):
                continue
            if name == "head.weight" and not self.first and self.spec.tied_embeddings:
                continue
            squares += torch.linalg.vector_norm(self._grad(p).detach(), dtype=torch.float32) ** 2
        if dist.is_initialized() and plan.gpus > 1:
            dist.all_reduce(squares)
            squares /= plan.dp
        scale = (max_norm / (squares.sqrt() + 1e-6)).clamp(max=1.0)
        for p in self.model.parameters():
            self._grad(p).detach().mul_(scale)
