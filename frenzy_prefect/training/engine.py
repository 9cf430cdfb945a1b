"""The training engine: this rank's share of one optimizer step under any parallel plan.

- ZeRO 0: the project's decoder (``decoder.py``), sharded Megatron-style over ``tp`` and into ``pp`` stages,
  gradients averaged over ``dp`` after the last micro-batch. With pp > 1 each rank executes its
  worker's program of a pipeline schedule (``executor.py`` over ``pipeline/``): by default
  fault-free 1F1B (Narayanan et al. 2021) with each W fused to its B, which runs as one ordinary
  ``backward()`` so MemTracker, which must measure this engine, sees plain autograd; with
  ``backward="split"`` the zero-bubble shape, whose deferred W's run torch.distributed.pipelining's
  ``stage_backward_input``/``stage_backward_weight``; ``step`` also takes any other schedule
  (ReCycle's adapted ones) and a source of other pipelines' micro-batches.
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

from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.pipeline.builder import Backward, one_f_one_b
from frenzy_prefect.pipeline.schedule import Schedule
from frenzy_prefect.spec.layout import check_engine_plan, check_resilience, deal_out, padded_vocab, uses_ddp
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.workload import OptimizerSettings, Workload
from frenzy_prefect.training.decoder import Decoder, is_tp_sharded, shard_state
from frenzy_prefect.training.deepspeed_zero import ModelParallelUnit, start_zero2, zero_config
from frenzy_prefect.training.executor import MicroBatch, MicroBatchSource, StageExecutor
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
    stage and tp rank in every live replica) and the copies of the tied embedding (the first and
    last stage of every live pipeline, same tp rank)."""

    tp: TensorParallel
    dp: object
    replicas: int  # live ranks in the data-parallel group
    tied: object

    @classmethod
    def build(cls, plan: ParallelPlan, rank: int, live: Sequence[int]) -> Groups:
        """Groups over the ``live`` global ranks (all of them, unless ReCycle runs without some),
        each named by its rank in the current process group (the position in ``live``)."""
        stage, replica, tp_rank = plan.coordinates(rank)
        position = {r: i for i, r in enumerate(live)}

        def group(ranks: Iterable[int]):
            members = [position[r] for r in ranks if r in position]
            return dist.new_group(members) if members else None  # (new_group([]) would be the whole world)

        # Every rank creates every group, in the same order (torch.distributed requires it).
        if plan.tp > 1:
            tp_groups = {(s, d): group(plan.rank_of(s, d, t) for t in range(plan.tp)) for s in range(plan.pp) for d in range(plan.dp)}
        dp_groups = {(s, t): group(plan.rank_of(s, d, t) for d in range(plan.dp)) for s in range(plan.pp) for t in range(plan.tp)}
        ends = (0, plan.pp - 1)
        tied = {t: group(plan.rank_of(s, d, t) for s in ends for d in range(plan.dp)) for t in range(plan.tp)} if plan.pp > 1 else {}
        return cls(
            tp=TensorParallel(rank=tp_rank, size=plan.tp, group=tp_groups[stage, replica]) if plan.tp > 1 else TensorParallel(),
            dp=dp_groups[stage, tp_rank],
            replicas=sum(plan.rank_of(stage, d, tp_rank) in position for d in range(plan.dp)),
            tied=tied.get(tp_rank) if stage in ends else None,  # a middle stage holds neither copy
        )


