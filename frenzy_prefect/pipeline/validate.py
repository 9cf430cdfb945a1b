"""Check a schedule before anyone runs it: complete, on live workers, dependency-ordered,
deadlock-free, normalised like fault-free training, and within the memory bound."""

from __future__ import annotations

from collections import Counter, defaultdict

from frenzy_prefect.pipeline.costs import StageCosts
from frenzy_prefect.pipeline.in_flight import MemoryBound, bounds_per_stage, in_flight_peak
from frenzy_prefect.pipeline.schedule import Schedule
from frenzy_prefect.pipeline.timeline import ScheduleDeadlock, run_timeline
from frenzy_prefect.pipeline.workers import ScheduleInputError

SHOWN = 12


class InvalidSchedule(ScheduleInputError):
    def __init__(self, violations: list[str]):
        self.violations = violations
        more = f"; and {len(violations) - SHOWN} more" if len(violations) > SHOWN else ""
        super().__init__(f"invalid schedule, {len(violations)} violation(s): " + "; ".join(violations[:SHOWN]) + more)


Where = dict[tuple[str, int, int, int], list[tuple[int, int]]]  # (kind, q, j, s) -> [(p, index in p's program)]


def violations(schedule: Schedule, costs: StageCosts | None = None, memory_bound: MemoryBound = None) -> list[str]:
    """Every rule the schedule breaks, as readable lines (empty: valid).

    The checks run in phases; a phase whose input is broken (no such worker, a micro-batch run
    twice) stops before later phases would index into it."""
    out = _worker_violations(schedule)
    if out:
        return out
    where, out = _locate(schedule)
    out += _count_violations(schedule, where)
    if out:
        return out
    out += _dependency_violations(schedule, where)
    out += _program_violations(schedule)
    out += _memory_violations(schedule, memory_bound)
    if not out:
        try:
            run_timeline(schedule, costs or StageCosts.uniform(schedule.pp))
        except ScheduleDeadlock as exc:
            out.append(str(exc))
    return out


def _worker_violations(schedule: Schedule) -> list[str]:
    """Programs exactly on the live workers that exist."""
    dp, pp = schedule.dp, schedule.pp
    out: list[str] = []
    for p, s in schedule.failed:
        if (p, s) in schedule.programs:
            out.append(f"failed worker (pipeline {p}, stage {s}) has actions")
    for p, s in schedule.programs:
        if not (0 <= p < dp and 0 <= s < pp):
            out.append(f"worker (pipeline {p}, stage {s}) does not exist (pipelines 0..{dp - 1}, stages 0..{pp - 1})")
    for s in range(pp):
        for p in schedule.live(s):
            if (p, s) not in schedule.programs:
                out.append(f"live worker (pipeline {p}, stage {s}) has no program")
    return out


def _locate(schedule: Schedule) -> tuple[Where, list[str]]:
    """Where each micro-batch's work runs, and in which position of its worker's program."""
    dp, m = schedule.dp, schedule.microbatches
    out: list[str] = []
    where: Where = defaultdict(list)
    for (p, s), program in schedule.programs.items():
        for i, a in enumerate(program):
            if a.kind not in ("AR", "OPT"):
                if not (0 <= a.pipeline < dp and 0 <= a.micro < m):
                    out.append(f"(pipeline {p}, stage {s}) action {a} names a micro-batch that does not exist")
                    continue
                where[(a.kind, a.pipeline, a.micro, s)].append((p, i))
    return where, out


def _count_violations(schedule: Schedule, where: Where) -> list[str]:
    """Each micro-batch's F, B and W exactly once per stage, all three on one worker."""
    out: list[str] = []
    for s in range(schedule.pp):
        for q in range(schedule.dp):
            for j in range(schedule.microbatches):
                for kind in ("F", "B", "W"):
                    n = len(where.get((kind, q, j, s), ()))
                    if n != 1:
                        out.append(f"micro-batch {j} of pipeline {q} has {n} {kind} at stage {s} (expected exactly 1)")
                hosts = {p for kind in ("F", "B", "W") for p, _ in where.get((kind, q, j, s), ())}
                if len(hosts) > 1:
                    out.append(
                        f"micro-batch {j} of pipeline {q} is split over pipelines {sorted(hosts)} at stage {s}"
                        " (F, B and W must share a worker)"
                    )
    return out


