"""ReCycle on live ranks against restart-from-checkpoint, on one failure schedule, and the simulator
fed the measured times (issue 16, item 7).

A dp=2 x pp=2 job of gpt-nano (global batch 128 x 64 tokens, micro-batch 8: 8 micro-batches per
pipeline) trains on 4 gloo ranks of this machine from a local token file, while a thread
SIGKILLs ranks' trainers on a schedule from a failure trace scaled to minutes (the simulator's
``transient_trace`` of the 4 workers: per-node MTBF ``--mtbf-s``, the replacement started at once,
as the supervisor does). The same schedule, counted from the job's first checkpoint (after step
1), is run under:

- **recycle**: ``resilience="recycle"``, a replacement per kill (the survivors re-route, redo the
  interrupted step, the replacement rejoins with a live replica's state; no re-plan to a smaller
  layout, ``replan_after_s`` None);
- **restart**: ``resilience="restart"``, ``max_restarts`` = kills: torchrun's elastic restart of
  every rank from the last sharded checkpoint (the product's default interval, within 5% of the
  training time);
- **drop-the-pipeline**: NOT a live mode of the runtime. Its throughput is composed from
  measured parts by the simulator's drop_pipeline policy: a live dp=1 x pp=2 run of the same
  global batch gives the step time of the one surviving pipeline, recycle's run gives the
  detection and rejoin pauses.

Throughput: samples trained after step 1 over the time from the first checkpoint being complete
to metrics.json being written (both observed on the local files), so the startup (torchrun,
imports, which all policies share) is left out, and a restart's is not.

Then every measured time goes to ``frenzy recycle simulate`` for the same trace, each taken from
the run the simulation predicts (a shared machine's load drifts between runs): step-time tables
{4: fault-free step, 3: re-routed step} (recycle), {4: the restart run's pace between
checkpoints} (restart: torchrun restarts on the whole grid) and {4: fault-free, 2: the dp=1 x
pp=2 step} (drop-the-pipeline); ``detection_s`` (kill -> survivors re-formed), ``join_delay_s``
(kill -> the replacement admitted, less half a re-routed step: the simulator waits for the
boundary itself; 0 for restart, whose relaunch is in ``restart_s``), ``state_copy_s`` (the
rejoin's pause), ``restart_s`` (kill -> training again after a restart),
``checkpoint_interval_s`` and ``checkpoint_write_s``. The table shows live against simulated.

    python -m benchmarks.recycle_live [--quick] [--steps 400] [--mtbf-s 240] [--checkpoint-every N] [--cpu-per-rank C] [--json PATH]

Rank 0 is never killed (it writes the per-step timings this benchmark reads; in a Prefect run it
also hosts the flow). 4 ranks share this machine's cores: a dead rank's CPU goes to the
survivors, which a GPU's worker does not get -- read the re-routed and dropped-pipeline step
times with that in mind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import numpy as np
import psutil

from benchmarks import write_result

ROOT = Path(__file__).resolve().parents[1]
MODEL, SEQ_LEN, GLOBAL_BATCH, MICRO_BATCH = "gpt-nano", 64, 128, 8
DP, PP = 2, 2
MICROBATCHES = GLOBAL_BATCH // (DP * MICRO_BATCH)
MIN_GAP_S = 40.0  # between kills: each replacement rejoins (and each restart trains again) before the next


def node_of(rank: int) -> str:
    """The simulator's node (pipeline-major slots, node k = slot k - 1) of a live rank (stage-major)."""
    stage, pipeline = divmod(rank, DP)
    return f"node{pipeline * PP + stage + 1}"


def rank_of(node: str) -> int:
    slot = int(node[4:]) - 1
    pipeline, stage = divmod(slot, PP)
    return stage * DP + pipeline


def kill_schedule(mtbf_s: float, window: tuple[float, float], kills: int) -> tuple[int, list[tuple[float, int]]]:
    """(seed, [(seconds after the first checkpoint, rank)]): the first seed of ``transient_trace``
    whose failures inside ``window`` number ``kills``, spare rank 0 and are MIN_GAP_S apart."""
    from frenzy_prefect.recycle.traces import transient_trace

    for seed in range(1000):
        trace = transient_trace(DP * PP, mtbf_s=mtbf_s, repair_s=0.0, horizon_s=window[1], seed=seed)
        removals = [(e.time_s, rank_of(e.node)) for e in trace.events if e.kind == "remove" and e.time_s >= window[0]]
        gaps = [b[0] - a[0] for a, b in zip(removals, removals[1:], strict=False)]
        if len(removals) == kills and all(r != 0 for _, r in removals) and all(g >= MIN_GAP_S for g in gaps):
            return seed, [(round(t, 1), r) for t, r in removals]
    raise SystemExit(f"no seed under 1000 gives {kills} kills in {window} with MTBF {mtbf_s} s; change --mtbf-s")


