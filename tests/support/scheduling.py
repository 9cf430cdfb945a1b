"""Helpers shared by the tests of scheduling."""

from frenzy_prefect.scheduling.jobs import SimJob
from frenzy_prefect.spec.cluster import ClusterSpec


def cluster(*nodes: tuple[str, int]) -> ClusterSpec:
    return ClusterSpec(nodes=[{"name": f"n{i}", "host": f"n{i}", "gpu_type": t, "gpu_count": c} for i, (t, c) in enumerate(nodes)])


def job(
    name: str, model: str = "gpt2-small", arrival: float = 0.0, steps: int = 200, gpus: int = 1, batch: int = 64, requested_s: float = 3600
) -> SimJob:
    return SimJob(
        job_id=name,
        arrival_s=arrival,
        model=model,
        global_batch=batch,
        steps=steps,
        requested_gpus=gpus,
        requested_s=requested_s,
        deadline_s=arrival + requested_s,
    )
