"""How a `frenzy` worker goes away, on the embedded stack (a real Prefect server on SQLite, one
`frenzy` pool): what an operator waits for when a worker stops or dies.

- SIGTERM to an idle `prefect worker start` (what a service manager sends): seconds until the
  process has exited, with its server answering and with its server frozen (SIGSTOP: accepts
  connections, never answers), ``--repeats`` times each: a worker that has run nothing yet, and
  one that has run a training run to its end (one step of gpt-nano on one local "GPU"), whose
  shutdown has more to close. Each exit is checked for Prefect's "Worker '...' stopped!" line.
- SIGKILL to a worker: seconds until Prefect shows it OFFLINE. On the worker's own host a dead
  worker's runs are reclaimed at the next heartbeat of any live worker there (its PID is gone);
  from another host a live worker can only tell by that OFFLINE status, so this is how long a
  lost worker's GPUs wait there before the next heartbeat reclaims them (pool/reclaim.py).

    python -m benchmarks.worker_exit [--repeats 5] [--only KEY_PART] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks import write_result

POOL = "frenzy-exit"
ROOT = Path(__file__).resolve().parents[1]
BUCKET = "frenzy-bench"
DATASET = f"s3://{BUCKET}/data/exit.txt"
STOPPED = re.compile(r"Worker '[^']+' stopped")


def sigterm_exit_s(stack, name: str, frozen: bool, job: dict | None = None) -> tuple[float, bool]:
    """Start a worker, SIGTERM it once idle (its server frozen or not); (seconds until it exited,
    whether it printed its "stopped" line). ``job``: a `distributed-train` job it runs to its
    end first."""
    worker = stack.start_worker(POOL, name=name)
    time.sleep(3)  # past its first poll and heartbeat
    if job is not None:
        run_to_its_end(stack, job)
    server = stack.processes["prefect-server"]
    log = stack.logs / f"{name}.log"
    said = len(log.read_text(errors="replace"))
    if frozen:
        os.killpg(server.pid, signal.SIGSTOP)
    try:
        asked = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=120)
        took = time.monotonic() - asked
    finally:
        if frozen:
            os.killpg(server.pid, signal.SIGCONT)
    return took, bool(STOPPED.search(log.read_text(errors="replace")[said:]))


def training_job() -> dict:
    """A one-step gpt-nano job on one A10 of the example cluster (the dataset uploaded first)."""
    from frenzy_prefect import allocator
    from frenzy_prefect.profiling.dataset import profile_dataset
    from frenzy_prefect.profiling.model import resolve_model
    from frenzy_prefect.spec.cluster import ClusterSpec, ClusterState
    from frenzy_prefect.spec.plan import TrainingJob
    from frenzy_prefect.spec.request import TrainingRequest
    from frenzy_prefect.storage import filesystem

    fs, _ = filesystem(DATASET)
    fs.mkdir(BUCKET)
    fs.pipe_file(DATASET.removeprefix("s3://"), b"the quick brown fox jumps over the lazy dog. " * 4000)
    cluster = ClusterSpec.from_file(ROOT / "blocks" / "local-hetero.yaml")
    request = TrainingRequest(model="gpt-nano", dataset=DATASET, global_batch=4, seq_len=64, steps=1, precision="fp32")
    model = resolve_model(request.model, seq_len=request.seq_len)
    fitting = [c for c in allocator.candidate_plans(model, request, cluster) if c.fits and c.plan.gpus == 1 and c.gpu_type == "A10"]
    job = TrainingJob(
        request=request,
        model=model,
        dataset=profile_dataset(DATASET, request.seq_len, model.vocab_size),
        allocation=allocator.allocate(fitting, ClusterState.idle(cluster)),
        cluster=cluster,
        output=f"s3://{BUCKET}/runs/exit",  # (each run its own: run_to_its_end)
    )
    return job.model_dump(mode="json")


def run_to_its_end(stack, job: dict, timeout_s: float = 600) -> None:
    """One `distributed-train` run of ``job``, until it completed and its GPU was released."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.deployments import run_deployment

    with stack.client_settings():
        job = job | {"output": f"{job['output']}/{uuid.uuid4().hex}"}  # not resumed from another's checkpoint
        run_id = run_deployment("distributed-train/frenzy", parameters={"job": job}, timeout=0).id  # (deploy_flows names it)
        deadline = time.monotonic() + timeout_s
        with get_client(sync_client=True) as client:
            while not (state := client.read_flow_run(run_id).state).is_final():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the training run {run_id} did not end in {timeout_s:.0f} s")
                time.sleep(1)
            if not state.is_completed():
                raise RuntimeError(f"the training run {run_id} ended {state.type.value}: {state.message}")
            logs = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id]))
            while not any(log.message.startswith("Releasing GPUs ") for log in client.read_logs(logs)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the training run {run_id} never released its GPU")
                time.sleep(1)
    time.sleep(3)  # its worker past the run's end: idle again


# (result key, server frozen, the worker has run a training run first)
CASES = (
    ("sigterm_idle_server_answering", False, False),
    ("sigterm_idle_server_frozen", True, False),
    ("sigterm_after_a_run_server_answering", False, True),
    ("sigterm_after_a_run_server_frozen", True, True),
)


def offline_after_kill_s(stack, name: str, timeout_s: float = 600) -> float:
    """Start a worker, SIGKILL it; seconds until the server shows it OFFLINE."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import WorkerStatus

    worker = stack.start_worker(POOL, name=name)
    time.sleep(3)
    killed = time.monotonic()
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()
    with stack.client_settings(), get_client(sync_client=True) as client:
        while time.monotonic() < killed + timeout_s:
            status = {w.name: w.status for w in client.read_workers_for_work_pool(POOL)}.get(name)
            if status == WorkerStatus.OFFLINE:
                return time.monotonic() - killed
            time.sleep(1)
    raise RuntimeError(f"{name} still not OFFLINE {timeout_s:.0f} s after SIGKILL")


def prefect_setting(name: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "prefect", "config", "view", "--show-defaults"], capture_output=True, text=True, check=True
    ).stdout
    return next((line.split("=", 1)[1].split(" ")[0].strip("'") for line in out.splitlines() if line.startswith(name + "=")), "?")


def summary(exits: list[tuple[float, bool]]) -> dict:
    times = [t for t, _ in exits]
    return {
        "runs": len(times),
        "median_s": statistics.median(times),
        "max_s": max(times),
        "all_s": times,
        "stopped_line": sum(said for _, said in exits),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/worker_exit.json"))
    parser.add_argument("--only", default="", help="only the cases whose key contains this, e.g. after_a_run")
    args = parser.parse_args()
    cases = [case for case in CASES if args.only in case[0]]

    from frenzy_prefect.localstack import LocalStack

    with tempfile.TemporaryDirectory() as home, LocalStack(Path(home)) as stack:
        stack.start_s3()
        stack.start_prefect()
        load_before = os.getloadavg()
        with stack.client_settings():
            from frenzy_prefect.blocks import FrenzyCluster
            from frenzy_prefect.flows.deployments import deploy_flows
            from frenzy_prefect.spec.cluster import ClusterSpec

            FrenzyCluster(cluster=ClusterSpec.from_file(ROOT / "blocks" / "local-hetero.yaml")).save("local-hetero", overwrite=True)
            stack.run_cli("prefect", "work-pool", "create", POOL, "--type", "frenzy")
            deploy_flows(POOL)
            job = training_job()
        exits = {}
        for key, frozen, used in cases:
            exits[key] = []
            for k in range(args.repeats):
                exits[key].append(sigterm_exit_s(stack, f"{key}-{k}".replace("_", "-"), frozen=frozen, job=job if used else None))
                print(f"{key} #{k + 1}: {exits[key][-1][0]:.2f} s, stopped line: {exits[key][-1][1]}", flush=True)
        offline = offline_after_kill_s(stack, "killed")
        settings = {
            name: prefect_setting(name)
            for name in (
                "PREFECT_WORKER_HEARTBEAT_SECONDS",
                "PREFECT_SERVER_SERVICES_FOREMAN_LOOP_SECONDS",
                "PREFECT_SERVER_SERVICES_FOREMAN_INACTIVITY_HEARTBEAT_MULTIPLE",
            )
        }
    result = {
        "setup": {"cores": os.cpu_count(), "load_average_before": load_before, "load_average_after": os.getloadavg()},
        **{key: summary(times) for key, times in exits.items()},
        "sigkill_until_offline_s": offline,
        "prefect_settings": settings,
    }
    print(f"{'what':<52}{'median':>10}{'max':>10}{'stopped line':>14}")
    for key, _, _ in cases:
        label, r = key.removeprefix("sigterm_").replace("_", " "), result[key]
        print(f"{'SIGTERM, ' + label:<52}{r['median_s']:>9.1f}s{r['max_s']:>9.1f}s{r['stopped_line']:>9} of {r['runs']}")
    print(f"{'SIGKILL until Prefect shows it OFFLINE':<44}{offline:>9.1f}s")
    print(f"Prefect's settings: {settings}")
    write_result(result, args.json)


if __name__ == "__main__":
    main()