def make_job(tokens: Path, output: Path, dp: int, steps: int, **request):
    from frenzy_prefect.memory import estimate
    from frenzy_prefect.profiling.dataset import profile_dataset
    from frenzy_prefect.profiling.model import resolve_model
    from frenzy_prefect.spec.cluster import ClusterSpec
    from frenzy_prefect.spec.plan import Allocation, ParallelPlan, Placement, TrainingJob
    from frenzy_prefect.spec.request import TrainingRequest

    model = resolve_model(MODEL, seq_len=SEQ_LEN)
    plan = ParallelPlan(dp=dp, pp=PP, micro_batch=MICRO_BATCH)
    req = TrainingRequest(
        model=MODEL,
        dataset=str(tokens),
        global_batch=GLOBAL_BATCH,
        seq_len=SEQ_LEN,
        steps=steps,
        precision="fp32",
        output=str(output),
        log_every=steps,
        **request,
    )
    memory = estimate(model, plan, req.workload)
    gpus = list(range(plan.gpus))
    allocation = Allocation(
        gpu_type="A10",
        plan=plan,
        memory=memory,
        gpu_memory_bytes=2**34,
        step_time_s=1.0,
        placements=[Placement(node="n0", host="127.0.0.1", gpus=gpus)],
    )
    cluster = ClusterSpec(nodes=[{"name": "n0", "host": "127.0.0.1", "gpu_type": "A10", "gpu_count": len(gpus)}])
    dataset = profile_dataset(str(tokens), SEQ_LEN, model.vocab_size)
    return TrainingJob(request=req, model=model, dataset=dataset, allocation=allocation, cluster=cluster, output=str(output))


def rank_processes() -> list[tuple[psutil.Process, int, bool]]:
    """(process, rank, under a supervisor) of this job's live rank processes: torchrun's, and
    under recycle the supervisors' trainers (an incarnation each)."""
    from frenzy_prefect.training.resilient.liveness import INCARNATION_ENV

    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            command, env = " ".join(p.cmdline()), p.environ()
            if "training.entry" in command and "launch.agent" not in command and "RANK" in env and p.status() != psutil.STATUS_ZOMBIE:
                found.append((p, int(env["RANK"]), INCARNATION_ENV in env))
        except psutil.Error:
            continue
    return found


def trainer_of(rank: int, recycle: bool) -> psutil.Process | None:
    """The newest live trainer of ``rank``: under recycle the supervisor's child (an incarnation),
    under restart the process torchrun started."""
    found = [p for p, r, supervised in rank_processes() if r == rank and supervised == recycle]
    return max(found, key=lambda p: p.create_time(), default=None)


class CpuCaps:
    """Each rank's processes in a cgroup of its own capped at ``cpus`` CPUs (the cgroup v1 cpu
    controller; needs root): a rank is then a worker of fixed speed, as a GPU is, so a dead rank's
    CPU time does not speed the survivors up, nor a dropped pipeline's the other. Processes are
    moved when first seen (the observer's 50 ms polls); their children inherit the cgroup."""

    ROOT = Path("/sys/fs/cgroup/cpu")

    def __init__(self, cpus: float, ranks: int) -> None:
        if not (self.ROOT / "cpu.cfs_quota_us").exists():
            raise SystemExit(f"--cpu-per-rank needs the cgroup v1 cpu controller at {self.ROOT}")
        self.groups = [self.ROOT / f"frenzy-recycle-live-{os.getpid()}-rank{r}" for r in range(ranks)]
        for group in self.groups:
            group.mkdir(exist_ok=True)
            period = int((group / "cpu.cfs_period_us").read_text())
            (group / "cpu.cfs_quota_us").write_text(str(round(cpus * period)))
        self.placed: set[int] = set()

    def place(self) -> None:
        for process, rank, _ in rank_processes():
            if process.pid not in self.placed:
                try:
                    (self.groups[rank] / "cgroup.procs").write_text(str(process.pid))
                except OSError:
                    continue  # gone meanwhile
                self.placed.add(process.pid)

    def close(self) -> None:
        for group in self.groups:
            group.rmdir()  # every process in it has ended (a leftover one would make this fail, as it should)


