"""The main job, end to end on the embedded default stack, as a data team runs it.

Starts a local S3 endpoint (moto) and a Prefect server on SQLite unless the environment points
at real ones; saves the example heterogeneous cluster as a FrenzyCluster block and makes it the
`frenzy` pool's cluster; starts a worker; deploys the flows, and a watcher with a train-llm
deployment its events trigger (`frenzy deploy --on-new-data --approve`). Then a raw dataset
lands (JSONL, in two puts); the watcher announces it once; the triggered train-llm run prepares
it (a BPE trained on the data), ranks the plans and pauses; the demo approves the first, as a
person would with the run page's Resume button, and prints what was chosen and produced. Stops
what it started, also when stopped early with Ctrl-C, SIGTERM or SIGHUP.

    python examples/quickstart.py [--steps N] [--pp N] [--keep-running]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import itertools
import json
import logging
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "frenzy-demo"
INCOMING = f"s3://{BUCKET}/incoming/stdlib-docs/"  # where the raw dataset lands
POOL, CLUSTER = "frenzy", "local-hetero"
MODEL = "gpt-nano-bpe"  # gpt-nano with room for the BPE preparation trains on the data (1,024 tokens)
SETTLE_S = 3.0  # how long the landed files must stand still before the watcher announces them
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


def documents() -> list[str]:
    """Every docstring (over 200 characters) of the modules above and their public members."""
    parts = []
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        for _, member in [(name, module), *inspect.getmembers(module)]:
            doc = inspect.getdoc(member) if inspect.ismodule(member) or inspect.isclass(member) or inspect.isfunction(member) else None
            if doc and len(doc) > 200:
                parts.append(doc)
    return list(dict.fromkeys(parts))


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
        with stack.client_settings():
            trainer = set_up(stack, args)
            report = land_and_train(stack, trainer)
        if report is None:
            print(f"Logs: {stack.logs}; the UI at {stack.ui_url} shows the runs")
            return 1
        print_report(stack, report, started)
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


def set_up(stack, args) -> str:
    """The cluster block and the pool's cluster, a worker, the deployments; the name of the
    train-llm deployment that new data triggers."""
    from frenzy_prefect.blocks import FrenzyCluster
    from frenzy_prefect.flows.deployments import deploy_flows, deploy_on_new_data
    from frenzy_prefect.pool.template import set_pool_cluster
    from frenzy_prefect.spec.request import TrainingRequest

    FrenzyCluster.from_file(ROOT / "blocks" / f"{CLUSTER}.yaml").save(CLUSTER, overwrite=True)
    set_pool_cluster(POOL, CLUSTER)
    print(f"Cluster:        {CLUSTER} (blocks/{CLUSTER}.yaml: 2 x A10, 2 x T4), the `{POOL}` pool's cluster (frenzy cluster use)")
    stack.start_worker(POOL)
    request = demo_request(args.steps, args.pp)
    TrainingRequest.model_validate(request | {"dataset": INCOMING})
    with contextlib.redirect_stdout(io.StringIO()):  # (Prefect's table of what it deployed)
        deploy_flows(POOL)
        # The watcher's schedule stays paused: the demo runs the watcher itself, so that the steps
        # show in order (resume the schedule in the UI and it looks every 60 s).
        watcher, trainer = deploy_on_new_data(POOL, INCOMING, request, settle_s=SETTLE_S, approve=True, paused=True)
    print(f"Deployed:       train-llm/frenzy, distributed-train/frenzy, node-check/frenzy; {watcher}; {trainer}, run on each new version")
    return trainer


def demo_request(steps: int = 80, pp: int = 2) -> dict:
    """The request the landing trigger trains with (its dataset: each new version under INCOMING)."""
    return {
        "model": MODEL,
        "global_batch": 32,
        "seq_len": 128,
        "steps": steps,
        "precision": "fp32",
        "log_every": 10,
        "plan": {"pp": pp} if pp else None,
    }


def land_and_train(stack, trainer: str):
    """Upload the raw dataset in two puts, watch it land, approve the triggered run's first plan
    and wait for it: its report and flow run, or None (said why)."""
    from prefect.flow_runs import resume_flow_run

    from frenzy_prefect.flows import watch_datasets
    from frenzy_prefect.flows.training import default_output
    from frenzy_prefect.spec.result import TrainingReport
    from frenzy_prefect.storage import open_uri

    quiet_console()
    docs, earlier = documents(), runs_of(trainer)
    size = upload_in_two_puts(docs)
    print(f"Dataset:        {INCOMING}: {len(docs):,} documents ({size:,} bytes of JSONL) put as two files, one after the other")
    while (version := watch_datasets(INCOMING, settle_s=SETTLE_S)) is None:  # what the watcher's schedule does
        time.sleep(1.0)
    print(f"Landed:         version {version}, announced once (frenzy.dataset.landed) after standing still {SETTLE_S:g} s")
    run = wait_for(triggered_run(trainer, earlier), lambda r: r.state.is_paused())
    if not run.state.is_paused():
        print(f"train-llm run {run.name} is {run.state.name}, not paused for approval: {run.state.message}")
        return None
    print(f"Triggered:      {trainer} run {run.name}: prepared the dataset, ranked the plans, paused for approval")
    print_prepared()
    print_plans(run.id)
    resume_flow_run(run.id, run_input={"run": True, "plan": 1})
    print("Approved:       plan #1 (as a person would: the run page's Resume button, plan 1)")
    run = wait_for(run.id, lambda r: r.state.is_final())
    if not run.state.is_completed():
        print(f"train-llm run {run.name} ended {run.state.name}: {run.state.message}")
        return None
    with open_uri(f"{default_output(INCOMING, run.name)}/report.json", "r") as f:
        return TrainingReport.model_validate_json(f.read()), run


def quiet_console() -> None:
    """The watcher's runs in this process log to the UI only, not among the demo's lines."""
    from prefect.logging.handlers import PrefectConsoleHandler

    for name in ("", "prefect", "prefect.flow_runs"):  # (the root logger holds the console handler)
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, PrefectConsoleHandler):
                handler.setLevel(logging.WARNING)


def upload_in_two_puts(docs: list[str]) -> int:
    from frenzy_prefect.storage import filesystem

    fs, path = filesystem(INCOMING)
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)
    # Each record says when it was exported, as a real export's would: the files of every demo
    # run differ, so each is a new version (the same files again would not be announced again).
    exported = datetime.now(UTC).isoformat(timespec="seconds")
    half, size = len(docs) // 2, 0
    for number, part in enumerate((docs[:half], docs[half:]), 1):
        body = "\n".join(json.dumps({"text": doc, "exported": exported}) for doc in part).encode()
        fs.pipe_file(f"{path.rstrip('/')}/part-{number}.jsonl", body)
        size += len(body)
    return size


def runs_of(deployment: str) -> set:
    """The ids of the runs of ``deployment`` so far."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId

    with get_client(sync_client=True) as client:
        deployment_id = client.read_deployment_by_name(deployment).id
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id])))
    return {run.id for run in runs}


