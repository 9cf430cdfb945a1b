"""One torchrun agent per allocated node: static rendezvous at the first node, ranks numbered
node by node, each node seeing only its allocated GPUs.

The rendezvous port is not chosen here: torchrun reads it from ``PET_MASTER_PORT`` (its
environment default for ``--master-port``), which the launcher sets to a port free on the first
node, the host where the rendezvous listens (see Launch.port_env)."""

from __future__ import annotations

from frenzy_prefect.launch.command import Launch
from frenzy_prefect.spec.plan import JOB_ENV, TrainingJob

MASTER_PORT_ENV = "PET_MASTER_PORT"


def agent_argv(python: str, *, nnodes: int, node_rank: int, nproc: int, master: str, max_restarts: int) -> list[str]:
    """One node's torchrun agent, training the job in its environment (JOB_ENV)."""
    return [
        python,
        "-m",
        "frenzy_prefect.launch.agent",  # torchrun, telling the launcher which rank failed
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={nproc}",
        f"--master-addr={master}",
        f"--max-restarts={max_restarts}",  # each restart resumes from the last checkpoint
        "-m",
        "frenzy_prefect.training.entry",
    ]


def rank_launches(job: TrainingJob, *, python: str, env: dict[str, str]) -> list[Launch]:
    placements = job.allocation.placements
    master = placements[0].host
    launches = []
    for node_rank, placement in enumerate(placements):
        argv = agent_argv(
            python,
            nnodes=len(placements),
            node_rank=node_rank,
            nproc=len(placement.gpus),
            master=master,
            max_restarts=job.request.max_restarts,
        )
        node_env = {
            **env,
            JOB_ENV: job.model_dump_json(),
            "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in placement.gpus),
        }
        launches.append(
            Launch(
                host=placement.host, node=placement.node, argv=argv, env=node_env, processes=len(placement.gpus), port_env=MASTER_PORT_ENV
            )
        )
    return launches
