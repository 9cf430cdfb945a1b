"""The main job, end to end on the embedded default stack.

Starts a local S3 endpoint (moto) and a Prefect server on SQLite unless the environment points
at real ones, uploads a small text dataset, saves the example heterogeneous cluster as a
FrenzyCluster block, deploys the flows to a `frenzy` work pool, starts a worker, runs the
`train-llm/frenzy` deployment and prints what it chose and produced. Stops what it started,
also when stopped early with Ctrl-C, SIGTERM or SIGHUP.

    python examples/quickstart.py [--steps N] [--pp N] [--keep-running]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "frenzy-demo"
DATASET = f"s3://{BUCKET}/datasets/stdlib-docs.txt"
# Real English prose that ships with every Python: the standard library's own documentation.
CORPUS_MODULES = (
    "argparse",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email",
    "enum",
    "fractions",
    "functools",
    "heapq",
    "html",
    "http.client",
    "inspect",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "mailbox",
    "math",
    "os",
    "pathlib",
    "pickle",
    "random",
    "re",
    "shutil",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib.parse",
    "uuid",
    "zipfile",
)


def corpus() -> bytes:
    """Every docstring of the modules above and their public members."""
    parts = []
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        for _, member in [(name, module), *inspect.getmembers(module)]:
            doc = inspect.getdoc(member) if inspect.ismodule(member) or inspect.isclass(member) or inspect.isfunction(member) else None
            if doc and len(doc) > 200:
                parts.append(doc)
    return "\n\n".join(dict.fromkeys(parts)).encode()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, default=ROOT / ".frenzy", help="State, logs and the SQLite database.")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument(
        "--pp",
        type=int,
        default=2,
        help="Pin the pipeline depth, as a Megatron user would (the allocator chooses the rest); 0: the allocator chooses it too.",
    )
    parser.add_argument("--keep-running", action="store_true", help="Keep the server up afterwards to browse the UI.")
    args = parser.parse_args()
    started = time.perf_counter()

    from frenzy_prefect.localstack import LocalStack

    with LocalStack(args.home) as stack:
        print(f"S3 endpoint:    {stack.start_s3()}")
        print(f"Prefect API:    {stack.start_prefect()}")
        print(f"Prefect UI:     {stack.ui_url}")

        from frenzy_prefect.storage import filesystem

        fs, _ = filesystem(DATASET)
        if not fs.exists(BUCKET):
            fs.mkdir(BUCKET)
        data = corpus()
        fs.pipe_file(DATASET.removeprefix("s3://"), data)
        print(f"Dataset:        {DATASET} ({len(data):,} bytes of text, byte-level tokens)")

        with stack.client_settings():
            from prefect.deployments import run_deployment

            from frenzy_prefect.blocks import FrenzyCluster
            from frenzy_prefect.deployments import deploy_flows
            from frenzy_prefect.flows import default_output
            from frenzy_prefect.spec.request import TrainingRequest
            from frenzy_prefect.spec.result import TrainingReport
            from frenzy_prefect.storage import open_uri
            from frenzy_prefect.units import gib

            FrenzyCluster.from_file(ROOT / "blocks" / "local-hetero.yaml").save("local-hetero", overwrite=True)
            stack.start_worker("frenzy")
            deploy_flows("frenzy")
            print("Worker:         `frenzy` work pool 'frenzy', deployments train-llm/frenzy and distributed-train/frenzy")

            request = TrainingRequest(
                model="gpt-nano",
                dataset=DATASET,
                global_batch=32,
                seq_len=128,
                steps=args.steps,
                precision="fp32",
                log_every=10,
                plan={"pp": args.pp} if args.pp else None,
            )
            pinned = f", {request.plan.label()} pinned" if request.plan else ""
            print(
                f"Running train-llm: {request.model}, global batch {request.global_batch}, seq {request.seq_len}, "
                f"{request.steps} steps{pinned} ..."
            )
            run = run_deployment(
                "train-llm/frenzy",
                parameters={"request": request.model_dump(mode="json"), "cluster": "local-hetero"},
                timeout=600,
                poll_interval=2,
            )
            if run.state is None or not run.state.is_completed():
                print(f"train-llm run {run.name} ended {run.state.name if run.state else '?'}: {run.state.message if run.state else ''}")
                print(f"Logs: {stack.logs}; the UI at {stack.ui_url} shows the run")
                return 1
            with open_uri(f"{default_output(DATASET, run.name)}/report.json", "r") as f:
                report = TrainingReport.model_validate_json(f.read())

        a = report.allocation
        placed = ", ".join(f"{p.node} GPUs {p.gpus}" for p in a.placements)
        print()
        print(f"Flow run:       train-llm {run.name} ({stack.ui_url}/runs/flow-run/{run.id})")
        print(f"Model:          {report.model}, {report.parameters:,} parameters")
        print(f"Chosen plan:    {a.plan.gpus} x {a.gpu_type}, {a.plan.label()}")
        print(f"Placement:      {placed}")
        print(f"Predicted peak: {gib(a.memory.peak_bytes)} GiB per GPU (of {gib(a.gpu_memory_bytes, 1)} GiB)")
        cost = "" if a.cost is None else f", cost {a.cost:.4f} at the cluster file's prices"
        print(f"Predicted time: {a.step_time_s:.3g} s a step on the modelled GPUs, {a.total_time_s:.3g} s in all{cost}")
        print(f"Loss:           {report.loss_start:.4f} at step 1 -> {report.loss_end:.4f} at step {report.result.steps}")
        print(f"Throughput:     {report.result.tokens_per_s:,.0f} tokens/s on {report.result.world_size} ranks ({report.result.backend})")
        print(f"Checkpoint:     {report.result.checkpoint}")
        print(f"Loss curve:     {default_output(DATASET, run.name)}/loss-curve.png (and the run's loss-curve-picture artifact)")
        print(f"Events:         {', '.join(training_events(stack, report.training_flow_run))}")
        print(f"Wall time:      {time.perf_counter() - started:.1f} s")
        if args.keep_running:
            print(f"\nServices stay up; browse {stack.ui_url}. Ctrl-C (or SIGTERM, SIGHUP) stops them.", flush=True)
            try:
                while True:
                    signal.pause()
            except KeyboardInterrupt:  # how LocalStack delivers SIGTERM and SIGHUP too
                print("Stopping the services ...", flush=True)
        else:
            print(f"\nTo browse the runs later: PREFECT_HOME={args.home / 'prefect'} prefect server start, then open the UI.")
    return 0


def training_events(stack, training_run: str) -> list[str]:
    """The frenzy.training.* events of the training flow run, oldest first (the UI's Event Feed),
    once the last has arrived (the server stores events a moment after they are sent)."""
    from prefect.client.orchestration import get_client

    about = {"event": {"prefix": ["frenzy.training."]}, "any_resource": {"id": [f"prefect.flow-run.{training_run}"]}}
    deadline = time.monotonic() + 15
    with stack.client_settings(), get_client(sync_client=True) as client:
        while True:
            events = client._client.post("/events/filter", json={"filter": about}).json()["events"]
            names = [e["event"].removeprefix("frenzy.training.") for e in sorted(events, key=lambda e: e["occurred"])]
            if names[-1:] in (["completed"], ["failed"]) or time.monotonic() > deadline:
                return names
            time.sleep(0.5)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as stop:  # Ctrl-C, SIGTERM or SIGHUP before the end: the stack is already stopped
        print(f"\nInterrupted ({stop or 'SIGINT'}); stopped everything this demo started.", file=sys.stderr)
        sys.exit(130)
