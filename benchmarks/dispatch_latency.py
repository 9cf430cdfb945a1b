"""Dispatch through the `frenzy` work pool on the embedded stack (a real Prefect server on
SQLite, moto's S3, one worker process, the example cluster of four local "GPUs"): training
runs of the `distributed-train/frenzy` deployment, each a one-GPU gpt-nano job of a few steps.

- Latency with a warm worker: runs submitted one at a time (each after the last finished);
  dispatch = the run's scheduled time -> the worker's "Started N process(es)" log line, i.e.
  worker poll, GPU reservation, placement and process start (not the ranks' own start-up).
- Throughput: QUEUED runs submitted at once onto 4 GPUs; dispatches per minute and the time
  until the last one finished.

    python -m benchmarks.dispatch_latency [--sequential 5] [--queued 100] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import p99, write_result

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "frenzy-bench"
DATASET = f"s3://{BUCKET}/data/text.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequential", type=int, default=5)
    parser.add_argument("--queued", type=int, default=100)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/dispatch_latency.json"))
    args = parser.parse_args()

    from frenzy_prefect.localstack import LocalStack

    with tempfile.TemporaryDirectory() as home, LocalStack(Path(home), worker_query_seconds=1) as stack:
        stack.start_s3()
        stack.start_prefect()
        from frenzy_prefect.storage import filesystem

        fs, _ = filesystem(DATASET)
        fs.mkdir(BUCKET)
        fs.pipe_file(DATASET.removeprefix("s3://"), b"the quick brown fox jumps over the lazy dog. " * 4000)
        with stack.client_settings():
            from prefect.client.orchestration import get_client
            from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
            from prefect.deployments import run_deployment

            from frenzy_prefect import allocator
            from frenzy_prefect.blocks import FrenzyCluster
            from frenzy_prefect.flows.deployments import deploy_flows
            from frenzy_prefect.profiling.dataset import profile_dataset
            from frenzy_prefect.profiling.model import resolve_model
            from frenzy_prefect.spec.cluster import ClusterSpec, ClusterState
            from frenzy_prefect.spec.plan import TrainingJob
            from frenzy_prefect.spec.request import TrainingRequest

            cluster = ClusterSpec.from_file(ROOT / "blocks" / "local-hetero.yaml")
            FrenzyCluster(cluster=cluster).save("local-hetero", overwrite=True)
            stack.start_worker("frenzy")
            deploy_flows("frenzy")
            request = TrainingRequest(model="gpt-nano", dataset=DATASET, global_batch=4, seq_len=64, steps=3, precision="fp32", log_every=1)
            model = resolve_model(request.model, seq_len=request.seq_len)
            candidates = allocator.candidate_plans(model, request, cluster)
            one_gpu = [c for c in candidates if c.fits and c.plan.gpus == 1]
            allocation = allocator.allocate(one_gpu, ClusterState.idle(cluster))
            dataset = profile_dataset(DATASET, request.seq_len, model.vocab_size)

            def submit(k: int):
                job = TrainingJob(
                    request=request, model=model, dataset=dataset, allocation=allocation, cluster=cluster, output=f"s3://{BUCKET}/runs/{k}"
                )
                return run_deployment("distributed-train/frenzy", parameters={"job": job.model_dump(mode="json")}, timeout=0)

            def finish(ids, timeout_s=900.0) -> list:
                deadline = time.monotonic() + timeout_s
                with get_client(sync_client=True) as client:
                    while True:
                        runs = [client.read_flow_run(i) for i in ids]
                        if all(r.state and r.state.is_final() for r in runs):
                            return runs
                        assert time.monotonic() < deadline, "runs did not finish"
                        time.sleep(1)

            def dispatch_s(runs) -> list[float]:
                with get_client(sync_client=True) as client:
                    time.sleep(3)  # logs reach the server in batches
                    out = []
                    for r in runs:
                        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[r.id])), limit=200)
                        started = min(log.timestamp for log in logs if log.message.startswith("Started "))
                        out.append((started - r.expected_start_time).total_seconds())
                return out

            finish([submit(-1).id])  # warm: the worker has dispatched once
            sequential = []
            for k in range(args.sequential):
                sequential += finish([submit(k).id])
            began = time.monotonic()
            queued = finish([submit(100 + k).id for k in range(args.queued)])
            wall = time.monotonic() - began
            lat, waits = sorted(dispatch_s(sequential)), sorted(dispatch_s(queued))

    ok = sum(r.state.is_completed() for r in sequential + queued)
    result = {
        "completed": ok,
        "runs": len(sequential) + len(queued),
        "warm_dispatch_s": {"p50": statistics.median(lat), "p99": p99(lat), "samples": lat},
        "queued": {
            "runs": len(queued),
            "gpus": 4,
            "wall_s": wall,
            "runs_per_min": 60 * len(queued) / wall,
            "dispatch_s_p50": statistics.median(waits),
            "dispatch_s_max": waits[-1],
        },
    }
    print(f"completed {ok}/{result['runs']}")
    print(
        f"warm dispatch (scheduled -> processes started): p50 {result['warm_dispatch_s']['p50']:.2f} s,"
        f" p99 {result['warm_dispatch_s']['p99']:.2f} s over {len(lat)} runs"
    )
    print(
        f"{len(queued)} queued runs on 4 GPUs: all done in {wall:.1f} s, {result['queued']['runs_per_min']:.1f} runs/min,"
        f" dispatch p50 {result['queued']['dispatch_s_p50']:.1f} s, max {waits[-1]:.1f} s"
    )
    write_result(result, args.json)


if __name__ == "__main__":
    main()