class Observer(threading.Thread):
    """Watches the job's checkpoints (when each became the latest) and kills on the schedule,
    counted from the first checkpoint."""

    def __init__(self, job, schedule: list[tuple[float, int]], recycle: bool, caps: CpuCaps | None) -> None:
        super().__init__(daemon=True)
        self.job, self.schedule, self.recycle, self.caps = job, list(schedule), recycle, caps
        self.t0: float | None = None
        self.checkpoints: list[tuple[float, int]] = []  # (time, step) when it became the latest
        self.kills: list[dict] = []
        self.done = threading.Event()

    def run(self) -> None:
        from frenzy_prefect.training.manifest import complete_checkpoints, step_of
        from frenzy_prefect.training.resilient.liveness import INCARNATION_ENV

        pending = list(self.schedule)
        while not self.done.is_set():
            if self.caps:
                self.caps.place()
            found = complete_checkpoints(self.job.checkpoint_uri)
            now = time.time()
            step = step_of(found[-1]) if found else None
            if step is not None and (not self.checkpoints or self.checkpoints[-1][1] != step):
                self.checkpoints.append((now, step))
                self.t0 = self.t0 or now
            if self.t0 is not None and pending and now >= self.t0 + pending[0][0]:
                offset, rank = pending.pop(0)
                victim = trainer_of(rank, self.recycle)
                if victim is None:
                    raise RuntimeError(f"no trainer of rank {rank} to kill at +{offset} s")
                incarnation = victim.environ().get(INCARNATION_ENV)
                victim.send_signal(signal.SIGKILL)
                self.kills.append({"offset_s": offset, "rank": rank, "incarnation": incarnation, "at": time.time(), "pid": victim.pid})
            time.sleep(0.05)


