"""A training job's side inside Slurm: ``python -m frenzy_prefect.launch.slurm_job batch`` is the
batch script's one command, ``... node`` the one task of its step on each node.

The batch step runs on the job's first node (component 0 of a heterogeneous job, which holds the
first placement): that node becomes node rank 0 and the static rendezvous, at its NodeAddr, on a
port picked free there. It then starts one ``srun`` step, one task per node, each writing its own
log file, killed whole if one task fails (``--kill-on-bad-exit``). Each task starts its node's
torchrun agent on the GPUs Slurm gave the step: Slurm sets CUDA_VISIBLE_DEVICES (and confines
the step to those devices); this module only reports them (SLURM_STEP_GPUS: physical indices).
Once its agent has exited, each task marks its node ended (``ended_marker``): the watcher frees
the run's GPUs only once every node's ranks are gone.
Standard library only, plus the launch modules the nodes already import.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from frenzy_prefect.launch.failure import FAILURE_FILE_ENV
from frenzy_prefect.launch.remote import free_port
from frenzy_prefect.launch.torchrun import MASTER_PORT_ENV, agent_argv

SPEC_ENV = "FRENZY_SLURM_JOB"  # {"nodes": [{"name", "addr", "gpus"}], "het": bool, "log_dir", "python", "max_restarts"}
RANKS_ENV = "FRENZY_SLURM_RANKS"  # node name -> node rank, set by the batch step
MASTER_ENV = "FRENZY_SLURM_MASTER"
STEP_LOG = "step-%t.log"  # srun's own output of each task, before the task writes its node's log


def failure_file(log_dir: str, node: str) -> str:
    return os.path.join(log_dir, f"failure-{node}.json")


def node_order(nodes: list[dict], here: str, het: bool) -> list[dict]:
    """The nodes in node-rank order, rank 0 the batch host. A heterogeneous job's batch host is
    component 0's node, the first placement already; a homogeneous job's is Slurm's choice,
    moved first (its nodes hold the same count of the same GPU type, so any order is the plan's)."""
    if het:
        return nodes
    return [n for n in nodes if n["name"] == here] + [n for n in nodes if n["name"] != here]


def batch(spec: dict) -> None:
    order = node_order(spec["nodes"], os.environ["SLURMD_NODENAME"], spec["het"])
    env = {
        **os.environ,
        MASTER_PORT_ENV: str(free_port()),
        MASTER_ENV: order[0]["addr"],
        RANKS_ENV: json.dumps({n["name"]: i for i, n in enumerate(order)}),
    }
    log = os.path.join(spec["log_dir"], STEP_LOG)
    shape = [f"--het-group=0-{len(order) - 1}"] if spec["het"] else [f"--nodes={len(order)}", "--ntasks-per-node=1"]
    argv = ["srun", "--kill-on-bad-exit=1", "--unbuffered", f"--output={log}", f"--error={log}", *shape]
    print(f"frenzy-slurm: rendezvous at {order[0]['name']} ({env[MASTER_ENV]}:{env[MASTER_PORT_ENV]})", flush=True)
    os.execvpe(argv[0], [*argv, spec["python"], "-m", "frenzy_prefect.launch.slurm_job", "node"], env)


def node_log(log_dir: str, node: str) -> str:
    """The node's log file: its agent's and ranks' output (srun's %N is the host's name, which
    several slurmd on one host share)."""
    return os.path.join(log_dir, f"{node}.log")


def node(spec: dict) -> None:
    here = os.environ["SLURMD_NODENAME"]
    log = os.open(node_log(spec["log_dir"], here), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    ranks = json.loads(os.environ[RANKS_ENV])
    nproc = next(n["gpus"] for n in spec["nodes"] if n["name"] == here)
    gpus = os.environ.get("SLURM_STEP_GPUS") or os.environ.get("SLURM_JOB_GPUS") or "none"
    print(
        f"frenzy-slurm: {here} is node rank {ranks[here]} with {nproc} rank(s) on Slurm's GPUs {gpus}"
        f" (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')})",
        file=sys.stderr,
        flush=True,
    )
    env = {**os.environ, FAILURE_FILE_ENV: failure_file(spec["log_dir"], here)}
    argv = agent_argv(
        spec["python"],
        nnodes=len(ranks),
        node_rank=ranks[here],
        nproc=nproc,
        master=os.environ[MASTER_ENV],
        max_restarts=spec["max_restarts"],
    )
    sys.exit(_agent_then_mark_ended(argv, env, ended_marker(spec["log_dir"], here)))


def ended_marker(log_dir: str, node: str) -> str:
    """The file a node's task writes once its torchrun agent, and so every rank there, has
    exited: Slurm shows a cancelled job COMPLETING, not yet CANCELLED, while its ranks still
    stop (rank 0 reporting the run's end), and for seconds after they have."""
    return os.path.join(log_dir, f"ended-{node}")


def _agent_then_mark_ended(argv: list[str], env: dict[str, str], marker: str) -> int:
    """Run the agent as a child, wait for it, write ``marker``; its exit status as the task's.
    Slurm signals every process of the step (scancel, --kill-on-bad-exit): the agent passes a
    SIGTERM on to its ranks and waits for them, and this process waits for the agent (a no-op
    handler: ignoring the signal would pass SIG_IGN on to the agent)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)
    agent = subprocess.Popen(argv, env=env)
    code = agent.wait()
    with open(marker, "w") as f:
        f.write(f"{code}\n")
    return 128 - code if code < 0 else code  # killed by a signal: 128 + its number, as a shell says


def main() -> None:
    spec = json.loads(os.environ[SPEC_ENV])
    {"batch": batch, "node": node}[sys.argv[1]](spec)


if __name__ == "__main__":
    main()
