"""The event loop: replay a node trace against one policy and measure throughput.

Time runs from the trace's first event (``start_s``): the job starts then with whatever nodes
are there -- a grid with holes starts re-routed or re-formed, as its policy decides; launching
costs nothing. Between events the job completes iterations of ``samples_per_iteration``.

The interrupted iteration: each policy's decision states what happens to it
(``Decision.keep_in_flight``). Only where the real system salvages it does it survive with its
progress (Bamboo's failover, and a switch that waits for an iteration boundary, as ReCycle's
re-join does); everywhere else -- ReCycle's re-route (the runtime redoes the iteration), Oobleck's
re-instantiation, a dropped pipeline, every restart -- it is redone from its start.

A node the trace adds after the start reaches the job ``join_delay_s`` later (it starts up while
the others keep training; one removed before then never reaches it) -- the same for every
policy, so a join event's time is when the node is up. A switch: the old configuration keeps
running the decision's ``delay_s`` and, for an ``at_boundary`` decision, to the end of its
iteration; then nobody trains for ``pause_s``; then the new configuration runs. A later change
cancels a switch not yet made. Checkpoints are taken at the first iteration end past each ``checkpoint_interval_s``; a
rollback (at the switch) loses every sample completed since. A job that resumes after a stall
(too few nodes to run) relaunches every rank (``restart_s``), from its last checkpoint if some
stage lost every replica meanwhile.

Throughput is measured two ways: over the fixed window [start_s, start_s + horizon_s]
(completed samples / horizon), and over the span from the first iteration's start to the last
completed iteration's end (what Oobleck's artifact simulator reports as average performance).
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
from frenzy_prefect.recycle.traces import FailureTrace, NodeEvent

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
        self.pending: tuple[float, Decision, int] | None = None  # (due time, decision, event index)
        self.progress = 0.0
        self.completed = self.committed = 0
        self.last_checkpoint = 0.0
        self.pause_until = 0.0
        self.first_start: float | None = None
        self.last_end: float | None = None
        self.stalled_s = 0.0
        self.lost: dict[int, int] = {}  # event index -> samples rolled back by its switch

    @property
    def running(self) -> bool:
        return self.cfg is not None and self.cfg.iteration_s is not None

    def _due(self) -> bool:
        """The pending switch happens now: its delay is over and, if it waits for a boundary, the
        running iteration has ended (or nothing is running)."""
        if self.pending is None or self.pending[0] > self.t + EPS:
            return False
        return not self.pending[1].at_boundary or self.progress == 0 or not self.running

    def advance(self, to: float) -> None:
        while self.t < to - EPS:
            if self.t < self.pause_until - EPS:
                self.t = min(self.pause_until, to)
                continue
            if self._due():
                _, decision, index = self.pending  # type: ignore[misc]
                self.pending = None
                self.switch(decision, index)
                continue
            waiting = self.pending is not None and self.pending[0] > self.t + EPS
            stop = min(to, self.pending[0]) if waiting else to  # type: ignore[index]
            if not self.running:
                self.stalled_s += stop - self.t
                self.t = stop
                continue
            self._iterate(stop)

    def _iterate(self, stop: float) -> None:
        """Run the current configuration towards ``stop``, ending at most one iteration."""
        iteration_s = self.cfg.iteration_s  # type: ignore[union-attr]
        if self.first_start is None:
            self.first_start = self.t
        remaining = (1 - self.progress) * iteration_s
        if self.t + remaining > stop + EPS:
            self.progress += (stop - self.t) / iteration_s
            self.t = stop
            return
        self.t += remaining
        self.progress = 0.0
        self.completed += self.samples
        self.last_end = self.t
        if self.t - self.last_checkpoint >= self.knobs.checkpoint_interval_s - EPS:
            self.committed, self.last_checkpoint = self.completed, self.t
            self.pause_until = self.t + self.knobs.checkpoint_write_s

    def apply(self, decision: Decision, index: int) -> None:
        """A decision made now: switch at once, or after its delay / at the next boundary."""
        if (decision.delay_s > 0 or decision.at_boundary) and self.cfg is not None:
            self.pending = (self.t + decision.delay_s, decision, index)
        else:
            self.pending = None
            self.switch(decision, index)

    def switch(self, decision: Decision, index: int) -> None:
        if decision.rollback:
            self.lost[index], self.completed = self.completed - self.committed, self.committed
        if not decision.keep_in_flight:
            self.progress = 0.0
        self.pause_until = max(self.pause_until, self.t + decision.pause_s)
        if decision.rollback:
            self.last_checkpoint = self.pause_until  # the next checkpoint is an interval of training away
        self.cfg = decision


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
        self.decisions: list[tuple[float, Decision, int]] = []  # (time from start, decision, workers)
        self.change_times: list[float] = []
        self.wipeouts = 0
        self.workers_at_start = 0


def arrivals(trace: FailureTrace, join_delay_s: float) -> list[NodeEvent]:
    """The trace as the job sees it: a node added after the first instant is up ``join_delay_s``
    later; a node removed before it is up never joins (both its events drop)."""
    start = trace.events[0].time_s
    up: dict[str, float] = {}
    out: list[NodeEvent] = []
    for event in trace.events:
        if event.kind == "add":
            up[event.node] = event.time_s + (join_delay_s if event.time_s > start else 0.0)
            out.append(event.model_copy(update={"time_s": up[event.node]}))
        elif up.pop(event.node) <= event.time_s:
            out.append(event)
        else:
            out.remove(next(e for e in reversed(out) if e.node == event.node and e.kind == "add"))
    return sorted(out, key=lambda e: e.time_s)  # stable: ties keep the trace's order


def _replay(
    model: IterationModel, trace: FailureTrace, policy: Policy, knobs: Knobs, membership: Membership, run: _Run, start: float, end: float
) -> _Replayed:
    """Feed the trace's events before ``end``, grouped by time, to the membership and the policy,
    and apply each decision to the run."""
    out = _Replayed()
    groups: dict[float, list[NodeEvent]] = {}
    for event in arrivals(trace, knobs.join_delay_s):
        if event.time_s < end:
            groups.setdefault(event.time_s, []).append(event)
    for now, group in sorted(groups.items()):
        first = run.cfg is None
        run.advance(now)
        wiped_before = first or bool(membership.lost_stages())
        changes = [c for e in group for c in membership.apply(e, started=not first)]
        if any(c.kind in ("lost", "filled") for c in changes):
            out.change_times.append(now)
        if not wiped_before and membership.lost_stages():
            out.wipeouts += 1
        decision = policy.react(View(now, membership, model, knobs, changes, first, out.change_times, start))
        if decision is None:
            continue
        if decision.iteration_s is None and decision.kind != "stall":  # the step times say these workers cannot run
            decision = replace(decision, kind="stall", note=f"{decision.note}; cannot run on {membership.occupied} workers")
        if run.cfg is not None and not run.running and decision.iteration_s is not None:
            decision = _resume(decision, membership, knobs)
        if first:
            out.workers_at_start = membership.occupied
            decision = replace(decision, kind="start", pause_s=0.0, delay_s=0.0, at_boundary=False, rollback=False)
        run.apply(decision, len(out.decisions))
        if decision.restore_state:
            membership.restore_state()
        out.decisions.append((now - start, decision, membership.occupied))
    return out


def _events(replayed: _Replayed, run: _Run) -> list[RecoveryEvent]:
    return [
        RecoveryEvent(
            time_s=time_s,
            kind=d.kind,
            grid=d.grid,
            iteration_s=d.iteration_s,
            downtime_s=d.pause_s,
            delay_s=d.delay_s,
            lost_samples=run.lost.get(index, 0),
            workers=workers,
            note=d.note,
        )
        for index, (time_s, d, workers) in enumerate(replayed.decisions)
    ]


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
    full_grid_s = model.fault_free_s(model.dp, model.pp)
    if full_grid_s is None:
        raise FrenzyError(f"the full {model.dp} x {model.pp} grid cannot run by its step times; nothing to compare throughput against")
    end = start + horizon
    membership = Membership(model.dp, model.pp, homes, fill_vacancies)
    run = _Run(samples_per_iteration, knobs)
    run.t = run.last_checkpoint = start
    replayed = _replay(model, trace, policy, knobs, membership, run, start, end)
    run.advance(end)

    events = _events(replayed, run)
    fault_free = samples_per_iteration / full_grid_s
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