@contextmanager
def output_to(log: Path) -> Iterator[None]:
    """This process's stdout and stderr, which the ranks inherit, into ``log``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(log, "wb") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def run_job(job, schedule: list[tuple[float, int]], log: Path, cpu_per_rank: float | None) -> dict:
    """Launch ``job`` with torchrun on this machine (its output in ``log``), killing on
    ``schedule``; its metrics and the observations."""
    from frenzy_prefect.launch.local import start_local
    from frenzy_prefect.launch.torchrun import rank_launches
    from frenzy_prefect.storage import open_uri

    caps = CpuCaps(cpu_per_rank, job.allocation.plan.gpus) if cpu_per_rank else None
    observer = Observer(job, schedule, job.request.resilience == "recycle", caps)
    observer.start()

    async def launch() -> int:
        group = await start_local(rank_launches(job, python=sys.executable, env=dict(os.environ, PYTHONPATH=str(ROOT))))
        return await group.wait()

    began = time.time()
    try:
        with output_to(log):
            code = asyncio.run(launch())
    finally:
        observer.done.set()
        observer.join()
        if caps:
            caps.close()
    if code != 0:
        raise RuntimeError(f"{job.output}: the job failed (exit {code}); its output ends:\n{log.read_text()[-3000:]}")
    if len(observer.kills) != len(schedule):
        raise RuntimeError(f"{job.output}: {len(observer.kills)} of {len(schedule)} kills happened (the run was shorter than the schedule)")
    with open_uri(job.metrics_uri, "r") as f:
        metrics = json.load(f)
    end = Path(job.metrics_uri).stat().st_mtime
    t0 = observer.t0
    samples = (job.request.steps - 1) * GLOBAL_BATCH
    return {
        "metrics": metrics,
        "launch_s": time.time() - began,
        "t0": t0,
        "window_s": end - t0,
        "samples_per_s": samples / (end - t0),
        "checkpoints": [(t - t0, s) for t, s in observer.checkpoints],
        "kills": observer.kills,
        "step_s": statistics.mean(metrics["step_s"][1:]),  # the writing rank's, the first (warm-up) step excepted
    }


def _at(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def recycle_phases(run: dict) -> dict:
    """Rank 0's step times by phase, and each failure's and rejoin's measured times. A failure
    record goes with the last kill of its rank before it and the first rejoin of its rank after
    it (rank 0 began to recover after it); a kill with no failure record of its own hit a
    replacement still waiting to be admitted."""
    metrics, kills = run["metrics"], run["kills"]
    step_s = metrics["step_s"]  # rank 0, never killed: every step 1..N
    records = metrics["failures"]
    degraded, special, events, matched = set(), {1}, [], set()
    for i, f in enumerate(records):
        if f["kind"] != "failed":
            continue
        detected = _at(f["at"]) - f["downtime_s"]  # (rank 0 began to recover)
        kill = max((k for k in kills if k["rank"] in f["ranks"] and k["at"] < detected), key=lambda k: k["at"])
        matched.add(id(kill))
        r = next((r for r in records[i + 1 :] if r["kind"] == "rejoined" and set(r["ranks"]) == set(f["ranks"])), None)
        back = r["step"] if r else len(step_s) + 1
        degraded |= set(range(f["step"] + 1, back))
        special |= {f["step"], back}
        events.append(
            {
                "rank": kill["rank"],
                "offset_s": kill["offset_s"],
                "detected_and_reformed_s": _at(f["at"]) - kill["at"],  # kill -> the survivors re-formed (rank 0)
                "reform_s": f["downtime_s"],
                "interrupted_step": f["step"],
                "interrupted_step_s": step_s[f["step"] - 1],
                "admitted_after_s": _at(r["at"]) - r["downtime_s"] - kill["at"] if r else None,
                "rejoin_pause_s": r["downtime_s"] if r else None,
                "degraded_steps": back - f["step"] - 1,
            }
        )
    fault_free = [s for i, s in enumerate(step_s, start=1) if i not in degraded | special]
    return {
        "fault_free_step_s": statistics.mean(fault_free),
        "rerouted_step_s": statistics.mean(step_s[i - 1] for i in degraded),
        "rerouted_steps": len(degraded),
        "events": events,
        "kills_of_waiting_replacements": [k["offset_s"] for k in kills if id(k) not in matched],
    }


def restart_times(run: dict) -> list[float]:
    """Per kill: kill -> the restarted ranks' first checkpoint (after their first step)."""
    out = []
    for kill in run["kills"]:
        killed = kill["at"] - run["t0"]
        out.append(next(t for t, _ in run["checkpoints"] if t > killed) - killed)
    return out


def fault_free_pace(run: dict) -> dict:
    """This run's fault-free pace from its checkpoint timeline (the only record a restarted run
    leaves of its earlier attempts): between consecutive checkpoints with no kill between them,
    seconds per step (the checkpoint's own time, rank 0's mean, taken off), seconds between
    checkpoints and a checkpoint's seconds."""
    kills = [k["at"] - run["t0"] for k in run["kills"]]
    pairs = [
        (b[0] - a[0], b[1] - a[1])
        for a, b in zip(run["checkpoints"], run["checkpoints"][1:], strict=False)
        if b[1] > a[1] and not any(a[0] < k <= b[0] for k in kills)
    ]
    write_s = statistics.mean(run["metrics"]["checkpoint_s"])
    seconds, steps = sum(t for t, _ in pairs), sum(n for _, n in pairs)
    return {
        "step_s": (seconds - len(pairs) * write_s) / steps,
        "checkpoint_interval_s": seconds / len(pairs),
        "checkpoint_write_s": write_s,
    }


