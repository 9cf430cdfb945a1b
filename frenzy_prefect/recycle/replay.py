"""The event loop: replay a node trace against one policy and measure throughput.

Time runs from the trace's first event (``start_s``): the job starts then with whatever nodes
are there -- a grid with holes starts re-routed or re-formed, as its policy decides; launching
costs nothing. Between events the job completes iterations of ``samples_per_iteration``; an
event interrupts the in-flight iteration, which survives (its progress carries over at the new
speed) unless the policy's decision says it is redone. Checkpoints are taken at the first
iteration end past each ``checkpoint_interval_s``; a rollback loses every sample completed since.
A job that resumes after a stall (too few nodes to run) relaunches every rank (``restart_s``),
from its last checkpoint if some stage lost every replica meanwhile.

Throughput is measured two ways: over the fixed window [start_s, start_s + horizon_s]
(completed samples / horizon), and over the span from the first iteration's start to the last
completed iteration's end.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from pydantic import BaseModel, ConfigDict

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.recycle.iteration import IterationModel
from frenzy_prefect.recycle.knobs import Knobs
from frenzy_prefect.recycle.membership import Membership
from frenzy_prefect.recycle.policies.base import Decision, Policy, View
from frenzy_prefect.recycle.traces import FailureTrace

EPS = 1e-9


class RecoveryEvent(BaseModel):
    model_config = ConfigDict(frozen=True)

    time_s: float
    kind: str
    grid: str
    iteration_s: float | None
    downtime_s: float
    delay_s: float
    lost_samples: int
    workers: int
    note: str


class ResilienceResult(BaseModel):
    policy: str
    trace: str
    dp: int
    pp: int
    microbatches: int
    samples_per_iteration: int
    start_s: float
    horizon_s: float
    workers_at_start: int
    completed_samples: int
    throughput: float
    span_throughput: float
    fault_free_throughput: float
    ratio: float
    span_ratio: float
    first_iteration_start_s: float | None
    last_iteration_end_s: float | None
    downtime_s: float
    stalled_s: float
    lost_samples: int
    counts: dict[str, int]
    stage_wipeouts: int
    nodes_outside_grid: int
    spare_fills: int
    events: list[RecoveryEvent]


class _Run:
    """Mutable state of one replay."""

    def __init__(self, samples: int, knobs: Knobs) -> None:
        self.samples, self.knobs = samples, knobs
        self.t = 0.0
        self.cfg: Decision | None = None
        self.pending: tuple[float, Decision] | None = None
        self.progress = 0.0
        self.completed = self.committed = 0
        self.last_checkpoint = 0.0
        self.pause_until = 0.0
        self.first_start: float | None = None
        self.last_end: float | None = None
        self.stalled_s = 0.0

    def advance(self, to: float) -> None:
        while self.t < to - EPS:
            if self.t < self.pause_until - EPS:
                self.t = min(self.pause_until, to)
                continue
            if self.pending and self.pending[0] <= self.t + EPS:
                self.cfg, self.pending = self.pending[1], None
                continue
            stop = min(to, self.pending[0]) if self.pending else to
            if self.cfg is None or self.cfg.iteration_s is None:
                self.stalled_s += stop - self.t
                self.t = stop
                continue
            if self.first_start is None:
                self.first_start = self.t
            remaining = (1 - self.progress) * self.cfg.iteration_s
            if self.t + remaining <= stop + EPS:
                self.t += remaining
                self.progress = 0.0
                self.completed += self.samples
                self.last_end = self.t
                if self.t - self.last_checkpoint >= self.knobs.checkpoint_interval_s - EPS:
                    self.committed, self.last_checkpoint = self.completed, self.t
                    self.pause_until = self.t + self.knobs.checkpoint_write_s
            else:
                self.progress += (stop - self.t) / self.cfg.iteration_s
                self.t = stop

    def apply(self, decision: Decision) -> int:
        """Switch to ``decision`` now; returns the samples rolled back."""
        lost = 0
        if decision.rollback:
            lost, self.completed = self.completed - self.committed, self.committed
        if not decision.keep_in_flight:
            self.progress = 0.0
        self.pause_until = self.t + decision.pause_s
        if decision.rollback:
            self.last_checkpoint = self.pause_until  # the next checkpoint is an interval of training away
        if decision.delay_s > 0 and self.cfg is not None and self.cfg.iteration_s is not None:
            self.pending = (self.pause_until + decision.delay_s, decision)
        else:
            self.cfg, self.pending = decision, None
        return lost


def _resume(decision: Decision, membership: Membership, knobs: Knobs) -> Decision:
    """Leaving a stall relaunches every rank: from the last checkpoint if a stage's state died
    meanwhile, else from the survivors' states."""
    wiped = bool(membership.lost_stages())
    kind = "checkpoint-restart" if wiped or decision.rollback else "reconfigure"
    return replace(
        decision,
        kind=kind,
        rollback=wiped or decision.rollback,
        keep_in_flight=False,
        restore_state=True,
        pause_s=max(decision.pause_s, knobs.restart_s),
        note=decision.note + "; resumed after a stall",
    )


