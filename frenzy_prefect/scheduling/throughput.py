"""A measured throughput table in place of MARP and the step-time model: how long one step of a
(model, global batch) takes on N GPUs of a type, as another simulator or a profile says, so that
two simulators replay the same jobs at the same speeds (`frenzy simulate --throughput-table`).

CSV columns: ``model,global_batch,gpu_type,gpus,step_s`` and, optionally, ``spread_step_s`` (the
step when the GPUs span nodes although they would fit in one; default ``step_s``), ``startup_s``
(what each start of the job costs before its first step; default 0) and ``job_steps`` (the steps
a job of that model and batch runs, for workloads that do not state them). Both optional per-job
columns must agree on every row of one (model, batch).

Memory is the table's: a row exists only where the job fits (no row, no plan), so no run
started from it runs out of memory. Plans are plain data parallelism over the row's GPUs."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.scheduling.inputs import read_rows
from frenzy_prefect.scheduling.options import Option
from frenzy_prefect.spec.plan import ParallelPlan

_SHAPE_COLUMNS = ("startup_s", "job_steps")


@dataclass(frozen=True, slots=True)
class Shape:
    """What the table says of every job of one (model, global batch)."""

    startup_s: float
    job_steps: int | None


class ThroughputTable:
    def __init__(self, options: dict[tuple[str, int, str], dict[int, Option]], shapes: dict[tuple[str, int], Shape], source: str):
        self._options = options  # (model, global batch, GPU type) -> GPUs -> option
        self._shapes = shapes
        self.source = source

    @classmethod
    def load(cls, path: str | Path) -> ThroughputTable:
        path = Path(path)
        options: dict[tuple[str, int, str], dict[int, Option]] = defaultdict(dict)
        shapes: dict[tuple[str, int], tuple[int, Shape]] = {}
        integers, numbers = ("global_batch", "gpus"), ("step_s", "spread_step_s", "startup_s", "job_steps")
        for line, row in read_rows(path, integers, ("model", "gpu_type"), numbers, optional=("spread_step_s", *_SHAPE_COLUMNS)):
            model, batch, gpu_type, gpus = row["model"], row["global_batch"], row["gpu_type"], row["gpus"]
            if not model or not gpu_type or not gpus or not batch or not row["step_s"]:
                raise FrenzyError(f"{path}:{line}: model, gpu_type, gpus, global_batch and step_s must be set and non-zero")
            if gpus in options[model, batch, gpu_type]:
                raise FrenzyError(f"{path}:{line}: {model} at batch {batch} on {gpus} x {gpu_type} is listed twice")
            steps = row["job_steps"]
            if steps is not None and not float(steps).is_integer():
                raise FrenzyError(f"{path}:{line}: column job_steps: {steps} is not a whole number")
            shape = Shape(row["startup_s"] or 0.0, None if steps is None else int(steps))
            first_line, first = shapes.setdefault((model, batch), (line, shape))
            if shape != first:
                raise FrenzyError(f"{path}:{line}: startup_s and job_steps of {model} at batch {batch} differ from line {first_line}'s")
            step = row["step_s"]
            spread = row["spread_step_s"] or step
            options[model, batch, gpu_type][gpus] = Option(gpu_type, ParallelPlan(dp=gpus), 0, step, spread, gpus)
        if not options:
            raise FrenzyError(f"{path} holds no rows")
        return cls(dict(options), {k: s for k, (_, s) in shapes.items()}, path.name)

    def covers(self, model: str, global_batch: int) -> bool:
        return (model, global_batch) in self._shapes

    def shape(self, model: str, global_batch: int) -> Shape:
        try:
            return self._shapes[model, global_batch]
        except KeyError:
            known = ", ".join(f"{m}@{b}" for m, b in sorted(self._shapes))
            raise FrenzyError(f"throughput table {self.source} has no rows for {model} at batch {global_batch}; it has {known}") from None

    def option(self, model: str, global_batch: int, gpu_type: str, gpus: int) -> Option | None:
        """The row for ``gpus`` x ``gpu_type``; None where the table has none (the job does not run there)."""
        return self._options.get((model, global_batch, gpu_type), {}).get(gpus)

    def frontier(self, model: str, global_batch: int, gpu_type: str, max_gpus: int, node_gpus: int) -> tuple[Option, ...]:
        """The rows worth running on ``gpu_type`` within ``max_gpus``, by GPU count, each strictly
        faster (as HAS would place it: one node when it fits in one) than every smaller one:
        the rule MARP's frontier follows (options.frontier)."""
        rows = self._options.get((model, global_batch, gpu_type), {})
        out: list[Option] = []
        last = math.inf
        for gpus in sorted(g for g in rows if g <= max_gpus):
            o = rows[gpus]
            t = o.step_time(1 if gpus <= node_gpus else 2)
            if t < last:
                out.append(o)
                last = t
        return tuple(out)
