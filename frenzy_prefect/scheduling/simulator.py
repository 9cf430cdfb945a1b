"""Event-driven replay: jobs arrive, the policy decides at each arrival and completion (or at
its round boundaries), and runs end when their predicted time is up. Ground truth for a run's
memory is not the estimate the policies plan with but ``truth.MemoryTruth``: MARP's estimate
off by an error drawn per job from MARP's measured errors on published GPU runs, the same draw
under every policy. A plan whose true peak exceeds the GPU runs out of memory OOM_DETECTION_S
after it starts and the job goes back to the queue, knowing its estimates were low by at least
GPU memory / estimated peak. The step time is the throughput model's as actually placed
(across nodes when the placement spans nodes). Jobs never move once started (no preemption,
for every policy). With a throughput table the table decides both: its rows are the plans that
fit (no run out of memory) and their step times, plus each start's start-up time."""

from __future__ import annotations

import gc
import heapq
import math
import time
from bisect import insort
from collections.abc import Iterator
from contextlib import contextmanager

from pydantic import BaseModel

from frenzy_prefect.scheduling.cluster import Run, SimCluster
from frenzy_prefect.scheduling.jobs import SimJob, Waiting
from frenzy_prefect.scheduling.policies.base import Policy, Reject, Start
from frenzy_prefect.scheduling.throughput import ThroughputTable
from frenzy_prefect.scheduling.truth import MemoryTruth
from frenzy_prefect.spec.cluster import ClusterSpec

OOM_DETECTION_S = 120.0  # container start, model build and the first step, before the OOM
_COMPLETION, _ARRIVAL, _ROUND = 0, 1, 2  # at equal times: free GPUs first, then queue, then decide


class Latency(BaseModel):
    p50: float
    p99: float
    max: float


class JobRecord(BaseModel):
    """One completed job: when it arrived, when its last run started and ended, on what."""

    job_id: str
    arrival_s: float
    started_s: float
    end_s: float
    jct_s: float
    gpu_type: str
    gpus: int
    out_of_memory_restarts: int


class Unschedulable(BaseModel):
    job_id: str
    reason: str


class SimulationResult(BaseModel):
    """The summary `frenzy simulate --json` prints (a contract: docs/architecture.md), plus what explains it."""

    policy: str
    memory_truth: str  # how a run's true peak memory was decided (MemoryTruth.describe)
    cluster_gpus: int
    jobs_total: int
    jobs_completed: int
    jobs_unschedulable: int
    out_of_memory_restarts: int
    avg_jct_s: float | None
    p50_jct_s: float | None
    p99_jct_s: float | None
    makespan_s: float
    gpu_utilization: float
    gpu_hours: float  # what the runs held, out-of-memory ones included
    requested_gpu_hours: float  # what the trace's jobs asked for (duration x GPUs, on its reference type)
    deadline_misses: int  # completed jobs that ended after the trace's deadline (unschedulable ones apart)
    worst_stretch: float | None  # the largest JCT / requested duration of a completed job
    worst_run_stretch: float | None  # the largest run / the longer of its request and its fastest plan here (frenzy bounds it)
    decision_latency_ms: Latency
    decisions: int
    unschedulable: list[Unschedulable]
    wall_s: float
    jobs: list[JobRecord] | None = None  # every completed job, when asked for (`simulate --per-job`)


def _percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1)]


