"""Which jobs a trace file holds: an ElasticFlow trace's become LLM training jobs on MARP and the
step-time model (jobs.py); a Sia workload's keep their own model (``application``) and batch and
run at a throughput table's speeds (throughput.py): a job's steps are the table's ``job_steps``
for its model and batch; what it asked for is its ``num_replicas`` GPUs for as long as they take
on the fastest type the table lists at that count; it has no deadline."""

from __future__ import annotations

import math
from pathlib import Path

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.scheduling.inputs import SiaJob, is_sia_workload, load_sia_workload, load_trace
from frenzy_prefect.scheduling.jobs import SimJob, sim_jobs
from frenzy_prefect.scheduling.throughput import ThroughputTable


def sia_sim_jobs(workload: list[SiaJob], table: ThroughputTable, gpu_types: list[str]) -> list[SimJob]:
    """Sia's jobs as the simulator's, at ``table``'s speeds on ``gpu_types`` (the cluster's)."""
    t0 = min(j.time for j in workload)
    out = []
    for job in workload:
        shape = table.shape(job.application, job.batch_size)
        if shape.job_steps is None:
            raise FrenzyError(f"job {job.name}: the throughput table {table.source} gives no job_steps for {job.application}")
        rows = [table.option(job.application, job.batch_size, t, job.num_replicas) for t in gpu_types]
        best = min((o.step_s for o in rows if o is not None), default=0.0)
        out.append(
            SimJob(
                job_id=job.name,
                arrival_s=float(job.time - t0),
                model=job.application,
                global_batch=job.batch_size,
                steps=shape.job_steps,
                requested_gpus=job.num_replicas,
                requested_s=shape.job_steps * best,
                deadline_s=math.inf,
            )
        )
    return out


def load_jobs(path: str | Path, gpu_types: list[str], table: ThroughputTable | None = None) -> list[SimJob]:
    """The jobs of a trace file: an ElasticFlow trace (on MARP and the step-time model), or a Sia
    workload (on ``table``, which it needs; ``gpu_types``: the cluster's)."""
    if not is_sia_workload(path):
        if table is not None:
            raise FrenzyError(f"{path} is an ElasticFlow trace; a throughput table applies to Sia workloads (name,time,application,...)")
        return sim_jobs(load_trace(path))
    if table is None:
        raise FrenzyError(f"{path} is a Sia workload: its jobs need a throughput table (e.g. benchmarks/data/sia/throughput.csv)")
    return sia_sim_jobs(load_sia_workload(path), table, gpu_types)
