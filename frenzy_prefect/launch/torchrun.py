"""One torchrun agent per allocated node: static rendezvous at the first node, ranks numbered
node by node, each node seeing only its allocated GPUs."""

from __future__ import annotations

from frenzy_prefect.launch.command import Launch
from frenzy_prefect.spec.plan import TrainingJob
from frenzy_prefect.training.entry import JOB_ENV


def rank_launches(job: TrainingJob, *, python: str, master_port: int, env: dict[str, str]) -> list[Launch]:
    placements = job.allocation.placements
    master = placements[0].host
    launches = []
    for node_rank, placement in enumerate(placements):
        argv = [
            python, "-m", "torch.distributed.run",
            f"--nnodes={len(placements)}",
            f"--node-rank={node_rank}",
            f"--nproc-per-node={len(placement.gpus)}",
            f"--master-addr={master}",
            f"--master-port={master_port}",
            "--max-restarts=0",
            "-m", "frenzy_prefect.training.entry",
        ]  # fmt: skip
        node_env = {
            **env,
            JOB_ENV: job.model_dump_json(),
            "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in placement.gpus),
        }
        launches.append(Launch(host=placement.host, node=placement.node, argv=argv, env=node_env, processes=len(placement.gpus)))
    return launches
