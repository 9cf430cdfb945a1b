"""The schedule IR: per worker (pipeline, stage), the ordered actions one runtime executes.

A schedule is data, shaped like torch.distributed.pipelining's action lists, but a worker may run
micro-batches of other pipelines (re-routed work), so every action names the micro-batch's owner.
Compact forms (``str(action)``, ``parse_action``):

    F3@1      forward of micro-batch 3 of pipeline 1 (B: input-gradient backward, W: weight-gradient)
    SA3@1>2   send its activation to pipeline 2's worker of the next stage
    RA3@1<0   receive it from pipeline 0's worker of the previous stage
    SG3@1>2   send its input gradient to pipeline 2's worker of the previous stage
    RG3@1<0   receive it from pipeline 0's worker of the next stage
    AR/128    all-reduce the stage's gradients over its live peers, then divide the sum by 128
    OPT       the stage's optimizer step (staggered: no barrier with other stages)

Receives are blocking and sit just before their consumer; sends are asynchronous. The divisor is
dp * microbatches (the global micro-batch count), so re-routing leaves the update unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import StrEnum
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, field_validator

from frenzy_prefect.pipeline.workers import Worker, live_pipelines


class ActionKind(StrEnum):
    """What an action does (the compact form's prefix). A str, so it compares, hashes, prints and
    serialises as its letters ("F" == ActionKind.F; JSON and the compact form are unchanged)."""

    F = "F"  # forward
    B = "B"  # input-gradient backward
    W = "W"  # weight-gradient backward
    SA = "SA"  # send an activation to the next stage
    RA = "RA"  # receive an activation from the previous stage
    SG = "SG"  # send an input gradient to the previous stage
    RG = "RG"  # receive an input gradient from the next stage
    AR = "AR"  # all-reduce the stage's gradients
    OPT = "OPT"  # optimizer step


COMPUTE = (ActionKind.F, ActionKind.B, ActionKind.W)


class Action(NamedTuple):
    kind: ActionKind
    pipeline: int = -1  # the micro-batch's own pipeline (F/B/W/sends/receives)
    micro: int = -1
    peer: int = -1  # sends/receives: the pipeline of the worker at the other end (stage +-1)
    divisor: int = 0  # AR: what the summed gradients are divided by

    def __str__(self) -> str:
        if self.kind in COMPUTE:
            return f"{self.kind}{self.micro}@{self.pipeline}"
        if self.kind in (ActionKind.SA, ActionKind.SG):
            return f"{self.kind}{self.micro}@{self.pipeline}>{self.peer}"
        if self.kind in (ActionKind.RA, ActionKind.RG):
            return f"{self.kind}{self.micro}@{self.pipeline}<{self.peer}"
        if self.kind == ActionKind.AR:
            return f"AR/{self.divisor}"
        return self.kind


_FORM = re.compile(r"^(?:(F|B|W)(\d+)@(\d+)|(SA|SG)(\d+)@(\d+)>(\d+)|(RA|RG)(\d+)@(\d+)<(\d+)|AR/(\d+)|(OPT))$")


def parse_action(text: str) -> Action:
    m = _FORM.match(text.strip())
    if not m:
        raise ValueError(f"not an action: {text!r}; expected forms like F3@1, SA3@1>2, RG3@1<0, AR/128, OPT")
    g = m.groups()
    if g[0]:
        return Action(ActionKind(g[0]), int(g[2]), int(g[1]))
    if g[3]:
        return Action(ActionKind(g[3]), int(g[5]), int(g[4]), int(g[6]))
    if g[7]:
        return Action(ActionKind(g[7]), int(g[9]), int(g[8]), int(g[10]))
    if g[11]:
        return Action(ActionKind.AR, divisor=int(g[11]))
    return Action(ActionKind.OPT)


class Schedule(BaseModel):
    """One training iteration of every live worker. ``failed`` workers have no program."""

    model_config = ConfigDict(frozen=True)

    dp: int
    pp: int
    microbatches: int
    failed: frozenset[Worker] = frozenset()
    programs: dict[Worker, tuple[Action, ...]]

    @field_validator("programs", mode="before")
    @classmethod
    def _from_json(cls, programs: Any) -> Any:
        """JSON writes the worker keys as "p,s"; actions may also be given in compact form ("F3@1")."""
        if not isinstance(programs, dict):
            return programs
        out = {}
        for worker, program in programs.items():
            key = tuple(int(x) for x in worker.split(",")) if isinstance(worker, str) else worker
            out[key] = [parse_action(a) if isinstance(a, str) else a for a in program]
        return out

    @property
    def divisor(self) -> int:
        return self.dp * self.microbatches

    def live(self, stage: int) -> list[int]:
        return live_pipelines(self.dp, self.failed, stage)

    def render(self, worker: Worker) -> str:
        return " ".join(map(str, self.programs[worker]))

    def compute_counts(self, worker: Worker) -> int:
        """Micro-batches this worker runs (its F actions)."""
        return sum(1 for a in self.programs.get(worker, ()) if a.kind == ActionKind.F)

    def replaced(self, worker: Worker, program: Sequence[Action]) -> Schedule:
        """A copy with one worker's program replaced (tests mutate schedules this way)."""
        return self.model_copy(update={"programs": {**self.programs, worker: tuple(program)}})

    def relabelled(self, maps: Sequence[Sequence[int]]) -> Schedule:
        """The same schedule on other workers: ``maps[s][p]`` is the pipeline that stage s's
        worker p becomes (see failures.pipeline_maps). Micro-batch owners keep their labels."""

        def peer_stage(a: Action, s: int) -> int:
            return s + 1 if a.kind in (ActionKind.SA, ActionKind.RG) else s - 1

        programs = {}
        for (p, s), program in self.programs.items():
            programs[(maps[s][p], s)] = tuple(a._replace(peer=maps[peer_stage(a, s)][a.peer]) if a.peer >= 0 else a for a in program)
        failed = frozenset((maps[s][p], s) for p, s in self.failed)
        return self.model_copy(update={"programs": programs, "failed": failed})


def fused_backwards(program: Sequence[Action]) -> set[tuple[int, int]]:
    """The micro-batches whose W follows their B with no other compute between: one backward()."""
    compute = [a for a in program if a.kind in COMPUTE]
    return {
        (a.pipeline, a.micro)
        for a, b in zip(compute, compute[1:], strict=False)
        if a.kind == ActionKind.B and b.kind == ActionKind.W and (b.pipeline, b.micro) == (a.pipeline, a.micro)
    }