def simulate(trace: Path, table: Path, policy: str, horizon_s: float, knobs: dict[str, float]) -> tuple[list[str], dict]:
    """``frenzy recycle simulate`` as a user runs it; (its command, its JSON)."""
    command = ["frenzy", "recycle", "simulate", "--trace", str(trace), "--dp", str(DP), "--pp", str(PP)]
    command += ["--microbatches", str(MICROBATCHES), "--step-time-table", str(table), "--samples-per-step", str(GLOBAL_BATCH)]
    command += ["--policy", policy, "--horizon-s", f"{horizon_s:.3f}"]
    for name, value in knobs.items():
        command += ["--knob", f"{name}={value:.3f}"]
    done = subprocess.run(
        [sys.executable, "-m", "frenzy_prefect.cli", *command[1:], "--json"],
        capture_output=True,
        text=True,
        check=True,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    return command, json.loads(done.stdout)


def planner_fraction(fault_free_s: float, rerouted_s: float, failed_stages: list[int]) -> dict:
    """The planner's throughput for the adapted schedule (`frenzy recycle plan`) against the
    re-routed steps measured."""
    from frenzy_prefect.recycle.case_summary import plan_case

    predicted = statistics.mean(plan_case(DP, PP, MICROBATCHES, [s], step_s=fault_free_s)["iteration_s"] for s in failed_stages)
    return {
        "planner_rerouted_step_s": predicted,
        "planner_relative_throughput": fault_free_s / predicted,
        "fraction": predicted / rerouted_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one kill, short runs: a check that it works, not a measurement")
    parser.add_argument("--steps", type=int, default=None, help="steps of the runs with failures (default 400; --quick 120)")
    parser.add_argument("--mtbf-s", type=float, default=None, help="per-node MTBF of the failure trace (default 240 s; --quick 60 s)")
    parser.add_argument("--kills", type=int, default=None, help="failures in the schedule (default 3; --quick 1)")
    parser.add_argument(
        "--checkpoint-every", type=int, default=None, help="steps between checkpoints (default: the product's, within 5%% of training time)"
    )
    parser.add_argument(
        "--cpu-per-rank",
        type=float,
        default=None,
        help="cap each rank at this many CPUs (a cgroup per rank; root): workers of fixed speed, as GPUs are; default: uncapped",
    )
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/results/recycle_live.json (--quick: not written)")
    args = parser.parse_args()
    steps = args.steps or (120 if args.quick else 400)
    kills = args.kills or (1 if args.quick else 3)
    mtbf = args.mtbf_s or (60.0 if args.quick else 240.0)
    # kills fall between 15 s and ~3/4 of the recycle run (~0.45 s a step here), so every one of
    # them happens, and its replacement rejoins, in every policy's run
    seed, schedule = kill_schedule(mtbf, (15.0, max(20.0, 0.33 * steps)), kills)
    baseline_steps, drop_steps = (0, 12) if args.quick else (60, 30)

    with tempfile.TemporaryDirectory(prefix="frenzy-recycle-live-") as home:
        home = Path(home)
        tokens = home / "tokens.bin"
        np.random.default_rng(0).integers(0, 256, 4_000_000).astype(np.uint16).tofile(tokens)
        runs = {}
        for name, dp, n, request, kill in [
            ("fault-free recycle", DP, baseline_steps, {"resilience": "recycle"}, []),
            ("fault-free restart", DP, baseline_steps, {}, []),
            # (replan_after_s None: re-routing until each replacement rejoins, as the simulator's recycle policy)
            ("recycle", DP, steps, {"resilience": "recycle", "max_replacements": kills, "replan_after_s": None}, schedule),
            ("restart", DP, steps, {"max_restarts": kills}, schedule),
            ("dp=1 x pp=2", 1, drop_steps, {}, []),
        ]:
            if not n:
                continue
            print(f"running {name}: {n} steps, kills (s after the first checkpoint, rank) {kill} ...", flush=True)
            label = name.replace(" ", "-").replace("=", "")
            request["checkpoint_every"] = args.checkpoint_every
            runs[name] = run_job(make_job(tokens, home / label, dp, n, **request), kill, home / f"{label}.log", args.cpu_per_rank)
        out = args.json or (None if args.quick else Path("benchmarks/results/recycle_live.json"))
        if out:  # what was observed, before any analysis can fail
            write_result({"schedule": schedule, "seed": seed, "runs": runs}, out.with_suffix(".runs.json"))
        settings = {"cpu_per_rank": args.cpu_per_rank, "checkpoint_every": args.checkpoint_every}
        result = analyse(runs, seed, schedule, mtbf, steps, home) | settings
    report(result)
    if out:
        write_result(result, out)


def write_trace(path: Path, schedule: list[tuple[float, int]]) -> None:
    """The schedule as the simulator reads it: each killed rank's node removed, and its
    replacement added, at the kill (the simulator's ``join_delay_s`` is the replacement's start)."""
    lines = [f"0,add,node{k}" for k in range(1, DP * PP + 1)]
    for offset, rank in schedule:
        lines += [f"{round(offset * 1000)},remove,{node_of(rank)}", f"{round(offset * 1000)},add,{node_of(rank)}"]
    path.write_text("\n".join(lines) + "\n")


def policy_inputs(runs: dict) -> dict[str, tuple[dict | None, dict, dict]]:
    """Per simulated policy: (the live run it predicts, step-time table, knobs), every time
    measured in the run it predicts (a shared machine's load drifts between runs)."""
    recycle, restart = runs["recycle"], runs["restart"]
    phases, drop_step = recycle["phases"], runs["dp=1 x pp=2"]["step_s"]
    events = phases["events"]
    cycle = fault_free_pace(recycle)
    pace = fault_free_pace(restart)
    restarts = [s - pace["step_s"] - pace["checkpoint_write_s"] for s in restart_times(restart)]
    detection = statistics.mean(e["detected_and_reformed_s"] for e in events)
    admitted = statistics.mean(e["admitted_after_s"] for e in events if e["admitted_after_s"] is not None)
    rejoin = statistics.mean(e["rejoin_pause_s"] for e in events if e["rejoin_pause_s"] is not None)
    checkpoints = {k: cycle[k] for k in ("checkpoint_interval_s", "checkpoint_write_s")}
    return {
        "recycle": (
            recycle,
            {4: phases["fault_free_step_s"], 3: phases["rerouted_step_s"]},
            {"detection_s": detection, "join_delay_s": admitted - phases["rerouted_step_s"] / 2, "state_copy_s": rejoin, **checkpoints},
        ),
        "checkpoint_restart": (
            restart,
            {4: pace["step_s"]},  # (torchrun restarts on the whole grid: no smaller one to choose)
            # torchrun restarts the killed rank with the others: its start is in restart_s
            {"restart_s": statistics.mean(restarts), "join_delay_s": 0.0, **{k: pace[k] for k in checkpoints}},
        ),
        "drop_pipeline": (  # not live: recycle's run's fault-free pace and pauses, the dp=1 x pp=2 run's step
            None,
            {4: phases["fault_free_step_s"], 2: drop_step},
            {"detection_s": detection, "join_delay_s": admitted - drop_step / 2, "drop_reform_s": rejoin, **checkpoints},
        ),
    }


def analyse(runs: dict, seed: int, schedule: list, mtbf: float, steps: int, home: Path) -> dict:
    trace = home / "trace.csv"
    write_trace(trace, schedule)
    runs["recycle"]["phases"] = phases = recycle_phases(runs["recycle"])
    sims = {}
    for policy, (live, table, knobs) in policy_inputs(runs).items():
        table_path = home / f"{policy}-table.json"
        table_path.write_text(json.dumps({str(k): v for k, v in table.items()}))
        horizon = (live or runs["recycle"])["window_s"]
        command, out = simulate(trace, table_path, policy, horizon, knobs)
        sims[policy] = {
            "live_samples_per_s": live["samples_per_s"] if live else None,
            "simulated_samples_per_s": out["throughput"],
            "ratio_simulated_to_live": out["throughput"] / live["samples_per_s"] if live else None,
            "horizon_s": horizon,
            "step_time_table": table,
            "knobs": knobs,
            "command": " ".join(command),
            "events": [{k: e[k] for k in ("time_s", "kind", "iteration_s", "downtime_s", "lost_samples")} for e in out["events"]],
        }
    restart = runs["restart"]
    simulated = {p: sims[p]["simulated_samples_per_s"] for p in sims}
    return {
        "machine": f"{os.cpu_count()} CPU cores (shared), gloo, torch {__import__('torch').__version__}",
        "job": {"model": MODEL, "dp": DP, "pp": PP, "global_batch": GLOBAL_BATCH, "micro_batch": MICRO_BATCH, "seq_len": SEQ_LEN},
        "microbatches": MICROBATCHES,
        "steps": steps,
        "trace": {"kind": "transient_trace", "nodes": DP * PP, "mtbf_s": mtbf, "repair_s": 0, "seed": seed, "csv": trace.read_text()},
        "schedule": [{"offset_s": o, "rank": r, "stage": r // DP} for o, r in schedule],
        "fault_free_runs": {
            name: {k: runs[name][k] for k in ("samples_per_s", "step_s")} for name in runs if name.startswith("fault-free")
        },
        "dp1_pp2_step_s": runs["dp=1 x pp=2"]["step_s"],
        "recycle": {
            **phases,
            "pace_from_checkpoints": fault_free_pace(runs["recycle"]),
            "window_s": runs["recycle"]["window_s"],
            "samples_per_s": runs["recycle"]["samples_per_s"],
        },
        "restart": {
            "kill_to_next_checkpoint_s": restart_times(restart),
            "pace_from_checkpoints": fault_free_pace(restart),
            "window_s": restart["window_s"],
            "samples_per_s": restart["samples_per_s"],
        },
        "planner": planner_fraction(phases["fault_free_step_s"], phases["rerouted_step_s"], [r // DP for _, r in schedule]),
        "policies": sims,
        "recycle_over_restart_live": runs["recycle"]["samples_per_s"] / restart["samples_per_s"],
        "recycle_over_restart_simulated": simulated["recycle"] / simulated["checkpoint_restart"],
        "drop_pipeline_is_live": False,
    }


def report(r: dict) -> None:
    job, cycle, restart = r["job"], r["recycle"], r["restart"]
    print(
        f"\n{job['model']} dp={job['dp']} x pp={job['pp']}, global batch {job['global_batch']} x {job['seq_len']} "
        f"({r['microbatches']} micro-batches/pipeline), {r['steps']} steps on {r['machine']}"
        + (f", each rank capped at {r['cpu_per_rank']:g} CPU" if r.get("cpu_per_rank") else ", ranks uncapped")
    )
    kills = ", ".join(f"+{k['offset_s']:g} s: rank {k['rank']}" for k in r["schedule"])
    print(f"kills (after the first checkpoint): {kills}")
    print(
        f"recycle run: fault-free step {cycle['fault_free_step_s']:.3f} s, re-routed (3 workers) {cycle['rerouted_step_s']:.3f} s "
        f"over {cycle['rerouted_steps']} steps; restart run: {restart['pace_from_checkpoints']['step_s']:.3f} s; "
        f"dp=1 x pp=2: {r['dp1_pp2_step_s']:.3f} s"
    )
    for e in cycle["events"]:
        rejoin = (
            f"replacement admitted after {e['admitted_after_s']:.1f} s, rejoin pause {e['rejoin_pause_s']:.2f} s"
            if e["admitted_after_s"] is not None
            else "no replacement rejoined"
        )
        print(
            f"  recycle, rank {e['rank']} killed at +{e['offset_s']:g} s: survivors re-formed {e['detected_and_reformed_s']:.2f} s "
            f"later (rank 0's re-form {e['reform_s']:.3f} s), interrupted step {e['interrupted_step_s']:.2f} s, {rejoin}"
        )
    for offset in cycle["kills_of_waiting_replacements"]:
        print(f"  recycle, the kill at +{offset:g} s hit a replacement still waiting to be admitted (no failure for the members)")
    print(f"  restart: kill -> first checkpoint after the restart {', '.join(f'{s:.1f} s' for s in restart['kill_to_next_checkpoint_s'])}")
    p = r["planner"]
    print(
        f"planner: re-routed step {p['planner_rerouted_step_s']:.3f} s ({p['planner_relative_throughput']:.1%} of fault-free); "
        f"the measured one reaches {p['fraction']:.1%} of the planner's throughput (target >= 90%)"
    )
    print(f"\n{'policy':<22}{'live samples/s':>15}{'simulated':>11}{'sim/live':>10}")
    for name, s in r["policies"].items():
        live = f"{s['live_samples_per_s']:.1f}" if s["live_samples_per_s"] else "(not live)"
        ratio = f"{s['ratio_simulated_to_live']:.3f}" if s["ratio_simulated_to_live"] else "-"
        print(f"{name:<22}{live:>15}{s['simulated_samples_per_s']:>11.1f}{ratio:>10}")
    for name, f in r["fault_free_runs"].items():
        print(f"{name:<22}{f['samples_per_s']:>15.1f}   (step {f['step_s']:.3f} s, a separate run)")
    print(
        f"recycle / restart: live {r['recycle_over_restart_live']:.2f}x, simulated {r['recycle_over_restart_simulated']:.2f}x "
        "(target >= 1.3x)"
    )
    print("drop-the-pipeline is not a live mode: simulated from recycle's run (pace, pauses) and a live dp=1 x pp=2 run's step")


if __name__ == "__main__":
    main()
