"""``first-fit``: the user's requested GPU count, on the first GPU type (in the cluster's order)
with that many free GPUs, scanning the queue in arrival order with no reservation. No memory
model: the plan is plain data parallelism; a job that runs out of memory comes back asking for
twice the GPUs, as a user would, and when that is not possible with a smaller micro-batch,
then with recomputation (``naive_plans``). A request larger than any type's pool is cut to the
largest pool (a user asks for what exists). With a throughput table, a type without a row for
the plan is passed over."""

from __future__ import annotations

from typing import ClassVar

from frenzy_prefect.scheduling.cluster import SimCluster
from frenzy_prefect.scheduling.jobs import SimJob
from frenzy_prefect.scheduling.policies.base import Reject, Start, Waiting


class FirstFit:
    name: ClassVar[str] = "first-fit"
    round_s: ClassVar[float | None] = None

    def prepare(self, job: SimJob, cluster: SimCluster, underestimate: float = 1.0) -> None:
        """A user without a memory model computes nothing ahead."""

    def type_order(self, cluster: SimCluster) -> list[str]:
        return cluster.types

    def schedule(self, now: float, queue: list[Waiting], cluster: SimCluster) -> list[Start | Reject]:
        out: list[Start | Reject] = []
        order = self.type_order(cluster)
        for waiting in queue:
            most_free = max(cluster.free_total.values())
            if most_free == 0:
                break
            job = waiting.job
            ladder = cluster.naive_plans(job)
            if waiting.out_of_memory >= len(ladder):
                out.append(Reject(waiting, f"ran out of memory {waiting.out_of_memory} times, the last time under {ladder[-1].label()}"))
                continue
            plan = ladder[waiting.out_of_memory]
            if plan.gpus > most_free:
                continue
            for gpu_type in order:
                if cluster.table is not None and cluster.option(job, gpu_type, plan) is None:
                    continue  # the table has no row: this type cannot run it
                placements = cluster.place(gpu_type, plan.gpus)
                if placements:
                    out.append(Start(waiting, gpu_type, plan, placements))
                    break
        return out
