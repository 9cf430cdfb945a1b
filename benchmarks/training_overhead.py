"""What the product costs a training job, on the embedded stack (a real Prefect server, moto's S3,
one `frenzy` worker, the example cluster's local "GPUs"), in one run on one machine:

- tokens/s of the flow's training (the `distributed-train/frenzy` deployment: worker, torchrun,
  the engine, reads through s3fs, sharded checkpoints excluded) against a bare torchrun DDP script
  of the same model, data, batch and optimizer (``bare_ddp.py``), both over the steps after the
  first (the baseline runs before and after the flow's run, and their mean is compared, as a
  shared machine's load drifts);
- checkpoint cost: seconds per checkpoint, and its share of the training time at the run's
  ``checkpoint_every``;
- submit -> first step with a warm worker: the run's scheduled time -> its "step 1/" log line
  (dispatch, GPU reservation, process start, torch import, process group, model, data).

    python -m benchmarks.training_overhead [--model gpt-micro] [--steps 60] [--checkpoint-every N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import write_result

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "frenzy-bench"
DATASET = f"s3://{BUCKET}/data/tokens.bin"


def bare_ddp(args, tokens: Path, ranks: int) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", str(ROOT / "benchmarks" / "bare_ddp.py")]
    command += ["--model", args.model, "--data", str(tokens), "--global-batch", str(args.global_batch)]
    command += ["--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ | {"PYTHONPATH": str(ROOT)}, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-micro")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint-every", type=int, default=None, help="default: the product's (within 5% of training time)")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/training_overhead.json"))
    args = parser.parse_args()

    from frenzy_prefect.localstack import LocalStack
    from frenzy_prefect.profiling.model import resolve_model

    model = resolve_model(args.model, seq_len=args.seq_len)
    with tempfile.TemporaryDirectory() as home, LocalStack(Path(home), worker_query_seconds=1) as stack:
        tokens = Path(home) / "tokens.bin"
        np.random.default_rng(0).integers(0, model.vocab_size, 2_000_000).astype(np.uint16).tofile(tokens)
        stack.start_s3()
        stack.start_prefect()
        from frenzy_prefect.storage import filesystem

        fs, _ = filesystem(DATASET)
        fs.mkdir(BUCKET)
        fs.put_file(str(tokens), DATASET.removeprefix("s3://"))
        before = bare_ddp(args, tokens, 2)  # the flow's plan is dp=2, as bare_ddp
        with stack.client_settings():
            flow_run = _flow_training(args, stack, model)
        after = bare_ddp(args, tokens, 2)
    bare = {"tokens_per_s": (before["tokens_per_s"] + after["tokens_per_s"]) / 2, "runs": [before["tokens_per_s"], after["tokens_per_s"]]}

    ours = flow_run["tokens_per_s"]
    checkpoint_s = flow_run["checkpoint_s"]
    step_s = flow_run["step_s"]
    result = {
        "model": args.model,
        "plan": flow_run["plan"],
        "global_batch": args.global_batch,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "flow_tokens_per_s": ours,
        "bare_ddp_tokens_per_s": bare["tokens_per_s"],
        "bare_ddp_runs_tokens_per_s": bare["runs"],
        "tokens_per_s_overhead": 1 - ours / bare["tokens_per_s"],
        "checkpoint_every": args.checkpoint_every,
        "checkpoint_s": checkpoint_s,
        "checkpoint_share": sum(checkpoint_s) / (sum(checkpoint_s) + sum(step_s)),
        "submit_to_first_step_s": flow_run["first_step_s"],
    }
    print(f"{args.model}, {flow_run['plan']}, global batch {args.global_batch} x {args.seq_len}, {args.steps} steps")
    print(f"{'':<34}{'tokens/s':>10}")
    print(f"{'bare torchrun DDP':<34}{bare['tokens_per_s']:>10,.0f}")
    print(f"{'frenzy flow (checkpoints excluded)':<34}{ours:>10,.0f}   overhead {result['tokens_per_s_overhead']:+.1%}")
    print(
        f"checkpoints: {len(checkpoint_s)}, mean {sum(checkpoint_s) / max(1, len(checkpoint_s)):.2f} s,"
        f" {result['checkpoint_share']:.1%} of the run ({args.checkpoint_every or 'default'} interval, the final one included)"
    )
    print(f"submit -> first step (warm worker): {result['submit_to_first_step_s']:.1f} s")
    write_result(result, args.json)


def _flow_training(args, stack, model) -> dict:
    """One warm-up run, then the measured one; returns its plan, rank count, steady tokens/s,
    step and checkpoint times and submit -> first step."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.deployments import run_deployment

    from frenzy_prefect import allocator
    from frenzy_prefect.blocks import FrenzyCluster
    from frenzy_prefect.flows.deployments import deploy_flows
    from frenzy_prefect.profiling.dataset import profile_dataset
    from frenzy_prefect.spec.cluster import ClusterSpec, ClusterState
    from frenzy_prefect.spec.plan import ParallelPlan, TrainingJob
    from frenzy_prefect.spec.request import TrainingRequest
    from frenzy_prefect.spec.result import TrainingResult
    from frenzy_prefect.storage import open_uri

    cluster = ClusterSpec.from_file(ROOT / "blocks" / "local-hetero.yaml")
    FrenzyCluster(cluster=cluster).save("local-hetero", overwrite=True)
    stack.start_worker("frenzy")
    deploy_flows("frenzy")
    request = TrainingRequest(
        model=args.model,
        dataset=DATASET,
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        steps=args.steps,
        precision="fp32",
        log_every=args.steps,
        checkpoint_every=args.checkpoint_every,
    )
    plan = ParallelPlan(dp=2, micro_batch=args.micro_batch)  # what bare_ddp runs: plain DDP on two ranks
    candidates = [c for c in allocator.candidate_plans(model, request, cluster) if c.fits and c.plan == plan]
    allocation = allocator.allocate(candidates, ClusterState.idle(cluster))
    dataset = profile_dataset(DATASET, request.seq_len, model.vocab_size)

    def run(name: str):
        job = TrainingJob(
            request=request, model=model, dataset=dataset, allocation=allocation, cluster=cluster, output=f"s3://{BUCKET}/{name}"
        )
        flow_run = run_deployment("distributed-train/frenzy", parameters={"job": job.model_dump(mode="json")}, timeout=1800)
        assert flow_run.state.is_completed(), flow_run.state
        return job, flow_run

    run("warm-up")
    job, flow_run = run("measured")
    with open_uri(job.metrics_uri, "r") as f:
        result = TrainingResult.model_validate(json.load(f))
    with get_client(sync_client=True) as client:
        time.sleep(3)  # logs reach the server in batches
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id])), limit=200)
    first = min(log.timestamp for log in logs if log.message.startswith("step 1/"))
    steady = result.step_s[1:]
    return {
        "plan": plan.label(),
        "ranks": plan.gpus,
        "tokens_per_s": len(steady) * args.global_batch * args.seq_len / sum(steady),
        "step_s": result.step_s,
        "checkpoint_s": result.checkpoint_s,
        "first_step_s": (first - flow_run.expected_start_time).total_seconds(),
    }


if __name__ == "__main__":
    main()
