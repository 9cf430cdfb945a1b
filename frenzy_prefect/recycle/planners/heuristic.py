"""List scheduling: a fast planner that simulates the pipeline and, whenever a worker is free,
runs the most urgent work that is ready.

Priorities on a free worker: a ready B (the previous stage waits for its gradient), then a ready
F if the worker holds fewer than its cap of micro-batches in flight, then a deferred W (needed only
by the stage's all-reduce, so it fills idle time); ties go to the earliest micro-batch index, so
re-routed micro-batches travel with the wave of their index. The eager variant runs each W right
after its B, as 1F1B does. A small portfolio of variants (W eager or deferred, caps of 1F1B's
pp - s or more, clipped by the memory bound) is simulated, and the best timeline wins.
"""

from __future__ import annotations

import heapq
import time

from frenzy_prefect.pipeline.builder import ComputeItem, assemble
from frenzy_prefect.pipeline.costs import StageCosts
from frenzy_prefect.pipeline.in_flight import MemoryBound
from frenzy_prefect.pipeline.schedule import Schedule
from frenzy_prefect.pipeline.timeline import Timeline, compute_needs, run_timeline
from frenzy_prefect.pipeline.workers import Worker
from frenzy_prefect.recycle.planners.base import Plan, Problem, against_fault_free

Ready = dict[tuple[int, int], float]  # (pipeline, micro) -> when its inputs are there


class _Lists:
    """A list-scheduling run's per-worker state: the ready work and what is in flight, and the
    inputs that have arrived for work still missing some."""

    def __init__(self, problem: Problem) -> None:
        workers = problem.hosted
        self.problem = problem
        self.consumers = _consumers(problem.pp)
        self.f_ready: dict[Worker, Ready] = {w: {} for w in workers}
        self.b_ready: dict[Worker, Ready] = {w: {} for w in workers}
        self.w_pending: dict[Worker, list[tuple[int, int]]] = {w: [] for w in workers}  # B done, W not: oldest first
        self.held: dict[Worker, int] = dict.fromkeys(workers, 0)  # micro-batches in flight (F run, W not)
        self.arrived: dict[tuple[Worker, str, int, int], list[float]] = {}
        for w, mbs in workers.items():
            if not compute_needs("F", w[1], problem.pp):  # the first stage: its inputs are there from the start
                self.f_ready[w].update({mb: 0.0 for mb in mbs})

    def hand_on(self, w: Worker, kind: str, q: int, j: int, end: float) -> list[tuple[float, Worker]]:
        """Pass a compute that ends at ``end`` on to the computes that need it (by the timeline's
        rules; ``p2p_s`` later at another stage); returns the other workers to wake, and when."""
        s, pp = w[1], self.problem.pp
        if kind == "F":
            self.held[w] += 1
        elif kind == "W":
            self.held[w] -= 1
        wake = []
        for need_kind, need_stage in self.consumers.get((kind, s), ()):
            target = w if need_stage == s else (self.problem.runs_on(q, j, need_stage), need_stage)
            got = self.arrived.setdefault((target, need_kind, q, j), [])
            got.append(end if target == w else end + self.problem.costs.p2p_s)
            if len(got) < len(compute_needs(need_kind, need_stage, pp)):
                continue
            t = max(got)
            del self.arrived[(target, need_kind, q, j)]
            if need_kind == "W":
                self.w_pending[target].append((q, j))
            else:
                (self.f_ready if need_kind == "F" else self.b_ready)[target][(q, j)] = t
            if target != w:
                wake.append((t, target))
        return wake

    def pick(self, w: Worker, now: float, cap: int, eager_w: bool) -> ComputeItem | None:
        """The most urgent ready work of a free worker: (an eager W,) a B, an F within the cap, a deferred W."""
        if eager_w and self.w_pending[w]:
            return ("W", *self.w_pending[w].pop(0))
        mb = _earliest(self.b_ready[w], now)
        if mb is not None:
            del self.b_ready[w][mb]
            return ("B", *mb)
        if self.held[w] < cap:
            mb = _earliest(self.f_ready[w], now)
            if mb is not None:
                del self.f_ready[w][mb]
                return ("F", *mb)
        if self.w_pending[w]:
            return ("W", *self.w_pending[w].pop(0))
        return None


