"""ReCycle on live ranks: this rank's optimizer steps through failures and rejoins, without a restart.

Each step runs the current generation's schedule (``generations.py``): fault-free, or the
planner's adapted schedule for the failed workers (their micro-batches re-routed to live peers
of their stage, W's deferred into bubbles; ``recycle.cache``), looked up in milliseconds.

- **A failure** shows as a failed transfer or collective with a dead rank, or as a death in the
  store's log while waiting at the commit point. The interrupted iteration is *redone*: no
  member stepped (the commit point), so the survivors discard its gradients, form the next
  generation without the dead ranks, look up the adapted schedule and run the same step again on
  the same global batch. Micro-batches done before the failure are not salvaged: what they left
  is spread over ranks that may be dead, and the planner's schedules start from an empty pipeline.
- **A rejoin**: a replacement (its supervisor restarts the trainer, ``supervisor.py``) asks to
  join; the next commit point admits it, the members form the next generation with it, a live
  replica of its stage sends it the stage's state (``peer_state.py``), and the fault-free
  schedule returns from the next step.
- **A rank away for long** (``recycle.replan``): once a smaller layout over the live ranks is
  predicted faster than re-routing and the missing ranks have been away past the horizon, a
  commit point decides to re-plan; from the next step the members write the checkpoint of the
  step they committed and train the smaller plan, resumed from it (DCP reshards). A replacement
  that arrives after is admitted as the run's own plan resumes, from the checkpoint of the last
  committed step. A failure in a layout that cannot re-route (one pipeline, or one stage), or
  during a switch, restarts every rank from the last checkpoint.
- **A stage with no live replica** cannot be re-routed: the survivors stop with
  NeedsCheckpointRestart and torchrun restarts every rank from the last checkpoint
  (``max_restarts``). Checkpoints are written by whoever is alive (every stage has a replica).
- **A re-route that would not fit** in a survivor's GPU (predicted per worker,
  ``recycle.fits``; the allocator fitted the plan for ``recycle_failures`` failed workers in a
  stage) is planned again with fewer micro-batches in flight per worker, the most that fit. If
  not even one fits, the survivors stop with ScheduleWouldNotFit, saying what it would need, and
  torchrun restarts every rank from the last checkpoint.

Only ZeRO-0 pipelines (dp >= 2, pp >= 2, tp = 1) keep a copy of every stage on other ranks;
``spec.layout.check_resilience`` refuses the rest (the allocator chooses among the others).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TypeVar

import torch
import torch.distributed as dist

from frenzy_prefect.errors import FrenzyError, exception_chain
from frenzy_prefect.pipeline.costs import StageCosts
from frenzy_prefect.pipeline.schedule import Schedule
from frenzy_prefect.recycle.cache import PlanCache
from frenzy_prefect.recycle.failures import NeedsCheckpointRestart
from frenzy_prefect.recycle.fits import fitting_schedule
from frenzy_prefect.recycle.replan import Replan, smaller_layout
from frenzy_prefect.spec.plan import ParallelPlan, TrainingJob
from frenzy_prefect.training.data import step_seed
from frenzy_prefect.training.engine import Engine, MicroBatch
from frenzy_prefect.training.resilient.generations import Generation, Interrupted, Position
from frenzy_prefect.training.resilient.liveness import Log
from frenzy_prefect.training.resilient.peer_state import share_stage_state
from frenzy_prefect.training.trainer import Notify, Progress, resume

T = TypeVar("T")
STEP, CHECKPOINT = 0, 1  # the phases of a step (Position)


class RecycleSteps:
    """This rank's steps under ReCycle. ``step(n, batches, progress)`` runs step n to its optimizer
    update, through any failure, and returns the mean loss; ``batches(replica)`` gives a replica's
    micro-batches of that step (the rank reads other replicas' when it runs their work). The
    planner's schedules come from uniform stage costs: they decide only the order of the work.

    ``job`` and ``engine`` are those of the plan trained now: the run's own, or after a re-plan a
    smaller one, whose rank r is held by global rank ``ranks[r]``. ``build(job, rank, live)``
    builds an engine; ``save(step)`` writes step's checkpoint unless it is written."""

    def __init__(
        self,
        job: TrainingJob,
        engine: Engine,
        generation: Generation,
        notify: Notify,
        log: Callable[[str], None],
        progress: Progress,
        agree: Callable[[int], None],
        build: Callable[[TrainingJob, int, list[int]], Engine],
        save: Callable[[int], None],
    ) -> None:
        self.own_job, self.job, self.engine, self.generation = job, job, engine, generation
        self.own_ranks = list(range(job.allocation.plan.gpus))
        self.ranks = self.own_ranks
        self.notify, self.log, self.progress, self.agree, self.build, self.save = notify, log, progress, agree, build, save
        self.rejoins = Log(generation.store, "rejoin")
        self.in_flight: int | None = None  # the schedule's in-flight bound, when it needed one to fit
        self.cache = self._cache()
        self.schedule = self._schedule()
        self.admitted: list = []
        self.replanning = False  # the last commit decided to re-plan from the next step
        self.away_since: float | None = None  # since when (monotonic) the plan has missed ranks
        self.replan: Replan | None = None  # the smaller layout to re-plan to, while ranks are missing
        self.survived, self.current = progress.survived, 0  # the run's record (SurvivedFailure fields)
        self.commit_s = 0.0  # time spent deciding at commit points (what plain training does not pay)

    @property
    def plan(self) -> ParallelPlan:
        return self.job.allocation.plan

    def _cache(self) -> PlanCache | None:
        """ReCycle's plans for the plan trained now; None where it cannot re-route (a re-plan's
        smaller layout may have one pipeline or one stage)."""
        plan = self.plan
        if plan.dp < 2 or plan.pp < 2:
            return None
        micro_batches = plan.accumulation(self.job.request.global_batch)
        return PlanCache(plan.dp, plan.pp, micro_batches, StageCosts.uniform(plan.pp), plan_on_demand=True)

    def _live(self) -> list[int]:
        """The plan's ranks whose holders are members."""
        return [r for r, holder in enumerate(self.ranks) if holder in self.generation.members]

    def _failed_workers(self) -> set[tuple[int, int]]:
        return {self.plan.coordinates(r)[1::-1] for r, holder in enumerate(self.ranks) if holder not in self.generation.members}

    def _schedule(self) -> Schedule | None:
        # NeedsCheckpointRestart when a stage has no replica left; ScheduleWouldNotFit when not even
        # one micro-batch in flight per worker fits (more failures than the plan was fitted for)
        failed = self._failed_workers()
        if self.cache is None:
            if failed:
                raise NeedsCheckpointRestart(sorted({stage for _, stage in failed}), self.plan.dp)
            return None  # the engine's fault-free 1F1B
        schedule, self.in_flight = fitting_schedule(self.job, self.cache, failed)
        if self.in_flight is not None:
            self.log(f"the planner's schedule would not fit the GPUs: at most {self.in_flight} micro-batch(es) in flight per worker")
        return schedule

    def step(self, step: int, batches: Callable[[int], list[MicroBatch]], progress: Callable[[], dict]) -> float:
        """Run ``step`` through any failure; first admit the replacements the last commit point
        let in, or re-plan if it so decided (at a step's start every member is at the same
        point; ``progress()`` is what replacements are told of it)."""
        self.current = step
        if self.admitted:
            self._admit(step, progress)
        elif self.replanning:
            self._replan(step)
        return self.survive(lambda: self._attempt(step, batches), (step, STEP))

    def survive(self, action: Callable[[], T], position: Position, skipped: Callable[[], T] | None = None) -> T:
        """``action`` (collective on every member) at ``position``, run again by the survivors
        after a failure interrupts it; ``skipped()`` instead when another survivor had completed
        it (a checkpoint) and gone on."""
        while True:
            try:
                return action()
            except Interrupted as exc:
                cause: Exception = exc
            except RuntimeError as exc:  # gloo/NCCL: a transfer or collective with a dead rank
                cause = exc
                if position[1] == STEP:
                    self.generation.abort(position[0])
            resume = self._recover(position, without_frames(cause))
            if resume > position:
                if skipped is None:
                    raise FrenzyError(f"survivors resume at {resume}, past this rank's {position}, which cannot be skipped")
                return skipped()

    def _attempt(self, step: int, batches: Callable[[int], list[MicroBatch]]) -> float:
        plan, read = self.plan, {}

        def replica(pipeline: int) -> list[MicroBatch]:
            if pipeline not in read:
                read[pipeline] = batches(pipeline)
            return read[pipeline]

        def commit(loss: float) -> float:
            total = torch.tensor(loss, dtype=torch.float64, device=self.engine.device)
            dist.all_reduce(total)
            arrived = time.perf_counter()
            self.admitted, self.replanning = self.generation.commit(step, self.rejoins, self._replan_due)
            self.commit_s += time.perf_counter() - arrived
            return total.item() / (plan.dp * plan.tp)  # the last stage's ranks hold the loss

        torch.manual_seed(step_seed(self.job.request.seed, step))
        own = replica(self.engine.replica)
        return self.engine.step(own, schedule=self.schedule, source=lambda p, j: replica(p)[j], commit=commit)

    def _recover(self, position: Position, cause: Exception) -> Position:
        """Form the next generation without the failed ranks; returns where the survivors resume."""
        began, before = time.perf_counter(), set(self.generation.members)
        self.engine.discard_gradients()
        self.engine.leave_groups()
        self.generation, resume, furthest = self.generation.after_failure(position)
        failed = sorted(before - set(self.generation.members))
        if not failed:
            raise cause  # nobody died: a real error, not a failure to survive
        self.engine.regroup(self._live())
        self.agree(self.generation.members.index(furthest))
        self.schedule = self._schedule()
        self._missing_changed()
        downtime = time.perf_counter() - began
        self.record("failed", failed, downtime)
        self.log(f"rank(s) {failed} failed; {len(self.generation.members)} ranks carry on re-routed ({downtime:.3f} s)")
        self.notify("rank-failed", {"ranks": failed, "cause": f"{type(cause).__name__}: {cause}"[:300]})
        self.notify("recovered", {"ranks": failed, "downtime_s": downtime, "members": self.generation.members})
        return resume

    def _missing_changed(self) -> None:
        """After the members changed: while ranks are missing, when they went and what to re-plan to."""
        failed = self._failed_workers()
        if not failed:
            self.away_since, self.replan = None, None
            return
        self.away_since = self.away_since or time.monotonic()
        self.replan = None
        if self.job.request.replan_after_s is not None:
            share = self.cache.lookup(failed).plan.iteration_s / self.cache.lookup(()).plan.iteration_s
            self.replan = smaller_layout(self.job, len(self.generation.members), share)

    def _replan_due(self) -> bool:
        """(The member deciding at a commit point) whether the live ranks re-plan now: a smaller
        layout is predicted faster and the missing ranks have been away past the horizon (one
        measured checkpoint needed for the automatic one)."""
        if self.replan is None:
            return False
        after = self.job.request.replan_after_s
        if after == "auto":
            if self.progress.save_s is None:
                return False
            after = self.replan.horizon_s(self.progress.save_s)
        return time.monotonic() - self.away_since >= after

    def _replan(self, step: int) -> None:
        """Re-plan the members to the smaller layout, from step - 1's checkpoint."""
        began, target, failed = time.perf_counter(), self.replan, sorted(set(self.ranks) - set(self.generation.members))
        away = time.monotonic() - self.away_since
        self.replanning = False
        self.save(step - 1)
        self._switch(_on_plan(self.own_job, target.plan), list(self.generation.members))
        downtime = time.perf_counter() - began
        label, gain = target.plan.label(), target.rerouted_s / target.step_s
        self.record("replanned", self.generation.members, downtime, plan=label)
        self.log(
            f"rank(s) {failed} away {away:.1f} s: the {len(self.ranks)} live ranks re-plan to {label} from step {step} "
            f"(predicted {gain:.2f}x re-routing's speed; {downtime:.3f} s)"
        )
        self.notify("replanned", {"step": step, "plan": label, "ranks": self.ranks, "downtime_s": downtime})

    def _switch(self, job: TrainingJob, ranks: list[int]) -> None:
        """Train ``job``'s plan from now, its rank r held by ``ranks[r]``, from the newest checkpoint."""
        self.engine.leave_groups()
        self.job, self.ranks = job, ranks
        self.engine = self.build(job, ranks.index(self.generation.rank), self._live())
        resume(job, self.engine, self.log)
        self.cache = self._cache()
        self.schedule = self._schedule()
        self._missing_changed()

    def _admit(self, step: int, progress: Callable[[], dict]) -> None:
        """Admit the replacements; after a re-plan, the run's own plan resumes with them from
        step - 1's checkpoint, else a live replica of their stage sends them its state."""
        began, admitted = time.perf_counter(), self.admitted
        ranks = sorted(r for r, _ in admitted)
        old, replanned = self.generation.members, self.ranks != self.own_ranks
        if replanned:
            self.save(step - 1)
        self.generation = self.generation.admitting(admitted, {"progress": progress(), "admitted": ranks, "reload": replanned})
        self.admitted = []
        if replanned:
            self._switch(self.own_job, self.own_ranks)
        else:
            self.engine.regroup(self._live())
            share_from_live_replica(self.engine, old, set(ranks))
            self.schedule = self._schedule()
            self._missing_changed()
        downtime = time.perf_counter() - began
        self.record("rejoined", ranks, downtime, plan=self.plan.label() if replanned else None)
        self.log(f"rank(s) {ranks} rejoined before step {step}{' on ' + self.plan.label() if replanned else ''} ({downtime:.3f} s)")
        self.notify("rejoined", {"step": step, "ranks": ranks, "downtime_s": downtime, "members": self.generation.members})

    def record(self, kind: str, ranks: list[int], downtime_s: float, plan: str | None = None) -> None:
        """Add a failure survived, a re-plan or a rejoin, at the current step, to the run's record."""
        at = datetime.now(UTC).isoformat(timespec="milliseconds")
        entry = {"at": at, "step": self.current, "kind": kind, "ranks": ranks, "downtime_s": round(downtime_s, 4)}
        extra = {"in_flight": self.in_flight, "plan": plan}
        self.survived.append(entry | {k: v for k, v in extra.items() if v is not None})


def _on_plan(job: TrainingJob, plan: ParallelPlan) -> TrainingJob:
    """``job`` on ``plan`` (its placements stay: the ranks run where they ran)."""
    return job.model_copy(update={"allocation": job.allocation.model_copy(update={"plan": plan})})


def without_frames(exc: BaseException) -> BaseException:
    """``exc`` and the exceptions it was raised from, without their tracebacks: their frames hold
    the interrupted transfers and collectives, and those the broken process groups, whose
    connections close only once nothing holds them (a checkpoint's failure arrives wrapped)."""
    for link in exception_chain(exc):
        link.__traceback__ = None
    return exc


def share_from_live_replica(engine: Engine, old_members: list[int], replacements: set[int]) -> None:
    """Collective over the stages that have a replacement: the lowest live replica of the stage
    sends its state (``peer_state``)."""
    plan = engine.plan
    stage_ranks = [plan.rank_of(engine.stage, d, 0) for d in range(plan.dp)]
    if not replacements & set(stage_ranks):
        return
    source = min(r for r in stage_ranks if r in old_members and r not in replacements)
    share_stage_state(engine, engine.position[source], replacements)
