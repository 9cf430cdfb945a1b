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

from frenzy_prefect.recycle.costs import StageCosts
from frenzy_prefect.recycle.in_flight import MemoryBound
from frenzy_prefect.recycle.planners.base import Plan, Problem
from frenzy_prefect.recycle.schedule import ComputeItem, Schedule, assemble
from frenzy_prefect.recycle.failures import Worker
from frenzy_prefect.recycle.timeline import Timeline, run_timeline


def list_schedule(problem: Problem, caps: dict[Worker, int], eager_w: bool) -> dict[Worker, list[ComputeItem]]:
    """Each live worker's F/B/W order, from one greedy simulation."""
    pp, costs, p2p = problem.pp, problem.costs, problem.costs.p2p_s
    f_ready: dict[Worker, dict[tuple[int, int], float]] = {w: {} for w in problem.hosted}
    b_ready: dict[Worker, dict[tuple[int, int], float]] = {w: {} for w in problem.hosted}
    w_pending: dict[Worker, list[tuple[int, int]]] = {w: [] for w in problem.hosted}
    held = dict.fromkeys(problem.hosted, 0)
    free = dict.fromkeys(problem.hosted, 0.0)
    order: dict[Worker, list[ComputeItem]] = {w: [] for w in problem.hosted}
    remaining = {w: 3 * len(mbs) for w, mbs in problem.hosted.items()}
    events: list[tuple[float, int, Worker]] = []
    seq = 0
    for w, mbs in problem.hosted.items():
        if w[1] == 0:
            f_ready[w] = {mb: 0.0 for mb in mbs}
        events.append((0.0, seq, w))
        seq += 1
    heapq.heapify(events)

    def wake(t: float, w: Worker) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, w))

    def earliest(ready: dict[tuple[int, int], float], now: float) -> tuple[int, int] | None:
        best = None
        for mb, t in ready.items():
            if t <= now and (best is None or (mb[1], mb[0]) < (best[1], best[0])):
                best = mb
        return best

    while events:
        now, _, w = heapq.heappop(events)
        if free[w] > now or remaining[w] == 0:
            continue
        s = w[1]
        choice: ComputeItem | None = None
        if eager_w and w_pending[w]:
            choice = ("W", *w_pending[w].pop(0))
        if choice is None:
            mb = earliest(b_ready[w], now)
            if mb is not None:
                del b_ready[w][mb]
                choice = ("B", *mb)
        if choice is None and held[w] < caps[w]:
            mb = earliest(f_ready[w], now)
            if mb is not None:
                del f_ready[w][mb]
                choice = ("F", *mb)
        if choice is None and w_pending[w]:
            choice = ("W", *w_pending[w].pop(0))
        if choice is None:
            continue  # an arrival wakes it
        kind, q, j = choice
        end = now + costs.compute_s(kind, s)
        order[w].append(choice)
        remaining[w] -= 1
        free[w] = end
        wake(end, w)
        if kind == "F":
            held[w] += 1
            if s < pp - 1:
                nxt = (problem.runs_on(q, j, s + 1), s + 1)
                f_ready[nxt][(q, j)] = end + p2p
                wake(end + p2p, nxt)
            else:
                b_ready[w][(q, j)] = end
        elif kind == "B":
            w_pending[w].append((q, j))
            if s > 0:
                prev = (problem.runs_on(q, j, s - 1), s - 1)
                b_ready[prev][(q, j)] = end + p2p
                wake(end + p2p, prev)
        else:
            held[w] -= 1
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


def plan(dp: int, pp: int, microbatches: int, failures_per_stage, costs: StageCosts, memory_bound: MemoryBound = None) -> Plan:
    started = time.perf_counter()
    problem = Problem(dp, pp, microbatches, failures_per_stage, costs, memory_bound)
    schedule, timeline = best_schedule(problem)
    return problem.result(schedule, timeline, "heuristic", time.perf_counter() - started, "heuristic")