def _consumers(pp: int) -> dict[tuple[str, int], list[tuple[str, int]]]:
    """Per compute (kind, stage), the computes of the same micro-batch waiting for it: the
    timeline's dependency rules (``compute_needs``), inverted."""
    out: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for s in range(pp):
        for kind in ("F", "B", "W"):
            for need in compute_needs(kind, s, pp):
                out.setdefault(need, []).append((kind, s))
    return out


def _earliest(ready: Ready, now: float) -> tuple[int, int] | None:
    """The ready micro-batch of lowest index (then pipeline): re-routed ones travel with their wave."""
    best = None
    for mb, t in ready.items():
        if t <= now and (best is None or (mb[1], mb[0]) < (best[1], best[0])):
            best = mb
    return best


def list_schedule(problem: Problem, caps: dict[Worker, int], eager_w: bool) -> dict[Worker, list[ComputeItem]]:
    """Each live worker's F/B/W order, from one greedy simulation: an event per worker becoming
    free or an input arriving; a free worker runs the most urgent ready work (``_Lists.pick``)."""
    lists = _Lists(problem)
    free = dict.fromkeys(problem.hosted, 0.0)
    order: dict[Worker, list[ComputeItem]] = {w: [] for w in problem.hosted}
    remaining = {w: 3 * len(mbs) for w, mbs in problem.hosted.items()}
    events = [(0.0, seq, w) for seq, w in enumerate(problem.hosted)]
    seq = len(events) - 1
    heapq.heapify(events)
    while events:
        now, _, w = heapq.heappop(events)
        if free[w] > now or remaining[w] == 0:
            continue
        choice = lists.pick(w, now, caps[w], eager_w)
        if choice is None:
            continue  # an arrival wakes it
        kind, q, j = choice
        end = now + problem.costs.compute_s(kind, w[1])
        order[w].append(choice)
        remaining[w] -= 1
        free[w] = end
        for t, target in [(end, w), *lists.hand_on(w, kind, q, j, end)]:
            seq += 1
            heapq.heappush(events, (t, seq, target))
    stuck = [w for w, n in remaining.items() if n]
    if stuck:  # cannot happen with caps >= 1 (the last stage always frees its held micro-batches)
        raise RuntimeError(f"list scheduling stalled on {stuck[:4]}")
    return order


def variants(problem: Problem) -> list[tuple[dict[Worker, int], bool]]:
    out = []
    for extra in (0, 1, 2, None):
        caps = {}
        for w, mbs in problem.hosted.items():
            base = problem.pp - w[1]
            wanted = len(mbs) if extra is None else base + extra * (len(mbs) - problem.m + (1 if len(mbs) > problem.m else 0))
            caps[w] = max(1, problem.cap(w[1], min(wanted, len(mbs))))
        for eager in (True, False):
            if (caps, eager) not in out:
                out.append((caps, eager))
    return out


def best_schedule(problem: Problem) -> tuple[Schedule, Timeline]:
    best: tuple[Schedule, Timeline] | None = None
    for caps, eager in variants(problem):
        schedule = assemble(problem.dp, problem.pp, problem.m, problem.failed, list_schedule(problem, caps, eager))
        timeline = run_timeline(schedule, problem.costs)
        if best is None or timeline.iteration_s < best[1].iteration_s - 1e-12:
            best = (schedule, timeline)
    assert best is not None
    return best


@against_fault_free
def plan(dp: int, pp: int, microbatches: int, failures_per_stage, costs: StageCosts, memory_bound: MemoryBound = None) -> Plan:
    started = time.perf_counter()
    problem = Problem(dp, pp, microbatches, failures_per_stage, costs, memory_bound)
    schedule, timeline = best_schedule(problem)
    return problem.result(schedule, timeline, "heuristic", time.perf_counter() - started, "heuristic")