def _window(trace: FailureTrace, samples_per_iteration: int, horizon_s: float | None) -> tuple[float, float]:
    """The measured window's start and length, after checking the inputs that set it."""
    if samples_per_iteration <= 0:
        raise FrenzyError(f"samples per iteration must be positive, got {samples_per_iteration}")
    start = trace.events[0].time_s
    horizon = horizon_s if horizon_s is not None else trace.end_s - start
    if horizon <= 0:
        raise FrenzyError(f"the horizon must be positive (the trace {trace.name} spans {trace.end_s - start:g} s); pass horizon_s")
    return start, horizon


class _Replayed:
    """What the replay of the trace's events recorded, beyond the run's own counters."""

    def __init__(self) -> None:
        self.events: list[RecoveryEvent] = []
        self.change_times: list[float] = []
        self.wipeouts = 0
        self.workers_at_start = 0


def _replay(
    model: IterationModel, trace: FailureTrace, policy: Policy, knobs: Knobs, membership: Membership, run: _Run, start: float, end: float
) -> _Replayed:
    """Feed the trace's events before ``end``, grouped by time, to the membership and the policy,
    and apply each decision to the run."""
    out = _Replayed()
    groups: dict[float, list] = {}
    for event in trace.events:
        if event.time_s < end:
            groups.setdefault(event.time_s, []).append(event)
    for now, group in groups.items():
        first = run.cfg is None
        run.advance(now)
        wiped_before = first or bool(membership.lost_stages())
        changes = [c for e in group for c in membership.apply(e, started=not first)]
        if any(c.kind in ("lost", "filled") for c in changes):
            out.change_times.append(now)
        if not wiped_before and membership.lost_stages():
            out.wipeouts += 1
        decision = policy.react(View(now, membership, model, knobs, changes, first, out.change_times))
        if decision is None:
            continue
        if run.cfg is not None and run.cfg.iteration_s is None and decision.iteration_s is not None:
            decision = _resume(decision, membership, knobs)
        if first:
            out.workers_at_start = membership.occupied
            decision = replace(decision, kind="start", pause_s=0.0, delay_s=0.0, rollback=False)
        lost = run.apply(decision)
        if decision.restore_state:
            membership.restore_state()
        out.events.append(
            RecoveryEvent(
                time_s=now - start,
                kind=decision.kind,
                grid=decision.grid,
                iteration_s=decision.iteration_s,
                downtime_s=decision.pause_s,
                delay_s=decision.delay_s,
                lost_samples=lost,
                workers=membership.occupied,
                note=decision.note,
            )
        )
    return out


def simulate(
    model: IterationModel,
    trace: FailureTrace,
    policy: Policy,
    *,
    samples_per_iteration: int,
    knobs: Knobs | None = None,
    homes: dict[str, int] | None = None,
    fill_vacancies: bool = True,
    horizon_s: float | None = None,
) -> ResilienceResult:
    """Replay ``trace`` on a model.dp x model.pp grid under ``policy``. ``homes`` pins nodes to
    slots (see ``membership``); ``horizon_s`` defaults to the trace's last event."""
    knobs = knobs or Knobs()
    start, horizon = _window(trace, samples_per_iteration, horizon_s)
    end = start + horizon
    membership = Membership(model.dp, model.pp, homes, fill_vacancies)
    run = _Run(samples_per_iteration, knobs)
    run.t = run.last_checkpoint = start
    replayed = _replay(model, trace, policy, knobs, membership, run, start, end)
    run.advance(end)

    events = replayed.events
    fault_free = samples_per_iteration / model.fault_free_s(model.dp, model.pp)
    throughput = run.completed / horizon
    span = (run.last_end - run.first_start) if run.last_end is not None and run.first_start is not None else 0.0
    span_throughput = run.completed / span if span > 0 else 0.0
    counts = dict(Counter(e.kind for e in events))
    return ResilienceResult(
        policy=type(policy).name,
        trace=trace.name,
        dp=model.dp,
        pp=model.pp,
        microbatches=model.microbatches,
        samples_per_iteration=samples_per_iteration,
        start_s=start,
        horizon_s=horizon,
        workers_at_start=replayed.workers_at_start,
        completed_samples=run.completed,
        throughput=throughput,
        span_throughput=span_throughput,
        fault_free_throughput=fault_free,
        ratio=throughput / fault_free,
        span_ratio=span_throughput / fault_free,
        first_iteration_start_s=None if run.first_start is None else run.first_start - start,
        last_iteration_end_s=None if run.last_end is None else run.last_end - start,
        downtime_s=sum(e.downtime_s for e in events if e.kind != "start"),
        stalled_s=run.stalled_s,
        lost_samples=sum(e.lost_samples for e in events),
        counts=counts,
        stage_wipeouts=replayed.wipeouts,
        nodes_outside_grid=len(membership.outside_grid),
        spare_fills=membership.spare_fills,
        events=events,
    )
