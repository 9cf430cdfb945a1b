"""Event-driven replay: jobs arrive, the policy decides at each arrival and completion (or at
its round boundaries), and runs end when their predicted time is up. Ground truth for a run is
the project's models: MARP's peak memory (a plan that exceeds the GPU runs out of memory
OOM_DETECTION_S after it starts, and the job goes back to the queue) and the throughput model's
step time as actually placed (across nodes when the placement spans nodes). Jobs never move
once started (no preemption, for every policy)."""

from __future__ import annotations

import heapq
import math
import time
from bisect import insort

from pydantic import BaseModel

from frenzy_prefect.scheduling.cluster import Run, SimCluster
from frenzy_prefect.scheduling.jobs import SimJob, Waiting
from frenzy_prefect.scheduling.options import option
from frenzy_prefect.scheduling.policies.base import Policy, Reject, Start
from frenzy_prefect.spec.cluster import ClusterSpec

OOM_DETECTION_S = 120.0  # container start, model build and the first step, before the OOM
_COMPLETION, _ARRIVAL, _ROUND = 0, 1, 2  # at equal times: free GPUs first, then queue, then decide


class Latency(BaseModel):
    p50: float
    p99: float
    max: float


class Unschedulable(BaseModel):
    job_id: str
    reason: str


class SimulationResult(BaseModel):
    """The summary `frenzy simulate --json` prints (a contract: docs/architecture.md), plus what explains it."""

    policy: str
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
    decision_latency_ms: Latency
    decisions: int
    unschedulable: list[Unschedulable]
    wall_s: float


def _percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1)]


def simulate(jobs: list[SimJob], cluster_spec: ClusterSpec, policy: Policy) -> SimulationResult:
    wall = time.perf_counter()
    cluster = SimCluster(cluster_spec)
    events: list[tuple[float, int, int, object]] = []
    seq = 0

    def push(at: float, kind: int, payload: object) -> None:
        nonlocal seq
        heapq.heappush(events, (at, kind, seq, payload))
        seq += 1

    order = {job.job_id: i for i, job in enumerate(jobs)}
    for job in jobs:
        push(job.arrival_s, _ARRIVAL, job)
    queue: list[Waiting] = []
    queue_key = lambda w: order[w.job.job_id]  # noqa: E731 - a retried job keeps its place
    jcts: list[float] = []
    unschedulable: list[Unschedulable] = []
    latencies: list[float] = []
    busy_gpu_s = 0.0
    restarts = 0
    last_end = 0.0
    round_pending = False

    while events:
        now = events[0][0]
        decide = False
        while events and events[0][0] == now:
            _, kind, _, payload = heapq.heappop(events)
            if kind == _COMPLETION:
                run: Run = payload  # type: ignore[assignment]
                cluster.release(run.gpu_type, run.placements)
                del cluster.running[run.job.job_id]
                last_end = now
                if run.out_of_memory:
                    restarts += 1
                    waiting = run.waiting
                    insort(queue, Waiting(run.job, waiting.out_of_memory + 1), key=queue_key)
                else:
                    jcts.append(now - run.job.arrival_s)
            elif kind == _ARRIVAL:
                job: SimJob = payload  # type: ignore[assignment]
                policy.prepare(job, cluster)
                insort(queue, Waiting(job), key=queue_key)
            else:
                round_pending = False
                decide = True
            if kind != _ROUND and policy.round_s is None:
                decide = True
            elif kind != _ROUND and not round_pending:
                push(math.ceil(now / policy.round_s) * policy.round_s, _ROUND, None)
                round_pending = True
        if not (decide and queue):
            continue
        started = time.perf_counter()
        decisions = policy.schedule(now, queue, cluster)
        latencies.append((time.perf_counter() - started) * 1e3)
        done = set()
        for d in decisions:
            done.add(d.waiting.job.job_id)
            if isinstance(d, Reject):
                unschedulable.append(Unschedulable(job_id=d.waiting.job.job_id, reason=d.reason))
                continue
            run = start_run(d, cluster, now)
            cluster.running[run.job.job_id] = run
            busy_gpu_s += d.plan.gpus * (run.end_s - now)
            push(run.end_s, _COMPLETION, run)
        if done:
            queue = [w for w in queue if w.job.job_id not in done]

    for waiting in queue:  # nothing runs and nothing will arrive: the policy never placed these
        unschedulable.append(Unschedulable(job_id=waiting.job.job_id, reason=f"{policy.name} placed it nowhere, even on an idle cluster"))
    jcts.sort()
    latencies.sort()
    first = min((j.arrival_s for j in jobs), default=0.0)
    makespan = max(0.0, last_end - first)
    return SimulationResult(
        policy=policy.name,
        cluster_gpus=cluster.gpus,
        jobs_total=len(jobs),
        jobs_completed=len(jcts),
        jobs_unschedulable=len(unschedulable),
        out_of_memory_restarts=restarts,
        avg_jct_s=sum(jcts) / len(jcts) if jcts else None,
        p50_jct_s=_percentile(jcts, 0.5),
        p99_jct_s=_percentile(jcts, 0.99),
        makespan_s=makespan,
        gpu_utilization=busy_gpu_s / (cluster.gpus * makespan) if makespan else 0.0,
        decision_latency_ms=Latency(p50=_percentile(latencies, 0.5) or 0.0, p99=_percentile(latencies, 0.99) or 0.0, max=latencies[-1] if latencies else 0.0),
        decisions=len(latencies),
        unschedulable=unschedulable,
        wall_s=time.perf_counter() - wall,
    )


def start_run(start: Start, cluster: SimCluster, now: float) -> Run:
    """What actually happens to a started plan, by the project's memory and throughput models."""
    job = start.waiting.job
    gpu = cluster.gpu[start.gpu_type]
    predicted = option(job.model, job.global_batch, gpu, start.plan, cluster.spec.network_gbps)
    out_of_memory = predicted.peak_bytes > gpu.memory_bytes
    runtime = OOM_DETECTION_S if out_of_memory else job.steps * predicted.step_time(len(start.placements))
    return Run(start.waiting, start.gpu_type, start.plan, start.placements, now + runtime, out_of_memory)
