"""The GPU queue with and without backfill, the same crowd on the embedded stack (a real Prefect
server on SQLite, moto's S3, two `frenzy` workers, the example cluster's four local "GPUs": two
A10, two T4), in one invocation: first with FRENZY_BACKFILL=off on the workers (strict first
come first served per GPU type), then on, each phase on a fresh stack.

Predictions come from the allocator, calibrated here first: four one-GPU gpt-nano runs (all
four GPUs busy, as in the crowd) measure the step time, and each type's achievable fraction is
fitted to it (step_time.fit_achievable_fraction); the crowd's runs are then sized in steps to
last a predicted --short-s or --long-s. The crowd, per type and interleaved across the two
(PER_TYPE): a long one-GPU run, a short two-GPU run that must wait behind it, short one-GPU
runs. Its runs arrive in that order, each once the last is in the queue, so that both phases
queue them alike.

Sampled every SAMPLE_S (each sample weighs the time to the next): per GPU type, its free GPUs
and the runs of that type waiting (scheduled or pending, holding nothing). "Idle while waiting":
the share of the time a run of a type waited in which a GPU of that type was free. Runs/min: the
crowd over the time from its first submission to its last final state. Waits: submission to
"Reserved GPUs". A backfilled run "overran" when its GPUs were released after its predicted
end; "an older run took its GPUs next" when a run of its type submitted before it reserved one
of its GPUs within NEXT_S of their release: the head waited longer than predicted because of it
(at most by the overrun). Every run's timeline is in the JSON.

    python -m benchmarks.queue_backfill [--short-s 15] [--long-s 150] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from itertools import pairwise
from pathlib import Path

from benchmarks import write_result

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "frenzy-bench"
DATASET = f"s3://{BUCKET}/data/text.txt"
POOL = "frenzy"
WORKERS = ("bench-worker-1", "bench-worker-2")
WORKER_LIMIT = 10  # each: the crowd spills over to the second worker, as in the crowd tests
SAMPLE_S = 1.0
NEXT_S = 5.0  # a sweep (2 s) and the logging around it
CALIBRATION_STEPS = 10
# (GPUs, length) per type: a long one-GPU run the two-GPU one queues behind, then short ones.
PER_TYPE = [(1, "long"), (2, "short"), (1, "short"), (1, "short"), (1, "short"), (1, "short")]
TYPES = ("A10", "T4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short-s", type=float, default=15.0, help="predicted time of a short run's steps")
    parser.add_argument("--long-s", type=float, default=150.0, help="predicted time of a long run's steps")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/queue_backfill.json"))
    args = parser.parse_args()
    lengths = {"short": args.short_s, "long": args.long_s}
    load = {"before": os.getloadavg()}
    phases, calibration, crowd = {}, None, None
    for mode in ("off", "on"):
        with tempfile.TemporaryDirectory() as home, _stack(Path(home), mode) as stack, stack.client_settings():
            if calibration is None:
                calibration = _calibrate()
                crowd = _crowd(calibration["cluster"], lengths)
                print(f"calibrated: {calibration['measured_step_s_median']} s a step", flush=True)
            phases[mode] = asyncio.run(_phase(crowd, mode))
            print(f"FRENZY_BACKFILL={mode}: {phases[mode]['wall_s']:.0f} s", flush=True)
        os.environ.pop("AWS_ENDPOINT_URL")  # the stack pointed this process at its S3, which is gone now
    load["after"] = os.getloadavg()
    result = {
        "setup": {
            "cores": os.cpu_count(),
            "load_average_1_5_15": load,
            "crowd": [
                {
                    "gpu_type": j.allocation.gpu_type,
                    "gpus": j.allocation.plan.gpus,
                    "steps": j.request.steps,
                    "predicted_s": j.allocation.total_time_s,
                }
                for j in crowd
            ],
            "calibration": {k: v for k, v in calibration.items() if k != "cluster"},
            "sample_s": SAMPLE_S,
        },
        "fifo": phases["off"],
        "backfill": phases["on"],
    }
    _print_table(result)
    write_result(result, args.json)


class _stack:
    """A fresh embedded stack with two workers whose queue runs with FRENZY_BACKFILL=``mode``."""

    def __init__(self, home: Path, mode: str) -> None:
        from frenzy_prefect.localstack import LocalStack

        self.stack = LocalStack(home, worker_query_seconds=1)
        self.mode = mode

    def __enter__(self):
        stack = self.stack.__enter__()
        stack.start_s3()
        stack.start_prefect()
        from frenzy_prefect.storage import filesystem

        fs, _ = filesystem(DATASET)
        fs.mkdir(BUCKET)
        fs.pipe_file(DATASET.removeprefix("s3://"), b"the quick brown fox jumps over the lazy dog. " * 4000)
        stack.env["FRENZY_BACKFILL"] = self.mode
        for name in WORKERS:
            stack.start_worker(POOL, name=name, limit=WORKER_LIMIT)
        with stack.client_settings():
            from frenzy_prefect.flows.deployments import deploy_flows

            deploy_flows(POOL)
        return stack

    def __exit__(self, *exc):
        return self.stack.__exit__(*exc)


def _job(cluster, gpu_type: str, gpus: int, steps: int):
    from frenzy_prefect import allocator
    from frenzy_prefect.profiling.dataset import profile_dataset
    from frenzy_prefect.profiling.model import resolve_model
    from frenzy_prefect.spec.cluster import ClusterState
    from frenzy_prefect.spec.plan import TrainingJob
    from frenzy_prefect.spec.request import TrainingRequest

    request = TrainingRequest(
        model="gpt-nano", dataset=DATASET, global_batch=8, seq_len=64, steps=steps, precision="fp32",
        log_every=max(1, steps // 4), checkpoint_every=steps,
    )  # fmt: skip
    model = resolve_model(request.model, seq_len=request.seq_len)
    fitting = [c for c in allocator.candidate_plans(model, request, cluster) if c.fits and c.gpu_type == gpu_type and c.plan.gpus == gpus]
    allocation = allocator.allocate(fitting, ClusterState.idle(cluster))
    dataset = profile_dataset(DATASET, request.seq_len, model.vocab_size)
    return TrainingJob(request=request, model=model, dataset=dataset, allocation=allocation, cluster=cluster, output=f"s3://{BUCKET}/runs")


def _calibrate() -> dict:
    """Each type's achievable fraction, fitted to the steps of two one-GPU runs per type, all four
    at once; and the cluster with the fitted types."""
    from frenzy_prefect.allocator.step_time import fit_achievable_fraction, predict_step
    from frenzy_prefect.spec.cluster import ClusterSpec
    from frenzy_prefect.spec.result import TrainingResult
    from frenzy_prefect.storage import filesystem

    catalog = ClusterSpec.from_file(ROOT / "blocks" / "local-hetero.yaml")
    jobs = _outputs([_job(catalog, t, 1, CALIBRATION_STEPS) for t in TYPES for _ in range(2)], "calibration")
    asyncio.run(_run_all(jobs))
    fitted, measured = {}, {}
    for t in TYPES:
        samples = []
        for job in (j for j in jobs if j.allocation.gpu_type == t):
            fs, path = filesystem(job.metrics_uri)
            steps = TrainingResult.model_validate_json(fs.cat_file(path)).step_s[1:]  # the first step also warms up
            r = job.request
            predicted = predict_step(
                job.model, job.allocation.plan, global_batch=r.global_batch, seq_len=r.seq_len, precision=r.precision,
                gpu=catalog.gpu_of(next(n for n in catalog.nodes if n.gpu_type == t)),
            )  # fmt: skip
            samples += [(predicted, s) for s in steps]
        fitted[t] = fit_achievable_fraction(samples)
        measured[t] = statistics.median(s for _, s in samples)
    types = {t: catalog.known_gpu_types()[t].model_copy(update={"achievable_fraction": fitted[t]}) for t in TYPES}
    cluster = catalog.model_copy(update={"gpu_types": types})
    return {"cluster": cluster, "achievable_fraction": fitted, "measured_step_s_median": measured}


def _crowd(cluster, lengths: dict[str, float]) -> list:
    out = []
    for gpus, length in PER_TYPE:
        for t in TYPES:
            step_s = _job(cluster, t, gpus, 1).allocation.step_time_s
            out.append(_job(cluster, t, gpus, max(1, round(lengths[length] / step_s))))
    return out


def _outputs(jobs: list, tag: str) -> list:
    """The jobs, each writing under its own prefix."""
    return [job.model_copy(update={"output": f"s3://{BUCKET}/{tag}/{k}"}) for k, job in enumerate(jobs)]


async def _submit(jobs: list) -> list:
    from prefect.deployments import run_deployment

    from frenzy_prefect.pool.server_calls import patiently

    submit = [
        lambda j=j: run_deployment("distributed-train/frenzy", parameters={"job": j.model_dump(mode="json")}, timeout=0) for j in jobs
    ]
    return [await patiently(call, "submitting a run") for call in submit]


async def _read(client, ids: list) -> list:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from frenzy_prefect.pool.server_calls import patiently

    return await patiently(lambda: client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids))), "reading runs")


async def _until_final(client, ids: list, deadline: float) -> list:
    while True:
        runs = await _read(client, ids)
        if all(r.state.is_final() for r in runs):
            return runs
        assert time.monotonic() < deadline, "the runs did not finish in time"
        await asyncio.sleep(1)


async def _run_all(jobs: list) -> None:
    from prefect.client.orchestration import get_client

    ids = [r.id for r in await _submit(jobs)]
    async with get_client() as client:
        runs = await _until_final(client, ids, time.monotonic() + 1800)
    bad = [r.state.message for r in runs if not r.state.is_completed()]
    assert not bad, f"calibration runs failed: {bad}"


async def _phase(crowd: list, mode: str, timeout_s: float = 3600) -> dict:
    """Submit the crowd in its order, each run once the last is in the queue (so that the queue's
    order is the crowd's); sample until every run is final; then what each run did."""
    from prefect.client.orchestration import get_client

    began = time.monotonic()
    ids: list = []
    samples: list[dict] = []
    async with get_client() as client:
        sampling = asyncio.create_task(_sample(client, crowd[0].cluster, ids, samples))
        for job in _outputs(crowd, f"crowd-{mode}"):
            (run,) = await _submit([job])
            ids.append(run.id)
            while not _queued(await _read(client, [run.id])):
                assert time.monotonic() - began < timeout_s, "a run was never taken by a worker"
                await asyncio.sleep(0.5)
        runs = await _until_final(client, ids, began + timeout_s)
        wall = time.monotonic() - began
        if sampling.done():
            sampling.result()  # (raises what stopped it)
        sampling.cancel()
        records = await _records(client, runs)
    return _summary(runs, records, samples, wall)


def _queued(runs: list) -> bool:
    """Whether the run waits in the GPU queue or holds GPUs already (or ended)."""
    from frenzy_prefect.pool import run_labels

    (run,) = runs
    return bool(run.labels.get(run_labels.WAITING_FOR) or run.labels.get(run_labels.HOLDS)) or run.state.is_final()


async def _sample(client, cluster, ids: list, samples: list[dict]) -> None:
    """Every SAMPLE_S until cancelled: per GPU type, its free GPUs and the runs waiting for it."""
    from frenzy_prefect.pool.reservations import GpuReservations
    from frenzy_prefect.pool.server_calls import patiently

    gpu_type = {n.name: n.gpu_type for n in cluster.nodes}
    while True:
        runs = await _read(client, list(ids)) if ids else []
        free = (await patiently(GpuReservations(client, cluster).state, "reading the free GPUs")).free_gpus
        samples.append(
            {
                "at": time.monotonic(),
                "free": {t: sum(len(free[n]) for n in free if gpu_type[n] == t) for t in TYPES},
                "waiting": {t: sum(_waiting(r) == t for r in runs) for t in TYPES},
            }
        )
        await asyncio.sleep(SAMPLE_S)


def _waiting(run) -> str | None:
    """The GPU type a run waits for (scheduled or pending, holding nothing), else None."""
    from frenzy_prefect.pool import run_labels

    if run.state.is_scheduled() or (run.state.is_pending() and not run.labels.get(run_labels.HOLDS)):
        return run.parameters["job"]["allocation"]["gpu_type"]
    return None


async def _records(client, runs) -> dict:
    deadline = time.monotonic() + 60  # the worker releases after the run is final; logs come in batches
    return {run.id: await _record(client, run.id, deadline) for run in runs}


async def _record(client, run_id, deadline: float) -> dict:
    """When a run reserved and released its GPUs (its logs), which, whether it was backfilled,
    and its predicted end (its frenzy.holds label)."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from frenzy_prefect.pool import run_labels
    from frenzy_prefect.pool.gpu_queue import Holds
    from frenzy_prefect.pool.server_calls import patiently

    def starting(prefix: str) -> list:
        return [log for log in logs if log.message.startswith(prefix)]

    while True:
        logs = await patiently(
            lambda: client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), limit=200), "reading logs"
        )
        if (starting("Reserved GPUs ") and starting("Releasing GPUs ")) or time.monotonic() > deadline:
            break
        await asyncio.sleep(1)
    run = await patiently(lambda: client.read_flow_run(run_id), "reading a run")
    holds = Holds.model_validate_json(run.labels[run_labels.HOLDS])
    return {
        "gpu_type": run.parameters["job"]["allocation"]["gpu_type"],
        "gpus": {(node, i) for node, idx in holds.gpus.items() for i in idx},
        "submitted": run.created.timestamp(),
        "reserved": min(log.timestamp for log in starting("Reserved GPUs ")).timestamp(),
        "released": min(log.timestamp for log in starting("Releasing GPUs ")).timestamp(),
        "predicted_end": holds.predicted_end.timestamp(),
        "backfilled": bool(starting("Backfilled: ")),
    }


def _summary(runs, records: dict, samples: list, wall: float) -> dict:
    """The phase's numbers; each sample weighs the time to the next one."""
    spans = [(s, b["at"] - s["at"]) for s, b in pairwise(samples)]
    pairs = [(s["free"][t], dt) for s, dt in spans for t in TYPES if s["waiting"][t]]
    backfilled = [r for r in records.values() if r["backfilled"]]
    overran = [r for r in backfilled if r["released"] > r["predicted_end"]]
    took_next = [r for r in overran if _an_older_run_took_its_gpus_next(r, records.values())]
    waits: dict[int, list[float]] = {}
    for r in records.values():
        waits.setdefault(len(r["gpus"]), []).append(r["reserved"] - r["submitted"])
    first = min(r["submitted"] for r in records.values())
    return {
        "runs": len(runs),
        "completed": sum(r.state.is_completed() for r in runs),
        "wall_s": wall,
        "runs_per_min": 60 * len(runs) / wall,
        "samples": len(samples),
        "idle_while_waiting": sum(dt for free, dt in pairs if free) / sum(dt for _, dt in pairs) if pairs else 0.0,
        "idle_gpu_s_while_waiting": sum(free * dt for free, dt in pairs),
        "gpu_utilisation": sum((1 - sum(s["free"].values()) / 4) * dt for s, dt in spans) / sum(dt for _, dt in spans),
        "wait_s": {f"{g}_gpu": {"mean": statistics.mean(w), "max": max(w)} for g, w in sorted(waits.items())},
        "backfilled": len(backfilled),
        "overran": len(overran),
        "overrun_s": sorted(r["released"] - r["predicted_end"] for r in overran),
        "overran_and_an_older_run_took_its_gpus_next": len(took_next),
        "runs_timeline_s": [  # from the first submission
            {
                "gpu_type": r["gpu_type"],
                "gpus": sorted(r["gpus"]),
                "backfilled": r["backfilled"],
                **{k: round(r[k] - first, 1) for k in ("submitted", "reserved", "predicted_end", "released")},
            }
            for r in sorted(records.values(), key=lambda r: r["submitted"])
        ],
    }


def _an_older_run_took_its_gpus_next(run: dict, records) -> bool:
    return any(
        other["submitted"] < run["submitted"]
        and other["gpu_type"] == run["gpu_type"]
        and other["gpus"] & run["gpus"]
        and run["released"] <= other["reserved"] <= run["released"] + NEXT_S
        for other in records
    )


def _print_table(result: dict) -> None:
    fifo, backfill = result["fifo"], result["backfill"]
    steps = result["setup"]["calibration"]["measured_step_s_median"]
    print(f"measured step (gpt-nano, 1 GPU, all 4 busy): {', '.join(f'{t} {s * 1000:.0f} ms' for t, s in steps.items())}")
    rows = [
        ("runs completed", lambda p: f"{p['completed']}/{p['runs']}"),
        ("wall (s)", lambda p: f"{p['wall_s']:.0f}"),
        ("runs/min", lambda p: f"{p['runs_per_min']:.2f}"),
        ("idle while waiting (share of samples)", lambda p: f"{100 * p['idle_while_waiting']:.0f}%"),
        ("idle GPU-s while a run of its type waited", lambda p: f"{p['idle_gpu_s_while_waiting']:.0f}"),
        ("GPU utilisation (sampled)", lambda p: f"{100 * p['gpu_utilisation']:.0f}%"),
        *[(f"wait {g}: mean / max (s)", lambda p, g=g: _mean_max(p["wait_s"][g])) for g in fifo["wait_s"]],
        ("backfilled runs", lambda p: str(p["backfilled"])),
        ("  of which overran their prediction", lambda p: str(p["overran"])),
        ("  ... and an older run took its GPUs next", lambda p: str(p["overran_and_an_older_run_took_its_gpus_next"])),
    ]
    print(f"{'':44} {'FIFO':>10} {'backfill':>10}")
    for name, cell in rows:
        print(f"{name:44} {cell(fifo):>10} {cell(backfill):>10}")


def _mean_max(wait: dict) -> str:
    return f"{wait['mean']:.0f} / {wait['max']:.0f}"


if __name__ == "__main__":
    main()
