"""The simulated cluster: which GPUs of which node are free, and what runs where. Taking a GPU
that is not free raises, so no policy can double-book one. What a job can run as comes from
MARP and the step-time model, or from a throughput table when one is given."""

from __future__ import annotations

import math
from dataclasses import dataclass

from frenzy_prefect.allocator.placement import place
from frenzy_prefect.allocator.plans import gpu_kinds
from frenzy_prefect.scheduling.jobs import SimJob, Waiting
from frenzy_prefect.scheduling.options import MixedOption, Option, frontier, mixed_option, naive_plans, option
from frenzy_prefect.scheduling.throughput import ThroughputTable
from frenzy_prefect.spec.cluster import ClusterSpec, Node
from frenzy_prefect.spec.gpu import GpuType
from frenzy_prefect.spec.plan import ParallelPlan, Placement


@dataclass(slots=True)
class Run:
    waiting: Waiting
    gpu_type: str
    plan: ParallelPlan
    placements: list[Placement]
    end_s: float
    out_of_memory: bool
    underestimate: float  # what an out-of-memory run proved: GPU memory / estimated peak (1.0 otherwise)
    started_s: float

    @property
    def job(self) -> SimJob:
        return self.waiting.job

    @property
    def gpus(self) -> int:
        return self.plan.gpus