class Engine:
    """Builds this rank's model shard and optimizer; ``step`` runs one optimizer step."""

    def __init__(
        self,
        spec: ModelSpec,
        plan: ParallelPlan,
        work: Workload,
        *,
        seed: int = 0,
        rank: int = 0,
        device: torch.device = torch.device("cpu"),
        lr_factor: Callable[[int], float] = lambda step: 1.0,
        backward: Backward = "fused",
        live: Sequence[int] | None = None,
    ):
        precision, optimizer, attention, master_weights = work.precision, work.optimizer, work.attention, work.master_weights
        check_engine_plan(spec, plan, precision, master_weights)
        accumulation = plan.accumulation(work.global_batch)
        self.spec, self.plan, self.settings, self.device = spec, plan, optimizer, device
        self.stage, self.replica, _ = plan.coordinates(rank)
        # Uneven replicas: a replica's mean loss weighs by its share of the global batch, so that
        # averaging over replicas (DDP's, or the reduction's) averages over every sample.
        counts = plan.replica_accumulation(work.global_batch)
        self.batch_weight = counts[self.replica] * plan.dp / sum(counts)
        self.first, self.last = self.stage == 0, self.stage == plan.pp - 1
        half = AUTOCAST_DTYPES.get(precision)
        # Autocast over fp32 weights, or (master weights) half weights and no autocast.
        self.amp_dtype = None if master_weights else half
        self.hidden_dtype = half if master_weights else torch.float32  # the residual stream a stage passes on
        # ``live``: the global ranks in the process group, in its order (ReCycle: not all of them).
        self.rank, live = rank, list(range(plan.gpus) if live is None else live)
        self.position = {r: i for i, r in enumerate(live)}  # a global rank's rank in the process group
        self.groups = Groups.build(plan, rank, live) if dist.is_initialized() else None
        torch.manual_seed(seed)  # the whole model drawn alike on every rank (and sliced, when split)
        if plan.tp == 1 and plan.pp == 1:
            self.model = Decoder(spec, plan.recompute, attention=attention)
        else:
            vocab = padded_vocab(spec, plan.tp)  # the whole model drawn with the plan's padding, then sliced
            full = Decoder(spec, vocab=vocab)
            tp = self.groups.tp if self.groups else TensorParallel()
            split = plan.layer_split(spec.layers)
            self.model = Decoder(spec, plan.recompute, attention=attention, tp=tp, stage=self.stage, split=split, vocab=vocab)
            self.model.load_state_dict(shard_state(full.state_dict(), spec, tp, self.stage, split))
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
        # pp > 1: this rank executes its worker's program of a pipeline schedule (fault-free 1F1B by default).
        self.pipeline = one_f_one_b(plan.dp, plan.pp, accumulation, backward) if plan.pp > 1 else None
        self.executor = self._executor(rank) if plan.pp > 1 else None

    def _executor(self, rank: int) -> StageExecutor:
        _, _, tp_rank = self.plan.coordinates(rank)
        return StageExecutor(
            self.model,
            stage=self.stage,
            pp=self.plan.pp,
            dp=self.plan.dp,
            rank_of=lambda stage, pipeline: self.position[self.plan.rank_of(stage, pipeline, tp_rank)],
            autocast=self._autocast,
            scale=self.scaler.scale,
            hidden=(self.spec.hidden, self.hidden_dtype),
            main_grads=self.main_grads,
            device=self.device,
        )

    def regroup(self, live: Sequence[int]) -> None:
        """Rebuild this rank's groups over the ``live`` global ranks after the caller re-formed the
        process group over them, in that order (ReCycle: without failed ranks, or with rejoined ones)."""
        check_resilience(self.plan, "recycle", self.main_grads)  # the plans whose stages other ranks hold whole
        self.position = {r: i for i, r in enumerate(live)}
        self.groups = Groups.build(self.plan, self.rank, live)

    def leave_groups(self) -> None:
        """Drop this engine's references to its process groups (ReCycle, after a failure): a gloo
        group's connections close only when nothing holds it any more."""
        self.groups = None

    def discard_gradients(self) -> None:
        """Forget the gradients of an iteration a failure interrupted (it is run again)."""
        for p in self.model.parameters():
            if self.main_grads:
                p.main_grad.zero_()
            elif p.grad is not None:
                p.grad.zero_()

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

    def step(
        self,
        micro_batches: list[MicroBatch],
        *,
        schedule: Schedule | None = None,
        source: MicroBatchSource | None = None,
        commit: Callable[[float], float] | None = None,
    ) -> float:
        """One optimizer step over this replica's micro-batches; returns their mean loss (the
        last stage's; other stages return 0.0). With pp > 1 the stage runs this rank's program of
        ``schedule`` (default: the engine's fault-free one); a schedule that gives this worker
        other pipelines' micro-batches needs ``source`` (pipeline, micro) -> that micro-batch, and
        its loss is then the sum over the micro-batches it ran divided by the schedule's
        micro-batches per pipeline. ``commit(loss) -> loss``, if given, runs after the gradients
        are reduced and clipped and before anything is updated (ReCycle's commit point)."""
        if self.deepspeed is not None:
            return self._zero_step(micro_batches)
        if self.plan.pp == 1:
            loss = self._local_step(micro_batches)
        else:
            loss = self._pipeline_step(micro_batches, schedule or self.pipeline, source)
        self._reduce_gradients()
        if self.settings.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            self._clip_gradients(self.settings.grad_clip)
        if commit is not None:
            loss = commit(loss)
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
                    if self.batch_weight != 1:
                        loss = loss * self.batch_weight
                self.scaler.scale(loss).backward()
            total += loss.detach()
        return total.item()

    def _pipeline_step(self, micro_batches: list[MicroBatch], schedule: Schedule, source: MicroBatchSource | None) -> float:
        """Execute this worker's program, then (the schedule's AR and OPT) the engine's reduction and step."""
        if (schedule.dp, schedule.pp) != (self.plan.dp, self.plan.pp):
            raise FrenzyError(
                f"the schedule is for dp={schedule.dp} pp={schedule.pp}; this engine runs dp={self.plan.dp} pp={self.plan.pp}"
            )

        def own(pipeline: int, micro: int) -> MicroBatch:
            if pipeline != self.replica:
                raise FrenzyError(f"the schedule gives pipeline {self.replica}'s worker pipeline {pipeline}'s micro-batches: pass source")
            return micro_batches[micro]

        losses = self.executor.run(schedule, (self.replica, self.stage), source or own)
        if not self.main_grads and any(p.grad is None for p in self.model.parameters()):  # a worker that ran nothing joins the reduction
            for p in self.model.parameters():
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        return torch.stack(losses).sum().item() / schedule.microbatches if losses else 0.0

    def _reduce_gradients(self) -> None:
        """Average over data-parallel replicas; the tied embedding sums every copy's gradient (the
        first and last stage of every live pipeline), then divides by the replicas."""
        if self.groups is None:
            return
        tied = None
        if self.groups.tied is not None and self.spec.tied_embeddings:
            tied = self.model.tok_emb.weight if self.first else self.model.head.weight
            dist.all_reduce(self._grad(tied), group=self.groups.tied)
        if self.plan.dp > 1 and self.ddp is None and self.plan.zero < 3:  # FSDP reduce-scatters in the backward
            for p in self.model.parameters():
                if p is not tied:
                    dist.all_reduce(self._grad(p), group=self.groups.dp)
                self._grad(p).div_(self.plan.dp)  # the full dp: re-routed micro-batches count once wherever they ran

    def _clip_gradients(self, max_norm: float) -> None:
        """Clip by the norm of the whole model's gradient: each tensor counted once over the tp
        ranks that share it (a split tensor, the vocabulary slices included, on every tp rank) and
        the two copies of a tied embedding."""
        plan = self.plan
        if plan.zero == 3:
            clip_sharded_gradients(self.model, max_norm)
            return
        counted = [
            self._grad(p).detach()
            for name, p in self.model.named_parameters()
            if not (self.groups and self.groups.tp.rank > 0 and not is_tp_sharded(name))
            and not (name == "head.weight" and not self.first and self.spec.tied_embeddings)
        ]
        squares = torch.nn.utils.get_total_norm(counted).float() ** 2
        if dist.is_initialized() and plan.tp * plan.pp > 1:  # data-parallel replicas hold the same averaged gradients
            squares /= self.groups.replicas
            dist.all_reduce(squares)
        scale = (max_norm / (squares.sqrt() + 1e-6)).clamp(max=1.0)
        for p in self.model.parameters():
            self._grad(p).detach().mul_(scale)
