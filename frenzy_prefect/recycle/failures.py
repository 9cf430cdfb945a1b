"""Failure normalisation and re-routing: which live peer of a stage runs a failed worker's micro-batches.

Every stage-s worker of every data-parallel pipeline holds the same parameters, and a micro-batch
can be sent from any stage s-1 worker to any stage s worker at the same cost, so a schedule for
one set of failed workers becomes a schedule for any other set with the same number of failures
in every stage by relabelling the pipelines of each stage. The failure *key* (failures per stage)
is all a plan depends on; the *canonical* failed set of a key fails the highest-numbered
pipelines of each stage, and ``pipeline_maps`` relabels a canonical plan onto the actual set.
"""

from __future__ import annotations

from collections.abc import Iterable

from frenzy_prefect.pipeline.workers import ScheduleInputError, Worker, check_shape, live_pipelines

FailureKey = tuple[int, ...]  # failures per stage, length pp


class RecycleInputError(ScheduleInputError):
    """A ReCycle planning input that is out of range: the message names it and what is accepted."""


class NeedsCheckpointRestart(RecycleInputError):
    """Every replica of some stage failed: no live peer holds its parameters, so re-routing cannot
    help; only a restart from a checkpoint (or reconfiguration) can."""

    def __init__(self, stages: list[int], dp: int):
        self.stages = stages
        super().__init__(
            f"stage(s) {', '.join(map(str, stages))} lost all {dp} replicas: no live peer holds their parameters; "
            "this needs a checkpoint restart, not a ReCycle plan"
        )


def normalise(dp: int, pp: int, failed: Iterable[Worker]) -> FailureKey:
    """Failures per stage of a set of failed (pipeline, stage) workers; raises on a worker that does
    not exist and on a stage with no live replica left."""
    check_shape(dp, pp, 1)
    counts = [0] * pp
    for worker in set(failed):
        pipeline, stage = worker
        if not (0 <= pipeline < dp and 0 <= stage < pp):
            raise RecycleInputError(
                f"failed worker (pipeline {pipeline}, stage {stage}) does not exist; pipelines are 0..{dp - 1}, stages 0..{pp - 1}"
            )
        counts[stage] += 1
    return check_key(dp, pp, tuple(counts))


def check_key(dp: int, pp: int, key: Iterable[int]) -> FailureKey:
    """A failure key as a tuple, after checking it has pp entries within 0..dp."""
    key = tuple(key)
    if len(key) != pp:
        raise RecycleInputError(f"a failure key has one count per stage: {pp} entries, got {len(key)} ({key})")
    for stage, count in enumerate(key):
        if count < 0 or count > dp:
            raise RecycleInputError(f"stage {stage} has {dp} replicas; {count} failures there is impossible (accepted: 0..{dp})")
    dead = [s for s, count in enumerate(key) if count == dp]
    if dead:
        raise NeedsCheckpointRestart(dead, dp)
    return key


def key_from_stages(dp: int, pp: int, stages: Iterable[int]) -> FailureKey:
    """``[2, 2, 5]``: two failures in stage 2, one in stage 5 (stages 0-based)."""
    counts = [0] * pp
    for stage in stages:
        if not 0 <= stage < pp:
            raise RecycleInputError(f"stage {stage} does not exist; stages are 0..{pp - 1} (0-based)")
        counts[stage] += 1
    return check_key(dp, pp, counts)


def canonical_failed(dp: int, key: FailureKey) -> frozenset[Worker]:
    """The failed set a key's plans are built for: the last ``key[s]`` pipelines of stage s."""
    return frozenset((p, s) for s, count in enumerate(key) for p in range(dp - count, dp))


def reroute(dp: int, pp: int, microbatches: int, failed: frozenset[Worker]) -> dict[tuple[int, int, int], int]:
    """The live pipeline that runs micro-batch j of pipeline q at stage s, keyed (q, j, s), for every
    micro-batch whose own worker failed. Each stage's re-routed micro-batches are dealt round-robin
    to its live peers, least loaded first, so the peers' extra loads differ by at most one and the
    result is deterministic."""
    check_shape(dp, pp, microbatches)
    hosts: dict[tuple[int, int, int], int] = {}
    for stage in range(pp):
        live = live_pipelines(dp, failed, stage)
        if len(live) == 0:
            raise NeedsCheckpointRestart([stage], dp)
        dead = sorted(p for p in range(dp) if (p, stage) in failed)
        moved = [(q, j) for j in range(microbatches) for q in dead]  # micro-batch-major: each wave spreads out
        for i, (q, j) in enumerate(moved):
            hosts[(q, j, stage)] = live[i % len(live)]
    return hosts


def pipeline_maps(dp: int, failed: frozenset[Worker], key: FailureKey) -> tuple[tuple[int, ...], ...]:
    """Per stage, canonical pipeline -> actual pipeline: the canonical failed pipelines map onto the
    actual failed ones (both sorted), the live ones onto the live ones (both sorted)."""
    canonical = canonical_failed(dp, key)
    maps = []
    for stage in range(len(key)):
        c_live, c_dead = live_pipelines(dp, canonical, stage), [p for p in range(dp) if (p, stage) in canonical]
        a_live, a_dead = live_pipelines(dp, failed, stage), sorted(p for p in range(dp) if (p, stage) in failed)
        mapping = [0] * dp
        for c, a in zip(c_live + c_dead, a_live + a_dead, strict=True):
            mapping[c] = a
        maps.append(tuple(mapping))
    return tuple(maps)
