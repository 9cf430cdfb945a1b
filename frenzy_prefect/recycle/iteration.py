"""How long one training iteration takes on a grid, with and without failures: the only thing
the failure replay needs to know about the model and the hardware.

One lookup serves every policy: ``layout_s(stages)``, the iteration time of pipelines with these
stage counts (None: that configuration cannot run). Two sources behind it: the project's
throughput model (``predict_step``, per grid shape; pipelines of different depths each contribute
their share of the rate), or a step-time table of measured/published numbers keyed by worker
count, read at the number of workers the configuration runs on -- for Oobleck's templates and for
ReCycle's grid with holes, every alive worker. ReCycle's iteration time under failures
(``rerouted_s``) comes from the planner (``planned_reroute``: the heuristic's schedule for each
failure key, per-action costs inverted from the fault-free step) unless another callable is given;
with a table, it is never faster than the table's time for the alive workers (no policy gets more
out of n workers than the table says n workers do), and where the table says the alive count
cannot run, ReCycle stalls too. ``balanced_reroute_bound`` (pessimistic) and
``bubble_filling_bound`` (optimistic, though W deferral can beat it) are analytic references, for
tests and for bracketing the planner.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Protocol

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.spec.gpu import GpuType
from frenzy_prefect.spec.model import ModelSpec

Reroute = Callable[[tuple[int, ...]], float]
FaultFree = Callable[[int, int], float | None]


class IterationModel(Protocol):
    """One iteration always processes the full global batch (``samples_per_iteration``)."""

    dp: int
    pp: int
    microbatches: int

    def layout_s(self, stages: Sequence[int]) -> float | None:
        """One iteration of the full global batch on pipelines of these stage counts (layers
        re-partitioned over each pipeline's stages); None: this configuration cannot run."""
        ...

    def fault_free_s(self, dp: int, pp: int) -> float | None:
        """``layout_s`` of a homogeneous dp x pp grid."""
        ...

    def rerouted_s(self, failures_per_stage: tuple[int, ...]) -> float | None:
        """ReCycle's iteration time on the original grid with these failures per stage; None: the
        alive workers cannot run the job."""
        ...


def planned_reroute(fault_free_s: float, dp: int, pp: int, microbatches: int, planner_name: str = "heuristic") -> Reroute:
    """ReCycle's iteration times from the planner's schedules: F, B, W, send, all-reduce and
    optimizer costs inverted from the fault-free step (``fault_free.costs_from_fault_free_step``), each
    failure key planned when first met."""
    from frenzy_prefect.recycle.cache import PlanCache
    from frenzy_prefect.recycle.fault_free import costs_from_fault_free_step

    costs = costs_from_fault_free_step(fault_free_s, dp, pp, microbatches)
    return PlanCache(dp, pp, microbatches, costs, max_failures=0, planner_name=planner_name, plan_on_demand=True).rerouted_s


def balanced_reroute_bound(fault_free_s: float, dp: int) -> Reroute:
    """PESSIMISTIC BOUND, not the planner: the stage with the fewest live replicas does all of its
    stage's micro-batches on dp - f_s workers, so the iteration stretches by max_s dp / (dp - f_s).
    No re-routed work is absorbed in bubbles (ReCycle's decoupled backprop and staggered
    optimizer are ignored), so the real planner's schedules can only be faster."""

    def rerouted_s(failures_per_stage: tuple[int, ...]) -> float:
        return fault_free_s * max(dp / (dp - f) for f in failures_per_stage)

    return rerouted_s


def bubble_filling_bound(fault_free_s: float, dp: int, pp: int, microbatches: int) -> Reroute:
    """OPTIMISTIC BOUND, not the planner: the most loaded worker's m * dp / (dp - f_s)
    micro-batches fill its 1F1B time slots, the m busy ones plus the pp - 1 bubbles, perfectly
    (what decoupled backprop and the staggered optimizer aim at); beyond that the iteration
    stretches. No schedule can beat it, so with ``balanced_reroute_bound`` it brackets the planner."""
    slots = microbatches + pp - 1

    def rerouted_s(failures_per_stage: tuple[int, ...]) -> float:
        load = max(microbatches * dp / (dp - f) for f in failures_per_stage)
        return fault_free_s * max(1.0, load / slots)

    return rerouted_s


@dataclass(frozen=True)
class IterationTimes:
    """An IterationModel from two callables. ``fault_free(d, p)``: a homogeneous d x p grid's
    iteration (None: cannot run). ``reroute`` defaults to ``planned_reroute`` (the heuristic
    planner, keys planned on first use). ``by_workers``: a step-time table's lookup by worker
    count; when given, every configuration is read from it at the workers it runs on."""

    dp: int
    pp: int
    microbatches: int
    fault_free: FaultFree
    reroute: Reroute | None = None
    by_workers: Callable[[int], float | None] | None = None

    def layout_s(self, stages: Sequence[int]) -> float | None:
        if not stages or min(stages) <= 0:
            raise FrenzyError(f"a layout needs at least one pipeline of at least one stage, got {list(stages)}")
        if self.by_workers is not None:
            return self.by_workers(sum(stages))
        # each of the P pipelines takes 1/P of the global batch, at the rate of a homogeneous P x k grid
        times = [self.fault_free(len(stages), k) for k in stages]
        if any(t is None for t in times):
            return None
        return 1 / sum(1 / (len(stages) * t) for t in times)  # type: ignore[operator]

    def fault_free_s(self, dp: int, pp: int) -> float | None:
        return self.layout_s((pp,) * dp)

    def rerouted_s(self, failures_per_stage: tuple[int, ...]) -> float | None:
        if len(failures_per_stage) != self.pp:
            raise FrenzyError(f"failures per stage must have {self.pp} entries (one per stage), got {len(failures_per_stage)}")
        if any(f < 0 or f >= self.dp for f in failures_per_stage):
            raise FrenzyError(
                f"failures per stage {failures_per_stage}: each must be in 0..{self.dp - 1};"
                " a stage with no live replica cannot be re-routed around"
            )
        if not any(failures_per_stage):
            return self.full_grid_s
        planned = (self.reroute or self._planned)(failures_per_stage)
        if self.by_workers is None:
            return planned
        alive = self.by_workers(self.dp * self.pp - sum(failures_per_stage))
        return None if alive is None else max(planned, alive)

    @cached_property
    def full_grid_s(self) -> float:
        """The original grid's fault-free iteration: what throughput ratios are relative to."""
        full = self.fault_free_s(self.dp, self.pp)
        if full is None:
            raise FrenzyError(f"the full {self.dp} x {self.pp} grid cannot run by its step times; nothing to compare against")
        return full

    @cached_property
    def _planned(self) -> Reroute:
        return planned_reroute(self.full_grid_s, self.dp, self.pp, self.microbatches)


def from_throughput_model(
    model: ModelSpec,
    gpu: GpuType,
    *,
    dp: int,
    pp: int,
    microbatches: int,
    micro_batch: int = 1,
    seq_len: int | None = None,
    precision: str = "bf16",
    reroute: Reroute | None = None,
) -> IterationTimes:
    """Fault-free times from ``predict_step``. The global batch (dp * microbatches * micro_batch)
    stays fixed when a grid shrinks: fewer pipelines accumulate more micro-batches; when it does
    not divide, the step is predicted for the next larger batch and scaled back."""
    from frenzy_prefect.allocator.step_time import predict_step
    from frenzy_prefect.spec.plan import ParallelPlan
    from frenzy_prefect.spec.workload import Workload

    global_batch = dp * microbatches * micro_batch
    seq = model.max_seq_len if seq_len is None else seq_len

    def fault_free(d: int, p: int) -> float:
        accumulation = math.ceil(global_batch / (d * micro_batch))
        padded = accumulation * d * micro_batch
        plan = ParallelPlan(dp=d, pp=p, micro_batch=micro_batch)
        step = predict_step(model, plan, Workload(global_batch=padded, seq_len=seq, precision=precision), gpu=gpu)
        return step.seconds * global_batch / padded

    return IterationTimes(dp, pp, microbatches, fault_free, reroute)


@dataclass(frozen=True)
class StepTimeTable:
    """Fault-free step seconds by number of alive workers, e.g. a system's published throughput.

    File format (JSON): ``{"32": 1.20, "24": 1.71, "16": 2.55, "15": 0}`` -- keys are worker
    counts (positive integers), values the seconds of one step of the same global batch; 0 means
    the job cannot run on that many workers (e.g. the model does not fit), so a policy stalls
    there. For a count between two entries, throughput (1/step) is interpolated linearly (a
    neighbour that cannot run makes the count unrunnable too); below the smallest entry
    throughput scales in proportion to the workers (per-worker throughput held), unless that entry
    cannot run; above the largest entry the largest entry's time is used (extra workers beyond
    the table add nothing). The grid (dp * pp) shape does not matter, only its worker count."""

    seconds: dict[int, float]

    def step_s(self, workers: int) -> float | None:
        """Seconds per step on ``workers`` workers; None: cannot run on that many."""
        if workers <= 0:
            raise FrenzyError(f"a step needs at least one worker, got {workers}")
        counts = sorted(self.seconds)
        if workers in self.seconds:
            return self.seconds[workers] or None
        if workers < counts[0]:
            return self.seconds[counts[0]] * counts[0] / workers or None
        if workers > counts[-1]:
            return self.seconds[counts[-1]] or None
        upper = next(c for c in counts if c > workers)
        lower = max(c for c in counts if c < workers)
        if not self.seconds[lower] or not self.seconds[upper]:
            return None
        weight = (workers - lower) / (upper - lower)
        rate = (1 - weight) / self.seconds[lower] + weight / self.seconds[upper]
        return 1 / rate


def load_step_time_table(path: Path) -> StepTimeTable:
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as exc:
        raise FrenzyError(f"cannot read step-time table {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise FrenzyError(
            f'{path}:{exc.lineno}:{exc.colno}: not JSON ({exc.msg}); expected {{"alive workers": step seconds, ...}}'
        ) from None
    if not isinstance(raw, dict) or not raw:
        raise FrenzyError(f'{path}: expected a non-empty JSON object {{"alive workers": step seconds, ...}}, e.g. {{"32": 1.2, "16": 2.3}}')
    seconds: dict[int, float] = {}
    for key, value in raw.items():
        if not str(key).isdigit() or int(key) <= 0:
            raise FrenzyError(f"{path}: key {key!r} is not a positive whole number of workers")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise FrenzyError(
                f"{path}: workers {key}: step time {value!r} is not a number of seconds >= 0 (0: cannot run on that many workers)"
            )
        seconds[int(key)] = float(value)
    return StepTimeTable(seconds)


def from_step_time_table(table: StepTimeTable, *, dp: int, pp: int, microbatches: int, reroute: Reroute | None = None) -> IterationTimes:
    if table.step_s(dp * pp) is None:
        raise FrenzyError(f"the step-time table says {dp * pp} workers cannot run (0), but the {dp} x {pp} grid needs them")
    return IterationTimes(dp, pp, microbatches, lambda d, p: table.step_s(d * p), reroute, by_workers=table.step_s)


DEFAULT_MODEL = "gpt2-xl"  # 1.5B parameters, 48 layers: splits evenly over 2, 4, 8 or 16 stages
DEFAULT_GPU = "A100-80GB"  # the usual part in the papers' clusters (ReCycle and Oobleck used A100s)


def from_preset(model: str, gpu: str, *, dp: int, pp: int, microbatches: int, reroute: Reroute | None = None) -> IterationTimes:
    """``from_throughput_model`` by names: a preset or HF config.json path, and a catalog GPU type."""
    from frenzy_prefect.profiling.model import resolve_model
    from frenzy_prefect.spec.catalog import GPU_CATALOG

    if gpu not in GPU_CATALOG:
        raise FrenzyError(f"unknown GPU type {gpu!r}; known: {', '.join(GPU_CATALOG)}")
    spec = resolve_model(model)
    if pp > spec.layers:
        raise FrenzyError(f"pp={pp} is more stages than {spec.name} has layers ({spec.layers})")
    return from_throughput_model(spec, GPU_CATALOG[gpu], dp=dp, pp=pp, microbatches=microbatches, reroute=reroute)
