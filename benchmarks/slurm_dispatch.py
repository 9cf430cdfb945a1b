"""Dispatch through Slurm beside the local launcher, in one run: the embedded stack (a real
Prefect server on SQLite, moto's S3), a real Slurm cluster on this host (tests/support/slurm_cluster.py:
slurmctld and four slurmd), its nodes discovered into one cluster block, and two `frenzy` pools
on it, one per launcher, each with its worker. Each run is a one-GPU gpt-nano job of 3 steps,
submitted one at a time (each after the last finished), alternating between the pools.

- dispatch: the run's scheduled time -> its ranks' launch (local: the worker's "Started N
  process(es)" line; slurm: "Slurm placed job", i.e. sbatch, Slurm's scheduling and the job's start);
- first step: the run's scheduled time -> its "step 1/" log line (ranks' start-up, torch import,
  rendezvous, data and model set-up included).

    python -m benchmarks.slurm_dispatch [--runs 4] [--json PATH]      (as root, Slurm installed)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import p99, write_result

BUCKET = "frenzy-bench"
DATASET = f"s3://{BUCKET}/data/text.txt"
MARK = {"local": "Started ", "slurm": "Slurm placed job "}


def summary(values: list[float]) -> dict:
    values = sorted(values)
    return {"p50": statistics.median(values), "p99": p99(values), "samples": values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4, help="runs per launcher")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/slurm_dispatch.json"))
    args = parser.parse_args()

    from tests.slurm_cluster import missing, slurm_cluster

    from frenzy_prefect.localstack import LocalStack
    from tests.conftest import create_pool  # noqa: F401  (imported now: it clears AWS_ENDPOINT_URL, which the stack then sets)

    if why := missing():
        raise SystemExit(f"error: {why}")
    with slurm_cluster() as slurm, tempfile.TemporaryDirectory() as home, LocalStack(Path(home), worker_query_seconds=1) as stack:
        stack.env["SLURM_CONF"] = str(slurm.conf)
        stack.start_s3()
        stack.start_prefect()
        from frenzy_prefect.storage import filesystem

        fs, _ = filesystem(DATASET)
        fs.mkdir(BUCKET)
        fs.pipe_file(DATASET.removeprefix("s3://"), b"the quick brown fox jumps over the lazy dog. " * 4000)
        with stack.client_settings():
            result = measure(stack, slurm, Path(home), args.runs)

    print(f"{'launcher':8} {'dispatch p50':>12} {'p99':>7} {'first step p50':>15} {'p99':>7} {'completed':>10}")
    for launcher, r in result["launchers"].items():
        d, f = r["dispatch_s"], r["first_step_s"]
        done = f"{r['completed']}/{r['runs']}"
        print(f"{launcher:8} {d['p50']:10.2f} s {d['p99']:5.2f} s {f['p50']:13.2f} s {f['p99']:5.2f} s {done:>10}")
    write_result(result, args.json)


def measure(stack, slurm, home: Path, runs: int) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.deployments import run_deployment

    from frenzy_prefect import allocator
    from frenzy_prefect.blocks import FrenzyCluster
    from frenzy_prefect.flows.deployments import deploy_flows
    from frenzy_prefect.profiling.dataset import profile_dataset
    from frenzy_prefect.profiling.model import resolve_model
    from frenzy_prefect.spec.cluster import ClusterState
    from frenzy_prefect.spec.plan import TrainingJob
    from frenzy_prefect.spec.request import TrainingRequest
    from tests.conftest import create_pool

    stack.run_cli("frenzy_prefect.cli", "cluster", "discover", "--slurm", "--save", "bench")
    cluster = FrenzyCluster.load("bench").cluster
    for launcher in MARK:
        extra = {"slurm_conf": str(slurm.conf), "working_dir": str(home)} if launcher == "slurm" else {}
        create_pool(stack, launcher, "bench", launcher=launcher, **extra)
        stack.start_worker(launcher, name=f"{launcher}-worker")
        deploy_flows(launcher, launcher)
    request = TrainingRequest(model="gpt-nano", dataset=DATASET, global_batch=4, seq_len=64, steps=3, precision="fp32", log_every=1)
    model = resolve_model(request.model, seq_len=request.seq_len)
    one_gpu = [c for c in allocator.candidate_plans(model, request, cluster) if c.fits and c.plan.gpus == 1]
    allocation = allocator.allocate(one_gpu, ClusterState.idle(cluster))
    dataset = profile_dataset(DATASET, request.seq_len, model.vocab_size)

    def run_one(launcher: str, k: int):
        job = TrainingJob(
            request=request, model=model, dataset=dataset, allocation=allocation, cluster=cluster, output=f"s3://{BUCKET}/{launcher}/{k}"
        )
        run_id = run_deployment(f"distributed-train/{launcher}", parameters={"job": job.model_dump(mode="json")}, timeout=0).id
        with get_client(sync_client=True) as client:
            deadline = time.monotonic() + 600
            while not ((run := client.read_flow_run(run_id)).state and run.state.is_final()):
                assert time.monotonic() < deadline, f"run {run_id} did not finish"
                time.sleep(1)
            time.sleep(3)  # logs reach the server in batches
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), limit=200)
        start = run.expected_start_time
        if not run.state.is_completed():
            raise SystemExit(
                f"error: a {launcher} run ended {run.state.type.value}: {run.state.message}; its log: {[x.message for x in logs][-8:]}"
            )

        def at(prefix: str) -> float:
            if not any(x.message.startswith(prefix) for x in logs):
                raise SystemExit(f"error: no {prefix!r} line in a {launcher} run's log: {[x.message[:80] for x in logs]}")
            return (min(x.timestamp for x in logs if x.message.startswith(prefix)) - start).total_seconds()

        return run.state.is_completed(), at(MARK[launcher]), at("step 1/")

    for launcher in MARK:
        run_one(launcher, -1)  # warm: each worker has dispatched once
    samples: dict[str, list] = {launcher: [] for launcher in MARK}
    for k in range(runs):
        for launcher in MARK:
            samples[launcher].append(run_one(launcher, k))
    return {
        "how": "one-GPU gpt-nano runs of 3 steps, one at a time, alternating local and slurm pools on one 2-core machine; "
        "times from the flow run's scheduled time",
        "launchers": {
            launcher: {
                "runs": len(s),
                "completed": sum(ok for ok, _, _ in s),
                "dispatch_s": summary([d for _, d, _ in s]),
                "first_step_s": summary([f for _, _, f in s]),
            }
            for launcher, s in samples.items()
        },
    }


if __name__ == "__main__":
    main()