def triggered_run(deployment: str, earlier: set, timeout_s: float = 120):
    """The id of the run of ``deployment`` that is not one of ``earlier`` (its trigger creates it)."""
    deadline = time.monotonic() + timeout_s
    while not (new := runs_of(deployment) - earlier):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no run of {deployment} {timeout_s:.0f} s after the dataset landed")
        time.sleep(1.0)
    (run_id,) = new
    return run_id


def wait_for(run_id, done, timeout_s: float = 900):
    """Flow run ``run_id`` once ``done(run)`` or it ended."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while not (done(run := client.read_flow_run(run_id)) or run.state.is_final()) and time.monotonic() < deadline:
            time.sleep(1.0)
    return run


def print_prepared() -> None:
    """What the run's preparation made of the files now under the prefix: asked again, the same
    preparation finds its manifest by content hash and reads nothing else."""
    from frenzy_prefect.datasets.prepare import for_model, prepare
    from frenzy_prefect.profiling.model import resolve_model

    prepared = prepare(INCOMING, for_model(None, resolve_model(MODEL).vocab_size))
    m = prepared.manifest
    print(
        f"Prepared:       {m.documents:,} documents -> {m.tokens:,} tokens ({m.format} shards, a BPE of {m.vocab_size:,} "
        f"tokens trained on the data) at {prepared.manifest_uri.rsplit('/', 1)[0]}"
    )


def print_plans(run_id, shown: int = 4) -> None:
    """The first plans of the run's memory-estimates artifact, as the run page shows them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        only = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]), key=ArtifactFilterKey(any_=["memory-estimates"]))
        (artifact,) = client.read_artifacts(artifact_filter=only)
    rows = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
    print("\n".join(plan_lines(rows, shown)))


def plan_lines(rows: list[dict[str, str]], shown: int = 4) -> list[str]:
    """The first ``shown`` of the memory-estimates artifact's ``rows``, as the demo prints them
    (docs/demo.md shows them; tests/unit/test_demo_doc.py keeps the two alike)."""
    lines = [f"Plans:          {len(rows)} ranked (the run's memory-estimates artifact); the first {shown}:"]
    columns = {"#": "#", "gpus": "GPUs", "plan": "plan", "peak GiB": "peak GiB", "step time (predicted)": "step"}
    columns |= {"total time (predicted)": "total", "cost (predicted)": "cost", "fits": "fits"}
    table = [list(columns.values())] + [[f"{r[k]} x {r['gpu']}" if k == "gpus" else r[k] for k in columns] for r in rows[:shown]]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    for line in table:
        lines.append(" " * 16 + "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
    return lines


def print_report(stack, found, started: float) -> None:
    from frenzy_prefect.flows.training import default_output
    from frenzy_prefect.units import duration, gib, usd

    report, run = found
    a = report.allocation
    placed = ", ".join(f"{p.node} GPUs {p.gpus}" for p in a.placements)
    print()
    print(f"Flow run:       train-llm {run.name} ({stack.ui_url}/runs/flow-run/{run.id})")
    print(f"Model:          {report.model}, {report.parameters:,} parameters")
    print(f"Chosen plan:    {a.plan.gpus} x {a.gpu_type}, {a.plan.label()}")
    print(f"Placement:      {placed}")
    print(f"Predicted peak: {gib(a.memory.peak_bytes)} GiB per GPU (of {gib(a.gpu_memory_bytes, 1)} GiB)")
    cost = "" if a.cost is None else f", {usd(a.cost)} at the cluster file's prices"
    print(f"Predicted time: {duration(a.step_time_s)} a step on the modelled GPUs, {duration(a.total_time_s)} in all{cost}")
    print(f"Loss:           {report.loss_start:.4f} at step 1 -> {report.loss_end:.4f} at step {report.result.steps}")
    print(f"Throughput:     {report.result.tokens_per_s:,.0f} tokens/s on {report.result.world_size} ranks ({report.result.backend})")
    print(f"Checkpoint:     {report.result.checkpoint}")
    print(f"Loss curve:     {default_output(INCOMING, run.name)}/loss-curve.png (and the run's loss-curve-picture artifact)")
    events = [(name, len(list(same))) for name, same in itertools.groupby(training_events(stack, report.training_flow_run))]
    print(f"Events:         {', '.join(name + (f' x{n}' if n > 1 else '') for name, n in events)} (frenzy.training.*)")
    print(f"Wall time:      {time.perf_counter() - started:.1f} s")


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