class _Replay:
    """One replay's state: the event heap, the queue and what the result counts. ``simulate``
    drains each instant's events, then lets the policy decide."""

    def __init__(
        self, jobs: list[SimJob], spec: ClusterSpec, policy: Policy, truth: MemoryTruth, table: ThroughputTable | None, records: bool
    ):
        self.jobs, self.policy, self.truth = jobs, policy, truth
        self.cluster = SimCluster(spec, table)
        self.records: list[JobRecord] | None = [] if records else None
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.order = {job.job_id: i for i, job in enumerate(jobs)}
        for job in jobs:
            self.push(job.arrival_s, _ARRIVAL, job)
        self.queue: list[Waiting] = []
        self.jcts: list[float] = []
        self.stretches: list[float] = []
        self.run_stretches: list[float] = []
        self.deadline_misses = 0
        self.unschedulable: list[Unschedulable] = []
        self.latencies: list[float] = []
        self.busy_gpu_s = 0.0
        self.restarts = 0
        self.last_end = 0.0
        self.round_pending = False

    def push(self, at: float, kind: int, payload: object) -> None:
        heapq.heappush(self.events, (at, kind, self.seq, payload))
        self.seq += 1

    def queue_key(self, w: Waiting) -> int:
        return self.order[w.job.job_id]  # a retried job keeps its place

    def complete(self, run: Run, now: float) -> None:
        """Free the run's GPUs; an out-of-memory run goes back to the queue, any other is done."""
        self.cluster.release(run.placements)
        del self.cluster.running[run.job.job_id]
        self.last_end = now
        if run.out_of_memory:
            self.restarts += 1
            learned = max(run.waiting.underestimate, run.underestimate)
            self.policy.prepare(run.job, self.cluster, learned)  # the resubmitted job is planned again, as at arrival
            insort(self.queue, Waiting(run.job, run.waiting.out_of_memory + 1, learned), key=self.queue_key)
        else:
            job = run.job
            self.jcts.append(now - job.arrival_s)
            if job.requested_s:  # a zero-length request has no stretch
                self.stretches.append((now - job.arrival_s) / job.requested_s)
            self.run_stretches.append((now - run.started_s) / max(job.requested_s, self.cluster.fastest_run_s(job)))
            self.deadline_misses += now > job.deadline_s
            if self.records is not None:
                self.records.append(
                    JobRecord(
                        job_id=job.job_id,
                        arrival_s=job.arrival_s,
                        started_s=run.started_s,
                        end_s=now,
                        jct_s=now - job.arrival_s,
                        gpu_type=run.gpu_type,
                        gpus=run.gpus,
                        out_of_memory_restarts=run.waiting.out_of_memory,
                    )
                )

    def drain(self, now: float) -> bool:
        """Handle every event at ``now``; True when the policy is to decide now (every event
        without rounds, a round boundary with them: the first other event schedules the next one)."""
        decide = False
        while self.events and self.events[0][0] == now:
            _, kind, _, payload = heapq.heappop(self.events)
            if kind == _COMPLETION:
                self.complete(payload, now)  # type: ignore[arg-type]
            elif kind == _ARRIVAL:
                self.policy.prepare(payload, self.cluster)  # type: ignore[arg-type]
                insort(self.queue, Waiting(payload), key=self.queue_key)  # type: ignore[arg-type]
            else:
                self.round_pending = False
                decide = True
            if kind != _ROUND and self.policy.round_s is None:
                decide = True
            elif kind != _ROUND and not self.round_pending:
                self.push(math.ceil(now / self.policy.round_s) * self.policy.round_s, _ROUND, None)
                self.round_pending = True
        return decide

    def decide(self, now: float) -> None:
        """One policy decision, timed; start or reject what it names."""
        started = time.perf_counter()
        decisions = self.policy.schedule(now, self.queue, self.cluster)
        self.latencies.append((time.perf_counter() - started) * 1e3)
        done = set()
        for d in decisions:
            done.add(d.waiting.job.job_id)
            if isinstance(d, Reject):
                self.unschedulable.append(Unschedulable(job_id=d.waiting.job.job_id, reason=d.reason))
                continue
            run = start_run(d, self.cluster, now, self.truth)
            self.cluster.running[run.job.job_id] = run
            self.busy_gpu_s += d.plan.gpus * (run.end_s - now)
            self.push(run.end_s, _COMPLETION, run)
        if done:
            self.queue = [w for w in self.queue if w.job.job_id not in done]

    def memory_truth(self) -> str:
        table = self.cluster.table
        return self.truth.describe() if table is None else f"the throughput table's rows ({table.source})"

    def result(self, wall: float) -> SimulationResult:
        unschedulable, jcts, latencies = self.unschedulable, self.jcts, self.latencies
        reason = f"{self.policy.name} placed it nowhere, even on an idle cluster"
        for waiting in self.queue:  # nothing runs and nothing will arrive: the policy never placed these
            unschedulable.append(Unschedulable(job_id=waiting.job.job_id, reason=reason))
        jcts.sort()
        latencies.sort()
        first = min((j.arrival_s for j in self.jobs), default=0.0)
        makespan = max(0.0, self.last_end - first)
        gpus = self.cluster.gpus
        return SimulationResult(
            policy=self.policy.name,
            memory_truth=self.memory_truth(),
            cluster_gpus=gpus,
            jobs_total=len(self.jobs),
            jobs_completed=len(jcts),
            jobs_unschedulable=len(unschedulable),
            out_of_memory_restarts=self.restarts,
            avg_jct_s=sum(jcts) / len(jcts) if jcts else None,
            p50_jct_s=_percentile(jcts, 0.5),
            p99_jct_s=_percentile(jcts, 0.99),
            makespan_s=makespan,
            gpu_utilization=self.busy_gpu_s / (gpus * makespan) if makespan else 0.0,
            gpu_hours=self.busy_gpu_s / 3600,
            requested_gpu_hours=sum(j.requested_gpus * j.requested_s for j in self.jobs) / 3600,
            deadline_misses=self.deadline_misses,
            worst_stretch=max(self.stretches, default=None),
            worst_run_stretch=max(self.run_stretches, default=None),
            decision_latency_ms=Latency(
                p50=_percentile(latencies, 0.5) or 0.0, p99=_percentile(latencies, 0.99) or 0.0, max=latencies[-1] if latencies else 0.0
            ),
            decisions=len(latencies),
            unschedulable=unschedulable,
            wall_s=time.perf_counter() - wall,
            jobs=self.records,
        )


