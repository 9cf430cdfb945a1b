"""Run one worker's program of a pipeline schedule (``pipeline.schedule``) on this rank.

A worker is (pipeline = data-parallel replica, stage); every tensor-parallel rank of the worker
runs the same program. F runs the stage's forward on a micro-batch, B its input-gradient backward,
W its weight-gradient backward; RA/RG receive an activation/gradient (blocking, just before their
consumer) from the named peer pipeline's rank of stage -/+ 1, SA/SG send one (asynchronous). A
gloo send completes only once its receive is posted, and the tensor it holds stays alive until it
is waited for, so each send is waited for as soon as the schedule proves its receive posted (after
the first message its receiver sends later reaches this rank: ``send_waits``), the rest at the
end. AR and OPT are left to the caller: the engine's gradient reduction and optimizer step follow
every program.

A micro-batch may belong to another pipeline (ReCycle re-routes a failed worker's micro-batches to
a live peer of its stage): ``source(pipeline, micro)`` gives any pipeline's micro-batch, and
transfers are tagged by (kind, pipeline, micro), so a pair of ranks may exchange them in any order.

A B followed by its own W with no other compute between (1F1B) runs as one ordinary ``backward()``:
the default schedule's memory and speed are those of plain autograd, and MemTracker measures it.
A B whose W comes later runs torch.distributed.pipelining's ``stage_backward_input`` (the stage
input's gradient only, keeping what W needs) and W its ``stage_backward_weight``; on the first
stage, whose inputs are token ids without gradients, B has nothing to compute and W runs the
whole backward (as torch's own schedules do).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.pipeline.schedule import Action, ActionKind, Schedule, fused_backwards
from frenzy_prefect.pipeline.workers import Worker
from frenzy_prefect.torch_private import stage_backward_input, stage_backward_weight

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (input ids, target ids)
MicroBatchSource = Callable[[int, int], MicroBatch]  # (pipeline, micro) -> that pipeline's micro-batch
_TAG = {ActionKind.SA: 0, ActionKind.RA: 0, ActionKind.SG: 1, ActionKind.RG: 1}  # activations, gradients
_RECEIVE = {ActionKind.SA: ActionKind.RA, ActionKind.SG: ActionKind.RG}
_TOWARD = {ActionKind.SA: 1, ActionKind.SG: -1}  # the stage a send goes to, relative to its own


def send_waits(schedule: Schedule, worker: Worker) -> dict[int, list[int]]:
    """After which of ``worker``'s actions each of its sends is surely complete: a send completes once
    the peer posts its receive; the peer's program then runs in order, so when this worker receives
    the first message the peer sends after that receive, the send is done. Keyed by the position of
    that receive in this worker's program; sends with no such receive are left out (waited for at
    the end)."""
    program, (pipeline, stage) = schedule.programs[worker], worker

    def receive_in(actions: Sequence[Action], send: Action) -> int:
        return next(
            (k for k, b in enumerate(actions) if (b.kind, b.pipeline, b.micro) == (_RECEIVE[send.kind], send.pipeline, send.micro)), -1
        )

    waits: dict[int, list[int]] = {}
    for i, a in enumerate(program):
        if a.kind not in _RECEIVE:
            continue
        peer = schedule.programs.get((a.peer, stage + _TOWARD[a.kind]), ())
        posted = receive_in(peer, a)
        reply = next(
            (b for b in peer[posted:] if b.kind in _RECEIVE and b.peer == pipeline and _TOWARD[b.kind] == -_TOWARD[a.kind]),
            None,
        )
        after = receive_in(program, reply) if reply and posted >= 0 else -1
        if after > i:
            waits.setdefault(after, []).append(i)
    return waits


@dataclass
class _InFlight:
    """A micro-batch between its F and its W on this worker."""

    received: torch.Tensor | None  # the stage's input (None on the first stage)
    out: torch.Tensor  # the stage's output, or (last stage) its scaled loss
    grad: torch.Tensor | None = None  # the output's gradient, received for B
    param_groups: list = field(default_factory=list)  # what stage_backward_input left for W


@dataclass
class StageExecutor:
    """This rank's stage of the model and how to reach the ranks of its neighbouring stages."""

    model: torch.nn.Module
    stage: int
    pp: int
    dp: int
    rank_of: Callable[[int, int], int]  # (stage, pipeline) -> the rank of this tp rank there
    autocast: Callable[[], object]
    scale: Callable[[torch.Tensor], torch.Tensor]  # the loss scaler's (identity unless fp16)
    hidden: tuple[int, torch.dtype]  # the width and dtype of what stages pass on
    main_grads: bool = False  # weight gradients go into fp32 ``main_grad`` (master weights)
    device: torch.device = torch.device("cpu")

    def run(self, schedule: Schedule, worker: Worker, source: MicroBatchSource) -> list[torch.Tensor]:
        """Run ``worker``'s program of ``schedule`` (one iteration; nothing for a failed worker);
        returns the unscaled losses of the micro-batches it ran on the last stage. Each
        micro-batch's loss is divided by ``schedule.microbatches`` before its backward, so the
        gradients summed over the stage's workers and divided by dp are the mean over all
        dp * microbatches micro-batches, the AR's divisor."""
        program = schedule.programs.get(worker, ())
        run = _Run(self, schedule.microbatches, source, fused_backwards(program))
        waits = send_waits(schedule, worker) if program else {}
        for i, action in enumerate(program):
            run.do(i, action)
            for send in waits.get(i, ()):
                run.wait(send)
        run.finish()
        return run.losses


