"""A training pod's one command: ``python -m frenzy_prefect.launch.kubernetes_pod --nnodes=N
--node-rank-offset=K --nproc-per-node=G --master-addr=HOST --max-restarts=R``.

The node rank is K plus the pod's completion index (JOB_COMPLETION_INDEX, set by the Job
controller); the node's torchrun agent (launch.agent) then trains the job in the pod's
environment, its rendezvous port PET_MASTER_PORT from the manifest. The agent's account of its
first failed rank (rank, pid, exit code) goes to the container's termination message
(TERMINATION_LOG), where the kubelet puts it in the pod's status for the launcher to read: the
pod's own name and node say the rest. SIGTERM (the pod deleted) goes on to the agent, which
stops its ranks. Standard library only, plus the launch modules the image has anyway.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from frenzy_prefect.launch.failure import FAILURE_FILE_ENV
from frenzy_prefect.launch.torchrun import agent_argv

TERMINATION_LOG_ENV = "FRENZY_TERMINATION_LOG"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="frenzy_prefect.launch.kubernetes_pod")
    for name in ("--nnodes", "--node-rank-offset", "--nproc-per-node", "--max-restarts"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--master-addr", required=True)
    return p.parse_args(argv)


def node_rank(offset: int) -> int:
    index = os.environ.get("JOB_COMPLETION_INDEX")
    if index is None or not index.isdigit():
        raise SystemExit("JOB_COMPLETION_INDEX is not set: the pod must belong to an Indexed Job")
    return offset + int(index)


def main(argv: list[str]) -> int:
    args = parse(argv)
    rank = node_rank(args.node_rank_offset)
    failure = Path(tempfile.mkdtemp(prefix="frenzy-pod-")) / "failure.json"
    command = agent_argv(
        sys.executable,
        nnodes=args.nnodes,
        node_rank=rank,
        nproc=args.nproc_per_node,
        master=args.master_addr,
        max_restarts=args.max_restarts,
    )
    gpus = os.environ.get("NVIDIA_VISIBLE_DEVICES") or os.environ.get("CUDA_VISIBLE_DEVICES") or "none"
    print(f"frenzy-kubernetes: pod {os.environ.get('HOSTNAME', '?')} is node rank {rank} with {args.nproc_per_node} rank(s) on GPUs {gpus}")
    print(f"frenzy-kubernetes: rendezvous at {args.master_addr}:{os.environ.get('PET_MASTER_PORT', '?')}", flush=True)
    agent = subprocess.Popen(command, env={**os.environ, FAILURE_FILE_ENV: str(failure)})
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: agent.send_signal(s))
    code = agent.wait()
    if code != 0 and failure.exists():
        message = os.environ.get(TERMINATION_LOG_ENV, "/dev/termination-log")
        try:
            Path(message).write_text(failure.read_text())
        except OSError as exc:  # no termination log mounted: the pod's exit code still says it failed
            print(f"frenzy-kubernetes: could not write the termination message {message}: {exc}", file=sys.stderr)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
