"""Boundary objects: what a user asks for, what the cluster is, and what the allocator decides."""

from frenzy_prefect.spec.cluster import ClusterSpec, ClusterState, Node
from frenzy_prefect.spec.dataset import DatasetInfo
from frenzy_prefect.spec.gpu import GpuType
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import (
    Allocation,
    MemoryBreakdown,
    MemoryEstimate,
    ParallelPlan,
    Placement,
    PlanCandidate,
    TrainingJob,
)
from frenzy_prefect.spec.request import OptimizerSettings, TrainingRequest
from frenzy_prefect.spec.result import TrainingReport, TrainingResult
from frenzy_prefect.spec.workload import Workload

__all__ = [
    "Allocation",
    "ClusterSpec",
    "ClusterState",
    "DatasetInfo",
    "GpuType",
    "MemoryBreakdown",
    "MemoryEstimate",
    "ModelSpec",
    "Node",
    "OptimizerSettings",
    "ParallelPlan",
    "PlanCandidate",
    "Placement",
    "TrainingJob",
    "TrainingReport",
    "TrainingRequest",
    "TrainingResult",
    "Workload",
]