class SimCluster:
    def __init__(self, spec: ClusterSpec, table: ThroughputTable | None = None) -> None:
        self.spec = spec
        self.table = table
        self.node: dict[str, Node] = {n.name: n for n in spec.nodes}
        self.nodes_of: dict[str, list[Node]] = {}
        for node in spec.nodes:
            self.nodes_of.setdefault(node.gpu_type, []).append(node)
        kinds = gpu_kinds(spec)
        self.gpu: dict[str, GpuType] = {t: gpu for t, (gpu, _, _) in kinds.items()}
        self.total: dict[str, int] = {t: total for t, (_, total, _) in kinds.items()}
        self.node_gpus: dict[str, int] = {t: largest for t, (_, _, largest) in kinds.items()}
        self.free: dict[str, list[int]] = {n.name: list(range(n.gpu_count)) for n in spec.nodes}
        # Per type, nodes bucketed by how many GPUs they have free, so that placement on a
        # cluster of thousands of GPUs looks only at the nodes HAS stage 2 could pick.
        self.by_free: dict[str, list[dict[str, Node]]] = {t: [{} for _ in range(self.node_gpus[t] + 1)] for t in self.nodes_of}
        for node in spec.nodes:
            self.by_free[node.gpu_type][node.gpu_count][node.name] = node
        self.free_total: dict[str, int] = dict(self.total)
        self.running: dict[str, Run] = {}

    @property
    def types(self) -> list[str]:
        """GPU types in the order the cluster first lists them."""
        return list(self.nodes_of)

    @property
    def gpus(self) -> int:
        return sum(self.total.values())

    def options(self, job: SimJob, gpu_type: str, underestimate: float = 1.0) -> tuple[Option, ...]:
        """The job's frontier on ``gpu_type``, fitting as HAS decides (the cluster's memory margin),
        its estimates scaled by what its out-of-memory runs proved."""
        if self.table is not None:
            return self.table.frontier(job.model, job.global_batch, gpu_type, self.total[gpu_type], self.node_gpus[gpu_type])
        gpu = self.gpu[gpu_type]
        margin = self.spec.memory_margin.bytes_for(gpu.memory_bytes)
        return frontier(
            job.model, job.global_batch, gpu, self.total[gpu_type], self.node_gpus[gpu_type], self.spec.network_gbps, margin, underestimate
        )

    def option(self, job: SimJob, gpu_type: str, plan: ParallelPlan) -> Option | None:
        """``plan`` of ``job`` on ``gpu_type`` with its estimated peak and step times; None where
        the throughput table has no row for it (the job cannot run so)."""
        if self.table is not None:
            return self.table.option(job.model, job.global_batch, gpu_type, plan.gpus)
        return option(job.model, job.global_batch, self.gpu[gpu_type], plan, self.spec.network_gbps)

    def mixed_option(self, job: SimJob, plan: ParallelPlan) -> MixedOption:
        """``plan`` of ``job`` across the types it names, with its estimated peaks and step time."""
        return mixed_option(job.model, job.global_batch, plan, tuple(self.gpu.values()), self.spec.network_gbps)

    def naive_plans(self, job: SimJob) -> tuple[ParallelPlan, ...]:
        """What a memory-unaware user runs, attempt after attempt (``options.naive_plans``); with a
        throughput table, the requested GPUs (at most the largest pool), which never run out of memory."""
        largest = max(self.total.values())
        if self.table is not None:
            return (ParallelPlan(dp=min(job.requested_gpus, largest)),)
        return naive_plans(job.global_batch, job.requested_gpus, largest)

    def startup_s(self, job: SimJob) -> float:
        """What each start of ``job`` costs before its first step (the throughput table's; else none)."""
        return 0.0 if self.table is None else self.table.shape(job.model, job.global_batch).startup_s

    def fastest_run_s(self, job: SimJob) -> float:
        """The job's shortest predicted run on this cluster, over every type's frontier, as estimated."""
        return min((job.steps * self.predicted_step_s(o) for t in self.types for o in self.options(job, t)), default=math.inf)

    def predicted_step_s(self, option: Option) -> float:
        """The step time HAS expects of a plan: inside one node whenever it fits in one."""
        return option.step_time(1 if option.gpus <= self.node_gpus[option.gpu_type] else 2)

    def place(self, gpu_type: str, gpus: int, group: int = 1) -> list[Placement] | None:
        """HAS stage 2 on the free GPUs of ``gpu_type``; the GPUs are taken if it succeeds."""
        if gpus > self.free_total[gpu_type]:
            return None
        placements = place(gpus, [(n, self.free[n.name]) for n in self._candidates(gpu_type, gpus, group)], group=group)
        if placements:
            self.take(placements)
        return placements

    def _candidates(self, gpu_type: str, gpus: int, group: int) -> list[Node]:
        """The nodes HAS stage 2 picks from all free ones (``allocator.placement.place``), found
        through the buckets so that a decision on tens of thousands of nodes looks at the few it
        takes: an exact fit (the first node of the smallest exact bucket), else the tightest
        (the lowest name among the nodes with the fewest usable GPUs), else a split over the
        nodes with the most usable GPUs, by name, as many as it needs (a C sort of a bucket's names is
        faster than heapq.nsmallest's loop over them for the hundreds a wide job takes)."""
        by_usable: dict[int, list[dict[str, Node]]] = {}  # usable GPUs (whole groups) -> buckets, fewest free first
        for k, bucket in enumerate(self.by_free[gpu_type]):
            if bucket and k // group:
                by_usable.setdefault(k // group * group, []).append(bucket)
        fits = [usable for usable in by_usable if usable >= gpus]
        if fits:
            fewest = min(fits)
            if fewest == gpus:
                return [next(iter(by_usable[fewest][0].values()))]
            return [min((n for bucket in by_usable[fewest] for n in bucket.values()), key=lambda n: n.name)]
        chosen: list[Node] = []
        needed = gpus
        for usable in sorted(by_usable, reverse=True):
            names = sorted(name for bucket in by_usable[usable] for name in bucket)[: -(-needed // usable)]
            chosen += [self.node[name] for name in names]
            needed -= usable * len(names)
            if needed <= 0:
                break
        return chosen

    def take(self, placements: list[Placement]) -> None:
        """Mark the placements' GPUs busy (each node's GPUs counted against its own type: a plan across types spans them)."""
        for p in placements:
            free = self.free[p.node]
            if p.gpus == free:  # the whole node's free GPUs, as most of a wide job's nodes
                left = []
            elif set(p.gpus) <= set(free):
                left = [i for i in free if i not in p.gpus]
            else:
                raise RuntimeError(f"GPUs {p.gpus} of node {p.node} are not all free ({free})")
            self._refile(p.node, left)
            self.free_total[self.node[p.node].gpu_type] -= len(p.gpus)

    def release(self, placements: list[Placement]) -> None:
        for p in placements:
            self._refile(p.node, sorted(self.free[p.node] + p.gpus))
            self.free_total[self.node[p.node].gpu_type] += len(p.gpus)

    def _refile(self, name: str, free: list[int]) -> None:
        buckets = self.by_free[self.node[name].gpu_type]
        del buckets[len(self.free[name])][name]
        buckets[len(free)][name] = self.node[name]
        self.free[name] = free

    def copy(self) -> SimCluster:
        """An independent copy of the free GPUs and runs (to time a decision on a snapshot)."""
        twin = object.__new__(SimCluster)
        twin.spec, twin.nodes_of, twin.gpu, twin.total, twin.node_gpus = self.spec, self.nodes_of, self.gpu, self.total, self.node_gpus
        twin.table = self.table
        twin.free = {k: list(v) for k, v in self.free.items()}
        twin.free_total = dict(self.free_total)
        twin.by_free = {t: [dict(b) for b in buckets] for t, buckets in self.by_free.items()}
        twin.node = self.node
        twin.running = dict(self.running)
        return twin
