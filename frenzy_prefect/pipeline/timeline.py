"""Execute a schedule under StageCosts: when every action starts and ends, and the iteration time.

Each worker runs its program in order; an action starts when its worker is free and what it
consumes is there: a receive waits for the matching send's end plus the p2p time, F and B for
their receives (and B for its own F), W for its B, the all-reduce of a stage for every live peer
of the stage to reach it (a collective), the optimizer for the all-reduce. Sends take no worker
time (asynchronous). Start times are as soon as possible, which for fixed per-worker orders is the
earliest possible for every action.

Iteration time (what the planners minimise): the makespan of one iteration started with every
worker idle at time 0, up to the end of the last stage's optimizer step. Stages step their
optimizers independently (staggered, no global barrier), so each stage finishes at its own time.

Steady state (``steady_state_period_s``): the schedule repeated back to back, each worker starting
its next iteration's program as soon as it has finished its own previous one (its stage's
optimizer step: the weights it needs are then updated), so the next iteration's warm-up overlaps
other stages' deferred W's and optimizer steps. The period is the gap between the ends of the
last two of a few iterations; the iteration time above bounds it from above.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import NamedTuple

from frenzy_prefect.pipeline.costs import StageCosts
from frenzy_prefect.pipeline.schedule import Action, Schedule
from frenzy_prefect.pipeline.workers import ScheduleInputError, Worker


class ScheduleDeadlock(ScheduleInputError):
    """Workers wait on each other (or on actions that never happen): the iteration cannot end."""


class Timeline(NamedTuple):
    starts: dict[Worker, list[float]]  # per action of the program (repeated, for several iterations)
    ends: dict[Worker, list[float]]
    iteration_s: float  # the makespan of all the iterations run
    iteration_ends: list[float]  # when each iteration's last optimizer step ends

    def busy_s(self, worker: Worker) -> float:
        return sum(e - s for s, e in zip(self.starts[worker], self.ends[worker], strict=True))

    def bubble_fraction(self, worker: Worker) -> float:
        """The share of the iteration this worker is idle."""
        return 1.0 - self.busy_s(worker) / self.iteration_s if self.iteration_s > 0 else 0.0

    def stage_end_s(self, stage: int) -> float:
        """When the stage's optimizer step ends (stages end at different times)."""
        return max(e[-1] for (p, s), e in self.ends.items() if s == stage and e)


def _needs(a: Action, stage: int, pp: int) -> tuple[tuple, ...]:
    """The keys an action waits for (published by the actions that produce them)."""
    k = a.kind
    if k == "F":
        return (("RA", a.pipeline, a.micro, stage),) if stage > 0 else ()
    if k == "B":
        own = ("F", a.pipeline, a.micro, stage)
        return (own, ("RG", a.pipeline, a.micro, stage)) if stage < pp - 1 else (own,)
    if k == "W":
        return (("B", a.pipeline, a.micro, stage),)
    if k == "SA":
        return (("F", a.pipeline, a.micro, stage),)
    if k == "SG":
        return (("B", a.pipeline, a.micro, stage),)
    if k == "RA":
        return (("SA", a.pipeline, a.micro, stage - 1),)
    if k == "RG":
        return (("SG", a.pipeline, a.micro, stage + 1),)
    return ()


def compute_needs(kind: str, stage: int, pp: int) -> tuple[tuple[str, int], ...]:
    """The compute actions, as (kind, stage) of the same micro-batch, that an F, B or W at ``stage``
    waits for: the rules of ``_needs`` with each receive followed back through its send to the
    compute that produced it (a need at another stage arrives ``p2p_s`` after that compute ends).
    Planners that simulate compute only (the list scheduler) use this instead of their own copy."""
    out = []
    for need_kind, _, _, need_stage in _needs(Action(kind), stage, pp):
        while need_kind not in ("F", "B", "W"):
            ((need_kind, _, _, need_stage),) = _needs(Action(need_kind), need_stage, pp)
        out.append((need_kind, need_stage))
    return tuple(out)


def _run_action(w: Worker, a: Action, start: float, costs: StageCosts) -> tuple[float, str | None, float]:
    """One non-collective action started at ``start``: its end, the key kind it publishes (None:
    nothing) and when what it publishes is available to the consumer."""
    kind, stage = a.kind, w[1]
    if kind in ("F", "B", "W"):
        end = start + costs.compute_s(kind, stage)
        return end, kind, end
    if kind in ("SA", "SG"):  # asynchronous: no worker time, the peer has it p2p_s later
        return start, kind, start + costs.p2p_s
    if kind in ("RA", "RG"):
        return start, kind, start
    if kind == "OPT":
        end = start + costs.optimizer_s[stage]
        return end, None, end
    raise ScheduleInputError(f"worker {w} has an action of unknown kind {kind!r}")


