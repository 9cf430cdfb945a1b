"""ReCycle planner cases drawn by hypothesis, and the mutations every planned schedule must be refused for."""

from hypothesis import strategies as st

from frenzy_prefect.pipeline.costs import StageCosts
from frenzy_prefect.pipeline.validate import violations


@st.composite
def cases(draw, max_dp=4, max_pp=4, max_m=8):
    dp, pp, m = draw(st.integers(2, max_dp)), draw(st.integers(1, max_pp)), draw(st.integers(1, max_m))
    key = tuple(draw(st.lists(st.integers(0, dp - 1), min_size=pp, max_size=pp)))
    return dp, pp, m, key


def _costs(pp, data):
    f, b, w = (data.draw(st.floats(0.2, 3.0)) for _ in range(3))
    return StageCosts.uniform(pp, f, b, w, p2p=data.draw(st.floats(0, 0.3)), gradient_transfer=data.draw(st.floats(0, 2)), optimizer=0.1)


def _mutations(schedule):
    """Broken copies: a dropped compute action, a B moved before its F, a wrong divisor."""
    worker = sorted(schedule.programs)[-1]
    program = list(schedule.programs[worker])
    first_w = next(i for i, a in enumerate(program) if a.kind == "W")
    yield "has 0 W", schedule.replaced(worker, program[:first_w] + program[first_w + 1 :])
    f = next(i for i, a in enumerate(program) if a.kind == "F")
    b = next(i for i, a in enumerate(program) if a.kind == "B" and (a.pipeline, a.micro) == (program[f].pipeline, program[f].micro))
    swapped = list(program)
    swapped[f], swapped[b] = swapped[b], swapped[f]
    yield "out of order|wrong side", schedule.replaced(worker, swapped)
    yield (
        "divides its gradients by",
        schedule.replaced(worker, [a._replace(divisor=a.divisor - 1) if a.kind == "AR" else a for a in program]),
    )


def assert_mutations_rejected(schedule, costs) -> None:
    for message, broken in _mutations(schedule):
        found = violations(broken, costs)
        assert found and any(part in line for line in found for part in message.split("|")), (message, found)
