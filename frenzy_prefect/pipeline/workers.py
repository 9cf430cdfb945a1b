"""Who runs a pipeline schedule: workers (pipeline = data-parallel replica, stage), the shape checks
every schedule shares, and the error a bad schedule input raises."""

from __future__ import annotations

from frenzy_prefect.errors import FrenzyError

Worker = tuple[int, int]  # (pipeline, stage)


class ScheduleInputError(FrenzyError):
    """A schedule input that is out of range: the message names it and what is accepted."""


def check_shape(dp: int, pp: int, microbatches: int) -> None:
    for name, value in (("dp", dp), ("pp", pp), ("microbatches", microbatches)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleInputError(f"{name} must be a positive integer, got {value!r}")


def live_pipelines(dp: int, failed: frozenset[Worker], stage: int) -> list[int]:
    return [p for p in range(dp) if (p, stage) not in failed]
