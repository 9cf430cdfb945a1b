"""The MILP planner (HiGHS through scipy.optimize.milp): optimal placement of every W, and the
start of every F and B, for the F/B order of the list-scheduling planner.

Formulation. Each live worker keeps the order of its F and B actions (own and re-routed work,
as the heuristic planner interleaves them); between consecutive ones sits a gap that runs an
integer number n of W actions. W's of a stage all cost the same and run first-in first-out, so
only these counts matter, not which W goes where (the symmetry that keeps the model small:
one integer per gap instead of a binary per W and position). Variables: the start t of every F/B,
the counts n, each worker's finish, each stage's all-reduce start and the makespan T.

    minimise T  subject to
    t[next] >= t[a] + d(a) + W_s * n[a]                       (no overlap on a worker)
    t[F(q,j,s)] >= t[F(q,j,s-1)] + F_{s-1} + p2p,  t[B(q,j,s)] >= t[B(q,j,s+1)] + B_{s+1} + p2p
    sum of n up to a <= B's up to a;  sum of n = micro-batches hosted    (W after its B, all W)
    F's up to a - sum of n before a <= memory bound                       (in flight, F to W)
    allreduce_s >= finish of every live worker of s;  T >= allreduce_s + AR_s(live) + OPT_s

Assumptions: re-routed micro-batches go to the hosts ``failures.reroute`` chose (balanced), and
the F/B order is the heuristic's, so the MILP decides timing and W placement, not the order of
forwards and backwards; the heuristic's own schedule is a feasible point, so solved to optimality
the MILP is never worse. Times are scaled to the largest forward for the solver.

Solving. The LP relaxation is solved first: when its bound reaches the seed's makespan the seed
is optimal for its order and branch and bound is skipped (most unbounded-memory keys end there).
scipy's HiGHS takes no starting solution; the seed's makespan as a cutoff row (T <= seed) was
tried and dropped: on one 4 x 8 key HiGHS then spent 24 s in the root node without an incumbent;
without the row it solved that key in 4 s.
"optimal" means proved within MIP_REL_GAP (0.1%) of HiGHS's bound for this F/B order.
``time_limit_s`` covers the whole call (seed, model, solve). Branch and bound runs in a child
process (killable_milp): HiGHS gets SOLVER_SHARE of what is left as its own limit, and the child
is killed when all of it is spent. Stopped by the limit with a worse incumbent (or none), the
planner returns the seed; the status then says ``time_limit`` and ``mip_gap`` is measured from
the returned schedule to the best bound known (HiGHS's, or the LP relaxation's if it was killed).
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:  # (SciPy is imported where a MILP is built: ReCycle's live ranks plan with the heuristic)
    from scipy.optimize import LinearConstraint

from frenzy_prefect.pipeline.builder import ComputeItem, assemble
from frenzy_prefect.pipeline.costs import StageCosts
from frenzy_prefect.pipeline.in_flight import MemoryBound
from frenzy_prefect.pipeline.timeline import run_timeline
from frenzy_prefect.pipeline.workers import Worker
from frenzy_prefect.recycle import killable_milp
from frenzy_prefect.recycle.planners.base import Plan, Problem, against_fault_free
from frenzy_prefect.recycle.planners.heuristic import best_schedule

TIME_LIMIT_S = 10.0
SOLVER_SHARE = 0.8  # of the solve's budget, HiGHS's own limit; the child is killed at the whole budget
FINISH_MARGIN_S = 0.3
DISP = False  # HiGHS's log on the console
MIP_REL_GAP = 1e-3  # "optimal": within 0.1% of the bound


class _Rows:
    """Sparse rows lo <= sum(coef * x) <= hi, collected before building the matrix."""

    def __init__(self) -> None:
        self.r: list[int] = []
        self.c: list[int] = []
        self.v: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def add(self, terms: list[tuple[int, float]], lo: float, hi: float) -> None:
        row = len(self.lo)
        for col, coef in terms:
            self.r.append(row)
            self.c.append(col)
            self.v.append(coef)
        self.lo.append(lo)
        self.hi.append(hi)

    def constraint(self, n: int) -> LinearConstraint:
        from scipy.optimize import LinearConstraint
        from scipy.sparse import coo_array

        a = coo_array((self.v, (self.r, self.c)), shape=(len(self.lo), n)).tocsr()
        return LinearConstraint(a, np.array(self.lo), np.array(self.hi))


class Solved(NamedTuple):
    orders: dict[Worker, list[ComputeItem]] | None  # None: no incumbent in time, or the LP proved the cutoff optimal
    optimal: bool  # proved: orders (or, without orders, the cutoff's schedule) cannot be improved
    lower_bound_s: float  # HiGHS's bound on the makespan for this F/B order


class _Columns(NamedTuple):
    """The MILP's variables, by column: each F/B's start time, per F/B the number of W's run right
    after it (integer), each worker's finish, each stage's all-reduce start, the makespan."""

    t_of: dict[tuple[str, int, int, int], int]  # (kind, q, j, stage) -> start-time column
    n_of: dict[Worker, list[int]]  # per worker, per F/B of its order: the W-count column
    finish: dict[Worker, int]
    allreduce: dict[int, int]
    makespan: int
    count: int


def _columns(fb_orders: dict[Worker, list[ComputeItem]], pp: int) -> _Columns:
    col = 0
    t_of: dict[tuple[str, int, int, int], int] = {}
    n_of: dict[Worker, list[int]] = {}
    for w, items in fb_orders.items():
        for kind, q, j in items:
            t_of[(kind, q, j, w[1])] = col
            col += 1
        n_of[w] = list(range(col, col + len(items)))
        col += len(items)
    finish = {w: col + i for i, w in enumerate(fb_orders)}
    col += len(fb_orders)
    allreduce = {s: col + s for s in range(pp)}
    col += pp
    return _Columns(t_of, n_of, finish, allreduce, col, col + 1)


def _rows(problem: Problem, fb_orders: dict[Worker, list[ComputeItem]], cols: _Columns, unit: float) -> _Rows | None:
    """The constraints, in units of ``unit`` seconds; None when a memory bound cannot be met by this order."""
    costs, pp = problem.costs, problem.pp
    dur = {k: [x / unit for x in getattr(costs, f)] for k, f in (("F", "forward_s"), ("B", "backward_input_s"), ("W", "backward_weight_s"))}
    p2p = costs.p2p_s / unit
    inf = np.inf
    t_of, n_of, finish, allreduce = cols.t_of, cols.n_of, cols.finish, cols.allreduce
    rows = _Rows()
    for w, items in fb_orders.items():
        s, ns = w[1], n_of[w]
        wd = dur["W"][s]
        b_seen = f_seen = 0
        cum: list[tuple[int, float]] = []
        for k, (kind, q, j) in enumerate(items):
            me = t_of[(kind, q, j, s)]
            if kind == "F":
                f_seen += 1
                if problem.bounds is not None and f_seen > problem.bounds[s]:
                    # in flight once this F runs, F's so far minus W's before it, within the bound
                    if not cum:
                        return None
                    rows.add(cum, f_seen - problem.bounds[s], inf)
                if s > 0:
                    rows.add([(me, 1.0), (t_of[("F", q, j, s - 1)], -1.0)], dur["F"][s - 1] + p2p, inf)
            else:
                b_seen += 1
                if s < pp - 1:
                    rows.add([(me, 1.0), (t_of[("B", q, j, s + 1)], -1.0)], dur["B"][s + 1] + p2p, inf)
            cum = cum + [(ns[k], 1.0)]
            rows.add(cum, -inf, b_seen)  # W's so far never outrun B's so far
            nxt = t_of[items[k + 1][0], items[k + 1][1], items[k + 1][2], s] if k + 1 < len(items) else finish[w]
            rows.add([(nxt, 1.0), (me, -1.0), (ns[k], -wd)], dur[kind][s], inf)
        rows.add(cum, len(problem.hosted[w]), len(problem.hosted[w]))
        rows.add([(allreduce[s], 1.0), (finish[w], -1.0)], 0.0, inf)
    for s in range(pp):
        live = sum(1 for w in fb_orders if w[1] == s)
        tail = (costs.allreduce_s(s, live) + costs.optimizer_s[s]) / unit
        rows.add([(cols.makespan, 1.0), (allreduce[s], -1.0)], tail, inf)
    return rows


def _orders(fb_orders: dict[Worker, list[ComputeItem]], n_of: dict[Worker, list[int]], x) -> dict[Worker, list[ComputeItem]]:
    """The solution as F/B/W orders: after each F/B its W-count of W's, oldest B's first."""
    counts = {w: [int(round(x[i])) for i in ns] for w, ns in n_of.items()}
    orders: dict[Worker, list[ComputeItem]] = {}
    for w, items in fb_orders.items():
        fifo: deque[tuple[int, int]] = deque()
        out: list[ComputeItem] = []
        for (kind, q, j), n in zip(items, counts[w], strict=True):
            out.append((kind, q, j))
            if kind == "B":
                fifo.append((q, j))
            out += [("W", *fifo.popleft()) for _ in range(n)]
        orders[w] = out
    return orders


def solve(problem: Problem, fb_orders: dict[Worker, list[ComputeItem]], time_limit_s: float, cutoff_s: float = np.inf) -> Solved | None:
    """The MILP over ``fb_orders``; None when it is infeasible (a memory bound the order cannot
    meet). ``cutoff_s``: the makespan of a known schedule; an LP bound that reaches it ends the solve.
    ``time_limit_s``: the LP relaxation and the branch and bound together."""
    from scipy.optimize import Bounds, milp

    unit = max(problem.costs.forward_s) or 1.0
    cols = _columns(fb_orders, problem.pp)
    rows = _rows(problem, fb_orders, cols, unit)
    if rows is None:
        return None
    col = cols.count
    objective = np.zeros(col)
    objective[cols.makespan] = 1.0
    constraints, deadline = rows.constraint(col), time.perf_counter() + time_limit_s
    # The LP relaxation first: when its bound already reaches the cutoff (the seed's makespan), the
    # seed is optimal for this order and the branch and bound, which can take long merely to find
    # an integer point that good, is skipped.
    relaxed = milp(objective, constraints=constraints, bounds=Bounds(0, np.inf), options={"time_limit": time_limit_s, "disp": False})
    if relaxed.status == 2:  # infeasible
        return None
    if relaxed.x is not None and relaxed.fun * unit >= cutoff_s * (1 - 1e-9):
        return Solved(None, True, relaxed.fun * unit)
    integrality = np.zeros(col)
    for ns in cols.n_of.values():
        integrality[ns] = 1
    highs_limit = max(0.05, SOLVER_SHARE * (deadline - time.perf_counter()))
    options = {"time_limit": highs_limit, "disp": DISP, "mip_rel_gap": MIP_REL_GAP}
    result = killable_milp.solve(objective, constraints, integrality, options, kill_after_s=max(0.1, deadline - time.perf_counter()))
    if result is not None and result["status"] == 2:
        return None
    dual = None if result is None else result["dual_bound"]
    bounds = [b for b in (dual, relaxed.fun if relaxed.x is not None else None) if b is not None and np.isfinite(b)]
    bound = max(bounds, default=0.0) * unit
    if result is None or result["x"] is None:
        return Solved(None, False, bound)
    return Solved(_orders(fb_orders, cols.n_of, result["x"]), result["status"] == 0, bound)


@against_fault_free
def plan(
    dp: int,
    pp: int,
    microbatches: int,
    failures_per_stage,
    costs: StageCosts,
    memory_bound: MemoryBound = None,
    *,
    time_limit_s: float = TIME_LIMIT_S,
) -> Plan:
    started = time.perf_counter()
    problem = Problem(dp, pp, microbatches, failures_per_stage, costs, memory_bound)
    seed, seed_timeline = best_schedule(problem)
    fb = {w: [(a.kind, a.pipeline, a.micro) for a in program if a.kind in ("F", "B")] for w, program in seed.programs.items()}
    # What is left, less a margin for turning the solution into a schedule and timing it.
    budget = time_limit_s - (time.perf_counter() - started) - FINISH_MARGIN_S
    solved = solve(problem, fb, max(0.1, budget), cutoff_s=seed_timeline.iteration_s)
    if solved is None:  # cannot happen: the seed is a feasible point
        raise RuntimeError(f"the MILP for failure key {problem.key} is infeasible although its seed schedule is not")
    schedule, timeline = seed, seed_timeline
    if solved.orders is not None:
        candidate = assemble(dp, pp, microbatches, problem.failed, solved.orders)
        candidate_timeline = run_timeline(candidate, costs)
        if candidate_timeline.iteration_s <= seed_timeline.iteration_s:
            schedule, timeline = candidate, candidate_timeline
    gap = max(0.0, (timeline.iteration_s - solved.lower_bound_s) / timeline.iteration_s)
    status = "optimal" if solved.optimal else "time_limit"
    return problem.result(schedule, timeline, "milp", time.perf_counter() - started, status, gap)
