"""Build schedules: ``assemble`` turns each worker's order of F/B/W into a full program (receives,
sends, all-reduce, optimizer step); ``one_f_one_b`` is the fault-free schedule, with W fused to
its B (plain 1F1B) or deferred to fill the drain's bubbles (the zero-bubble shape ReCycle uses)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

from frenzy_prefect.pipeline.schedule import Action, ActionKind, Schedule
from frenzy_prefect.pipeline.workers import ScheduleInputError, Worker, check_shape

ComputeItem = tuple[str, int, int]  # (F|B|W, owner pipeline, micro-batch)
Backward = Literal["fused", "split"]
BACKWARDS: tuple[Backward, ...] = ("fused", "split")


def assemble(dp: int, pp: int, microbatches: int, failed: frozenset[Worker], orders: dict[Worker, Iterable[ComputeItem]]) -> Schedule:
    """A full schedule from each live worker's order of F/B/W: adds the receive before each consumer,
    the send after each producer (to whichever worker runs the micro-batch's neighbouring stage),
    and the stage's all-reduce and optimizer step at the end."""
    orders = {w: list(items) for w, items in orders.items()}
    host = {(q, j, s): p for (p, s), items in orders.items() for kind, q, j in items if kind == "F"}
    divisor = dp * microbatches
    programs: dict[Worker, tuple[Action, ...]] = {}
    for (p, s), items in orders.items():
        out: list[Action] = []
        for kind, q, j in items:
            if kind == "F":
                if s > 0:
                    out.append(Action(ActionKind.RA, q, j, host.get((q, j, s - 1), -1)))
                out.append(Action(ActionKind.F, q, j))
                if s < pp - 1:
                    out.append(Action(ActionKind.SA, q, j, host.get((q, j, s + 1), -1)))
            elif kind == "B":
                if s < pp - 1:
                    out.append(Action(ActionKind.RG, q, j, host.get((q, j, s + 1), -1)))
                out.append(Action(ActionKind.B, q, j))
                if s > 0:
                    out.append(Action(ActionKind.SG, q, j, host.get((q, j, s - 1), -1)))
            else:
                out.append(Action(ActionKind.W, q, j))
        out += [Action(ActionKind.AR, divisor=divisor), Action(ActionKind.OPT)]
        programs[(p, s)] = tuple(out)
    return Schedule.model_construct(dp=dp, pp=pp, microbatches=microbatches, failed=frozenset(failed), programs=programs)


def one_f_one_b_order(micro: Sequence[tuple[int, int]], warmup: int, w_lag: int = 0) -> list[ComputeItem]:
    """1F1B over ``micro`` (owner, index) pairs: ``warmup`` forwards, then F and B alternately,
    then the remaining B's. Each micro-batch's W follows the B ``w_lag`` micro-batches later
    (0: at once, as in 1F1B; the last ``w_lag`` W's run after the last B)."""
    n = len(micro)
    warmup = min(warmup, n)
    order: list[ComputeItem] = [("F", *micro[i]) for i in range(warmup)]
    for i in range(n):
        if warmup + i < n:
            order.append(("F", *micro[warmup + i]))
        order.append(("B", *micro[i]))
        if i >= w_lag:
            order.append(("W", *micro[i - w_lag]))
    order += [("W", *micro[i]) for i in range(max(0, n - w_lag), n)]
    return order


def one_f_one_b(dp: int, pp: int, microbatches: int, backward: Backward = "fused") -> Schedule:
    """The fault-free schedule: every pipeline runs 1F1B over its own micro-batches; stage s warms
    up with pp - s - 1 forwards. ``backward``: "fused" runs each W right after its B (the executor
    runs the pair as one ordinary backward), so stage s holds at most pp - s micro-batches in
    flight; "split" defers stage s's W's by s micro-batches (Zero Bubble's ZB-H1, Qi et al. 2024):
    the later stages' B's, the critical path back to stage 0, no longer wait behind W's, and the
    deferred W's fill the bubbles; every stage holds at most pp in flight (F done, W not yet)."""
    check_shape(dp, pp, microbatches)
    if backward not in BACKWARDS:
        raise ScheduleInputError(f"backward must be one of {', '.join(BACKWARDS)}, got {backward!r}")
    orders = {
        (p, s): one_f_one_b_order([(p, j) for j in range(microbatches)], pp - s - 1, s if backward == "split" else 0)
        for p in range(dp)
        for s in range(pp)
    }
    return assemble(dp, pp, microbatches, frozenset(), orders)
