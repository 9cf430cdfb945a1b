"""``fastest-type``: heterogeneity-aware but memory-unaware. Like ``first-fit`` (the user's GPU
count, plain data parallelism, doubling after running out of memory), but always on the
fastest GPU type (dense half-precision peak) with enough free GPUs."""

from __future__ import annotations

from typing import ClassVar

from frenzy_prefect.scheduling.cluster import SimCluster
from frenzy_prefect.scheduling.policies.first_fit import FirstFit


class FastestType(FirstFit):
    name: ClassVar[str] = "fastest-type"

    def type_order(self, cluster: SimCluster) -> list[str]:
        gpu = cluster.gpu
        return sorted(cluster.types, key=lambda t: -gpu[t].half_tflops * gpu[t].achievable_fraction)