def simulate(
    jobs: list[SimJob],
    cluster_spec: ClusterSpec,
    policy: Policy,
    truth: MemoryTruth | None = None,
    table: ThroughputTable | None = None,
    records: bool = False,
) -> SimulationResult:
    """Replay ``jobs`` under ``policy``; memory is decided by ``truth`` (default: MARP's published
    errors, seed 0), plans and speeds by MARP and the step-time model or by ``table``; with
    ``records``, the result lists every completed job."""
    wall = time.perf_counter()
    replay = _Replay(jobs, cluster_spec, policy, truth or MemoryTruth(), table, records)
    with _cycle_collection_paused():
        while replay.events:
            now = replay.events[0][0]
            if replay.drain(now) and replay.queue:
                replay.decide(now)
    return replay.result(wall)


@contextmanager
def _cycle_collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused: a replay allocates millions of small objects that
    live long (the placements of running jobs: hundreds per job on a 62k-GPU cluster) and makes no
    cycles, and each full collection walked them all (the 10x cluster04 replay: 97 s with it, 72
    s without; its p99 decision 84 ms against 21 ms). What a caller had is restored."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def start_run(start: Start, cluster: SimCluster, now: float, truth: MemoryTruth) -> Run:
    """What actually happens to a started plan: its true peak by ``truth``, its time by the throughput
    model (or table, which also charges the job's start-up)."""
    if start.plan.gpus_by_type():
        return _start_across_types(start, cluster, now, truth)
    job = start.waiting.job
    gpu = cluster.gpu[start.gpu_type]
    predicted = cluster.option(job, start.gpu_type, start.plan)
    if predicted is None:
        raise RuntimeError(f"policy started {job.job_id} as {start.plan.label()} on {start.gpu_type}, which the throughput table lacks")
    out_of_memory = cluster.table is None and truth.peak_bytes(job.job_id, predicted.peak_bytes) > gpu.memory_bytes
    runtime = OOM_DETECTION_S if out_of_memory else cluster.startup_s(job) + job.steps * predicted.step_time(len(start.placements))
    underestimate = gpu.memory_bytes / predicted.peak_bytes if out_of_memory else 1.0
    return Run(start.waiting, start.gpu_type, start.plan, start.placements, now + runtime, out_of_memory, underestimate, now)


def _start_across_types(start: Start, cluster: SimCluster, now: float, truth: MemoryTruth) -> Run:
    """A plan across types runs out of memory where any stage or replica's true peak exceeds its
    type's memory; what that proves of the estimates is the largest such GPU memory / estimated peak."""
    job, plan = start.waiting.job, start.plan
    predicted = cluster.mixed_option(job, plan)
    short = [
        cluster.gpu[t].memory_bytes / peak
        for peak, t in zip(predicted.peaks, plan.worker_types, strict=True)
        if truth.peak_bytes(job.job_id, peak) > cluster.gpu[t].memory_bytes
    ]
    runtime = OOM_DETECTION_S if short else job.steps * predicted.step_s
    return Run(start.waiting, start.gpu_type, plan, start.placements, now + runtime, bool(short), max(short, default=1.0), now)