def _dependency_violations(schedule: Schedule, where: Where) -> list[str]:
    """F before B before W, and each transfer once, on the right side of its compute and naming the
    worker that runs the micro-batch at the peer stage. Needs exactly one F, B and W per micro-batch."""
    out: list[str] = []
    for s in range(schedule.pp):
        for q in range(schedule.dp):
            for j in range(schedule.microbatches):
                out += _micro_batch_violations(schedule, where, q, j, s)
    return out


def _micro_batch_violations(schedule: Schedule, where: Where, q: int, j: int, s: int) -> list[str]:
    def host(peer_stage: int) -> int:
        return where[("F", q, j, peer_stage)][0][0]

    def pos(kind: str) -> int:
        return where[(kind, q, j, s)][0][1]

    out: list[str] = []
    f, b, w = pos("F"), pos("B"), pos("W")
    label = f"micro-batch {j} of pipeline {q} at stage {s}"
    if not f < b < w:
        out.append(f"{label}: F, B, W out of order")
    # (kind, must precede (-1) or follow (+1) the consumer/producer, its anchor, the peer stage)
    links = []
    if s > 0:
        links += [("RA", -1, f, s - 1), ("SG", +1, b, s - 1)]
    if s < schedule.pp - 1:
        links += [("SA", +1, f, s + 1), ("RG", -1, b, s + 1)]
    for kind, side, anchor, peer_stage in links:
        found = where.get((kind, q, j, s), [])
        if len(found) != 1:
            out.append(f"{label}: {len(found)} {kind} (expected exactly 1)")
            continue
        p, i = found[0]
        if (i - anchor) * side <= 0:
            out.append(f"{label}: {kind} is on the wrong side of its {'F' if anchor == f else 'B'}")
        named = schedule.programs[(p, s)][i].peer
        if named != host(peer_stage):
            out.append(f"{label}: {kind} names pipeline {named}, but stage {peer_stage} runs it on {host(peer_stage)}")
    return out


def _program_violations(schedule: Schedule) -> list[str]:
    """One all-reduce (dividing like fault-free training) after all compute, then one optimizer step last."""
    out: list[str] = []
    divisor = schedule.divisor
    for (p, s), program in schedule.programs.items():
        kinds = Counter(a.kind for a in program)
        if kinds["AR"] != 1 or kinds["OPT"] != 1:
            out.append(f"(pipeline {p}, stage {s}) needs exactly one AR and one OPT, has {kinds['AR']} and {kinds['OPT']}")
            continue
        ar = next(i for i, a in enumerate(program) if a.kind == "AR")
        if program[ar].divisor != divisor:
            out.append(
                f"(pipeline {p}, stage {s}) divides its gradients by {program[ar].divisor};"
                f" fault-free training divides by dp * microbatches = {divisor}"
            )
        if any(a.kind in ("F", "B", "W") for a in program[ar:]):
            out.append(f"(pipeline {p}, stage {s}) computes after its all-reduce")
        if program[-1].kind != "OPT":
            out.append(f"(pipeline {p}, stage {s}) does not end with its optimizer step")
    return out


def _memory_violations(schedule: Schedule, memory_bound: MemoryBound) -> list[str]:
    bounds = bounds_per_stage(memory_bound, schedule.pp)
    if bounds is None:
        return []
    out: list[str] = []
    for p, s in schedule.programs:
        peak = in_flight_peak(schedule, (p, s))
        if peak > bounds[s]:
            out.append(f"(pipeline {p}, stage {s}) holds {peak} micro-batches in flight; the memory bound of stage {s} is {bounds[s]}")
    return out


def validate(schedule: Schedule, costs: StageCosts | None = None, memory_bound: MemoryBound = None) -> None:
    """Raise InvalidSchedule listing every violation; return None for a valid schedule."""
    found = violations(schedule, costs, memory_bound)
    if found:
        raise InvalidSchedule(found)