def _raise_if_stuck(programs: dict[Worker, list[Action]], ptr: dict[Worker, int]) -> None:
    stuck = {w: str(programs[w][ptr[w]]) for w in programs if ptr[w] < len(programs[w])}
    if stuck:
        shown = ", ".join(f"(pipeline {p}, stage {s}) at {a}" for (p, s), a in sorted(stuck.items())[:6])
        raise ScheduleDeadlock(f"the schedule deadlocks: {len(stuck)} worker(s) never finish: {shown}")


class _Execution:
    """The state of one run_timeline: where each worker is in its program, when it is free, what
    has been published (and when it is available) and who waits for it."""

    def __init__(self, schedule: Schedule, costs: StageCosts, iterations: int) -> None:
        self.pp, self.costs = schedule.pp, costs
        self.ready: dict[tuple, float] = {}
        self.waiting: dict[tuple, list[Worker]] = defaultdict(list)
        self.length = {w: len(program) for w, program in schedule.programs.items()}
        self.programs = {w: program * iterations for w, program in schedule.programs.items()}
        self.ptr = {w: 0 for w in self.programs}
        self.free = {w: 0.0 for w in self.programs}
        self.starts: dict[Worker, list[float]] = {w: [] for w in self.programs}
        self.ends: dict[Worker, list[float]] = {w: [] for w in self.programs}
        self.arrived: dict[tuple[int, int], dict[Worker, float]] = defaultdict(dict)  # (stage, iteration)
        self.live_count = {s: sum(1 for (_, st) in self.programs if st == s) for s in range(self.pp)}
        self.queue = deque(self.programs)

    def finish(self, w: Worker, start: float, end: float, key: tuple | None, available: float) -> None:
        self.starts[w].append(start)
        self.ends[w].append(end)
        self.free[w] = end
        self.ptr[w] += 1
        if key is not None:
            self.ready[key] = available
            for waiter in self.waiting.pop(key, ()):
                self.queue.append(waiter)

    def allreduce(self, w: Worker, stage: int, it: int) -> bool:
        """Arrive at the collective; True when it ran (w was the last live peer), so w goes on."""
        group = self.arrived[(stage, it)]
        if w in group:
            return False
        group[w] = self.free[w]
        if len(group) < self.live_count[stage]:
            return False
        begin = max(group.values())
        end = begin + self.costs.allreduce_s(stage, self.live_count[stage])
        for peer in group:
            self.finish(peer, begin, end, None, end)
            if peer != w:
                self.queue.append(peer)
        return True

    def run(self, w: Worker) -> None:
        """Run w's program until an action waits for a key not yet published (w parks on it) or
        for its stage's all-reduce, or the program ends."""
        program, stage = self.programs[w], w[1]
        while self.ptr[w] < len(program):
            a = program[self.ptr[w]]
            it = self.ptr[w] // self.length[w]
            if a.kind == "AR":
                if not self.allreduce(w, stage, it):
                    break
                continue
            needs = [(*k, it) for k in _needs(a, stage, self.pp)]
            missing = next((k for k in needs if k not in self.ready), None)
            if missing is not None:
                self.waiting[missing].append(w)
                break
            start = max([self.free[w], *(self.ready[k] for k in needs)])
            end, published, available = _run_action(w, a, start, self.costs)
            self.finish(w, start, end, None if published is None else (published, a.pipeline, a.micro, stage, it), available)


def run_timeline(schedule: Schedule, costs: StageCosts, iterations: int = 1) -> Timeline:
    """Start and end of every action of ``iterations`` back-to-back iterations; raises
    ScheduleDeadlock naming the stuck workers.

    Event-driven: a worker runs its program until an action waits for a key not yet published
    (it parks on that key and is re-queued when it appears) or reaches its stage's all-reduce
    (the last peer to arrive runs the collective for all)."""
    costs.check_stages(schedule.pp)
    ex = _Execution(schedule, costs, iterations)
    while ex.queue:
        ex.run(ex.queue.popleft())
    _raise_if_stuck(ex.programs, ex.ptr)
    ends, length = ex.ends, ex.length
    makespan = max((e[-1] for e in ends.values() if e), default=0.0)
    iteration_ends = [max((e[(i + 1) * length[w] - 1] for w, e in ends.items() if length[w]), default=0.0) for i in range(iterations)]
    return Timeline(ex.starts, ends, makespan, iteration_ends)


def iteration_s(schedule: Schedule, costs: StageCosts) -> float:
    return run_timeline(schedule, costs).iteration_s


def steady_state_period_s(schedule: Schedule, costs: StageCosts, iterations: int = 4) -> float:
    """Seconds per iteration once iterations run back to back (staggered optimizer steps)."""
    ends = run_timeline(schedule, costs, max(2, iterations)).iteration_ends
    return ends[-1] - ends[-2]