class _Run:
    """The state of one program's execution: micro-batches in flight, transfers posted."""

    def __init__(self, ex: StageExecutor, microbatches: int, source: MicroBatchSource, fused: set[tuple[int, int]]) -> None:
        self.ex, self.microbatches, self.source, self.fused = ex, microbatches, source, fused
        self.first, self.last = ex.stage == 0, ex.stage == ex.pp - 1
        self.held: dict[tuple[int, int], _InFlight] = {}
        self.received: dict[tuple[int, int], torch.Tensor] = {}  # activations received, not yet consumed
        self.sends: dict[int, dist.Work] = {}  # by the send's position in the program
        self.losses: list[torch.Tensor] = []
        self.weights = [p for p in ex.model.parameters() if p.requires_grad]

    def do(self, position: int, a: Action) -> None:
        if a.kind in _RECEIVE:
            self.sends[position] = self.send(a)
            return
        step = {
            ActionKind.F: self.forward,
            ActionKind.B: self.backward_input,
            ActionKind.W: self.backward_weight,
            ActionKind.RA: self.receive,
            ActionKind.RG: self.receive,
        }.get(a.kind)
        if step is not None:  # AR and OPT: the engine's reduction and optimizer step, after the program
            step(a)

    def wait(self, send: int) -> None:
        self.sends.pop(send).wait()  # the work holds the tensor until then

    def finish(self) -> None:
        for work in self.sends.values():
            work.wait()
        if self.held or self.received:
            raise FrenzyError(f"the schedule left micro-batches unfinished at stage {self.ex.stage}: {sorted(self.held or self.received)}")

    def _peer(self, a: Action) -> int:
        other = self.ex.stage + 1 if a.kind in (ActionKind.SA, ActionKind.RG) else self.ex.stage - 1
        return self.ex.rank_of(other, a.peer)

    def _tag(self, a: Action) -> int:
        return (_TAG[a.kind] * self.ex.dp + a.pipeline) * self.microbatches + a.micro

    def receive(self, a: Action) -> None:
        width, dtype = self.ex.hidden
        x, _ = self.source(a.pipeline, a.micro)
        buffer = torch.empty((*x.shape, width), device=self.ex.device, dtype=dtype)
        dist.irecv(buffer, self._peer(a), tag=self._tag(a)).wait()
        if a.kind == ActionKind.RA:
            self.received[(a.pipeline, a.micro)] = buffer.requires_grad_()
        else:
            self.held[(a.pipeline, a.micro)].grad = buffer

    def send(self, a: Action) -> dist.Work:
        held = self.held[(a.pipeline, a.micro)]
        tensor = (held.out.detach() if a.kind == ActionKind.SA else held.received.grad).contiguous()
        return dist.isend(tensor, self._peer(a), tag=self._tag(a))

    def forward(self, a: Action) -> None:
        x, y = self.source(a.pipeline, a.micro)
        received = None if self.first else self.received.pop((a.pipeline, a.micro))
        with self.ex.autocast():
            out = self.ex.model(x.to(self.ex.device) if self.first else received, y.to(self.ex.device) if self.last else None)
        if self.last:
            self.losses.append(out.detach())
            out = self.ex.scale(out / self.microbatches)
        self.held[(a.pipeline, a.micro)] = _InFlight(received, out)

    def backward_input(self, a: Action) -> None:
        held = self.held[(a.pipeline, a.micro)]
        if (a.pipeline, a.micro) in self.fused:
            held.out.backward(held.grad)  # B and W at once: plain autograd
        elif not self.first:
            grads = None if self.last else [held.grad]
            _, held.param_groups = stage_backward_input([held.out], grads, [held.received], iter(self.weights))

    def backward_weight(self, a: Action) -> None:
        held = self.held.pop((a.pipeline, a.micro))
        if (a.pipeline, a.micro) in self.fused:
            return
        if self.first:
            held.out.backward(held.grad)
        else:
            stage_backward_weight(iter(self.weights), held.param_groups)
            if self.ex.main_grads:  # autograd.grad bypasses the hooks that fold half gradients into main_grad
                for p in self.weights:
                    if p.grad is not None:
                        p.main_grad.add_(p.grad)
                        p.grad = None
