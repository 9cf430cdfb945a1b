"""Sharded checkpoints and resume (issue 15, parts 3 and 4), on real gloo ranks and the moto S3
endpoint: a resumed run continues the uninterrupted one's loss curve, on the same plan or another
(dp=2 -> 1, pp=2 -> 1); a rank killed mid-write leaves the previous checkpoint usable; with
max_restarts, torchrun restarts the ranks after a rank dies and they resume from the last one."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import sys
import threading
import time

import psutil
import pytest
import torch

from frenzy_prefect.profiling.dataset import profile_dataset
from frenzy_prefect.spec.plan import ParallelPlan, Placement, TrainingJob
from frenzy_prefect.storage import filesystem, open_uri, read_versioned, write_bytes
from frenzy_prefect.training import checkpoint
from frenzy_prefect.training.distributed import DistributedContext, free_port
from frenzy_prefect.training.engine import Engine
from frenzy_prefect.training.fence import ATTEMPT_ENV, POLL_ENV, claim
from frenzy_prefect.training.manifest import (
    MANIFEST,
    committed_checkpoints,
    complete_checkpoints,
    generation_of,
    head_uri,
    latest,
    read_head,
    step_of,
    step_uri,
)
from frenzy_prefect.training.trainer import resume, train
from tests.support.resume import _whole_weights, assert_resumed_after, files_of
from tests.support.stack import BUCKET
from tests.support.training import NANO, launch, make_job

pytestmark = pytest.mark.resume

ONE_NODE = [Placement(node="n0", host="127.0.0.1", gpus=[0, 1])]


LONE = [Placement(node="n0", host="127.0.0.1", gpus=[0])]


DP2 = ParallelPlan(dp=2, micro_batch=4)


RUN = {"steps": 9, "checkpoint_every": 3}


def job_of(dataset: str, name: str, plan: ParallelPlan, placements=ONE_NODE, **request) -> TrainingJob:
    return make_job(profile_dataset(dataset, 64, NANO.vocab_size), f"s3://{BUCKET}/runs/{name}", plan, placements, **(RUN | request))


def losses_of(job: TrainingJob) -> list[float]:
    with open_uri(job.metrics_uri, "r") as f:
        return json.load(f)["losses"]


def tear(uri: str) -> None:
    """Leave ``uri`` as a crash during its write would: shards, no manifest."""
    fs, path = filesystem(f"{uri}/{MANIFEST}")
    fs.rm(path)


@pytest.fixture(scope="module")
def reference(dataset) -> tuple[TrainingJob, list[float]]:
    """An uninterrupted dp=2 run, checkpointed at steps 3, 6 and 9."""
    job = job_of(dataset, "resume-reference", DP2, keep_checkpoints=3)
    assert launch(job)[0] == 0
    return job, losses_of(job)


def test_a_resumed_run_reaches_the_uninterrupted_runs_losses_step_for_step(dataset, reference):
    ref_job, ref = reference
    job = job_of(dataset, "resume-same-plan", DP2, keep_checkpoints=3)
    assert launch(job)[0] == 0
    third, sixth, ninth = (step_uri(job.checkpoint_uri, s) for s in (3, 6, 9))
    assert complete_checkpoints(job.checkpoint_uri) == [third, sixth, ninth]
    tear(sixth)
    tear(ninth)
    kept = files_of(third)

    assert launch(job)[0] == 0  # the same run again, as a Prefect retry starts it: generation 2
    assert_resumed_after(job, 3, kept)
    again = [step_uri(job.checkpoint_uri, s, 2) for s in (6, 9)]
    assert complete_checkpoints(job.checkpoint_uri) == [third, *again]  # the torn ones pruned
    assert committed_checkpoints(job.checkpoint_uri) == [*again[::-1], third]
    assert losses_of(job) == ref  # the same plan and data: bit for bit


def test_deepspeeds_zero2_resumes_its_partitions_of_the_weights_and_adam_states(dataset):
    # Loading scatters each whole tensor into DeepSpeed's fp32 partitions: a wrong or missing
    # scatter (weights, exp_avg, exp_avg_sq or the step count) changes every later loss.
    job = job_of(dataset, "resume-zero2", ParallelPlan(dp=2, micro_batch=4, zero=2), keep_checkpoints=3)
    assert launch(job)[0] == 0
    uninterrupted = losses_of(job)
    tear(step_uri(job.checkpoint_uri, 6))
    tear(step_uri(job.checkpoint_uri, 9))
    kept = files_of(step_uri(job.checkpoint_uri, 3))
    assert launch(job)[0] == 0
    assert_resumed_after(job, 3, kept)
    assert losses_of(job) == pytest.approx(uninterrupted, rel=1e-6)


def _copy_run(source: TrainingJob, step: int, to: TrainingJob) -> None:
    """Give ``to`` ``source``'s checkpoint of ``step``, as if the same run resumed on another plan."""
    fs, src = filesystem(step_uri(source.checkpoint_uri, step))
    _, dst = filesystem(step_uri(to.checkpoint_uri, step))
    fs.copy(src, dst, recursive=True)


@pytest.mark.parametrize(
    "source_plan, target_plan",
    [
        (DP2, ParallelPlan(micro_batch=4)),
        (ParallelPlan(pp=2, micro_batch=4), ParallelPlan(micro_batch=8)),
        (ParallelPlan(pp=2, micro_batch=4, stage_layers=(3, 1)), ParallelPlan(micro_batch=8)),
        (ParallelPlan(tp=2, micro_batch=4), ParallelPlan(micro_batch=4)),
        (ParallelPlan(dp=2, micro_batch=4, zero=2), ParallelPlan(micro_batch=4)),
    ],
    ids=["dp2-to-dp1", "pp2-to-pp1", "uneven-pp2-to-pp1", "tp2-to-tp1", "zero2-to-dp1"],
)
def test_a_checkpoint_resumes_on_another_plan_with_the_same_weights_and_loss_curve(dataset, reference, source_plan, target_plan, request):
    name = "resharded-" + request.node.callspec.id
    if source_plan == DP2:
        source, ref = reference
    else:
        source = job_of(dataset, name + "-source", source_plan, keep_checkpoints=3)
        assert launch(source)[0] == 0
        ref = losses_of(source)
    target = job_of(dataset, name, target_plan, placements=LONE)
    _copy_run(source, 3, target)

    # The weights after load are the checkpoint's, whole.
    uri = step_uri(target.checkpoint_uri, 3)
    engine = Engine(NANO, target_plan, target.request.workload)
    checkpoint.load(engine, uri, latest(target.checkpoint_uri)[1])
    whole = _whole_weights(uri)
    loaded = engine.state_dict()
    assert set(loaded) - set(whole) <= {"head.weight"}  # a tied head is saved once, as the embedding
    for name_, t in loaded.items():
        assert torch.equal(t, whole.get(name_, whole["tok_emb.weight"])), name_

    result = train(target, DistributedContext())
    assert result.losses[:3] == ref[:3]  # from the manifest
    # fp32 reductions in another order: close, not equal
    assert result.losses[3:] == pytest.approx(ref[3:], rel=1e-4), (result.losses, ref)


def _train_rank(rank: int, port: int, job_json: str, env: dict, log_file: str | None) -> None:
    os.environ.update(env | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)

    def log(line: str) -> None:  # rank 0's: what the run's logger hears
        if rank == 0 and log_file:
            with open(log_file, "a") as f:
                f.write(line + "\n")

    train(TrainingJob.model_validate_json(job_json), DistributedContext(rank=rank, world_size=2), log=log)


def _start_ranks(job: TrainingJob, log_file: str | None = None) -> list[multiprocessing.Process]:
    spawn, port = multiprocessing.get_context("spawn"), free_port()
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    ranks = [spawn.Process(target=_train_rank, args=(r, port, job.model_dump_json(), env, log_file)) for r in (0, 1)]
    for p in ranks:
        p.start()
    return ranks


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _objects_under(uri: str) -> list[str]:
    fs, path = filesystem(uri)
    fs.invalidate_cache()
    return fs.find(path)


@pytest.mark.faults
def test_a_rank_killed_mid_write_leaves_the_previous_checkpoint_usable_and_the_torn_one_ignored(dataset, reference):
    _, ref = reference
    job = job_of(dataset, "torn", DP2, keep_checkpoints=3)  # step 3's kept, to be checked untouched
    third, sixth = step_uri(job.checkpoint_uri, 3), step_uri(job.checkpoint_uri, 6)
    ranks = _start_ranks(job)
    try:
        # The first of step 6's files has landed: its manifest can only follow every rank's files.
        _wait_for(lambda: any(".distcp" in o or ".metadata" in o for o in _objects_under(sixth)), 180, "step 6 never began")
        os.kill(ranks[1].pid, signal.SIGKILL)
    finally:
        for p in ranks:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert ranks[1].exitcode == -signal.SIGKILL
    assert complete_checkpoints(job.checkpoint_uri) == [third]  # the torn step 6: no manifest
    assert _objects_under(sixth), "nothing of step 6 was written"
    kept = files_of(third)

    ranks = _start_ranks(job)  # the run again: from step 3
    for p in ranks:
        p.join(timeout=180)
    assert [p.exitcode for p in ranks] == [0, 0]
    assert_resumed_after(job, 3, kept)
    assert losses_of(job) == ref
    assert complete_checkpoints(job.checkpoint_uri) == [third, step_uri(job.checkpoint_uri, 6, 2), step_uri(job.checkpoint_uri, 9, 2)]


def _half_written(uri: str) -> None:
    """Leave the manifest at ``uri`` cut in half, as a storage fault or a copy gone wrong would."""
    with open_uri(uri) as f:
        raw = f.read()
    write_bytes(uri, raw[: len(raw) // 2])


def test_a_corrupt_newest_manifest_is_named_in_the_log_and_the_run_resumes_from_the_checkpoint_before(dataset, reference, tmp_path):
    _, ref = reference
    job = job_of(dataset, "corrupt-manifest", DP2)  # keeps 2: steps 6 and 9
    assert launch(job)[0] == 0
    sixth, ninth = step_uri(job.checkpoint_uri, 6), step_uri(job.checkpoint_uri, 9)
    assert complete_checkpoints(job.checkpoint_uri) == [sixth, ninth]
    _half_written(f"{ninth}/{MANIFEST}")
    kept = files_of(sixth)

    log = tmp_path / "rank-0.log"
    ranks = _start_ranks(job, str(log))  # the run again, as a Prefect retry starts it
    for p in ranks:
        p.join(timeout=180)
    assert [p.exitcode for p in ranks] == [0, 0]
    lines = log.read_text().splitlines()
    assert lines[0].startswith(f"warning: skipping the checkpoint at {ninth}: its manifest {ninth}/{MANIFEST} is corrupt: "), lines[:4]
    assert lines[1].startswith(f"resumed from {sixth} (step 6,"), lines[:4]
    assert lines[2] == "generation 2 takes the run over from generation 1: resuming from step 6", lines[:4]
    assert lines[3].startswith("step 7/9 loss") and lines[3].endswith("; generation 2)"), lines[:4]  # the first step trained since
    assert_resumed_after(job, 6, kept)
    assert losses_of(job) == ref
    assert latest(job.checkpoint_uri)[0] == step_uri(job.checkpoint_uri, 9, 2)  # written again, whole, by generation 2


@pytest.mark.parametrize(
    "fault",
    ["half-written manifest", "manifest of another step", "manifest lacking its losses", "no .metadata"],
)
def test_resume_and_pruning_pass_over_a_newer_corrupt_checkpoint_to_the_only_intact_one(dataset, reference, fault):
    # The reference run's checkpoints of steps 6 and 9 (3 is left out), the newest spoilt.
    source, _ = reference
    target = job_of(dataset, "spoilt-" + fault.replace(" ", "-").replace(".", ""), DP2)
    for step in (6, 9):
        _copy_run(source, step, target)
    sixth, ninth = step_uri(target.checkpoint_uri, 6), step_uri(target.checkpoint_uri, 9)
    manifest = f"{ninth}/{MANIFEST}"
    with open_uri(manifest, "r") as f:
        fields = json.load(f)
    if fault == "half-written manifest":
        _half_written(manifest)
    elif fault == "manifest of another step":
        write_bytes(manifest, json.dumps(fields | {"step": 3}).encode())
    elif fault == "manifest lacking its losses":
        write_bytes(manifest, json.dumps({k: v for k, v in fields.items() if k != "losses"}).encode())
    else:
        fs, path = filesystem(f"{ninth}/.metadata")
        fs.rm(path)

    warnings: list[str] = []
    uri, found = latest(target.checkpoint_uri, warn=warnings.append)
    assert (uri, found.step) == (sixth, 6)
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: skipping the checkpoint at {ninth}: "), warnings
    assert manifest in warnings[0] or ".metadata" in warnings[0], warnings

    # The run again: it resumes from step 6, and the corrupt step 9 counts for nothing in the
    # checkpoints its next commit keeps (2): it never displaces the only intact one.
    held = claim(target.checkpoint_uri, None)
    engine = Engine(NANO, ParallelPlan(micro_batch=8), target.request.workload)  # (DCP reshards dp=2's checkpoint)
    warnings.clear()
    resumed = resume(target, engine, warnings.append, held)
    assert resumed.step == 6 and warnings[0].startswith(f"warning: skipping the checkpoint at {ninth}: "), warnings
    seventh, _ = checkpoint.save(engine, held, 7, resumed.losses + [0.0], keep=2)
    assert committed_checkpoints(target.checkpoint_uri) == [seventh, sixth]
    assert complete_checkpoints(target.checkpoint_uri) == [sixth, seventh]  # step 9 pruned


def _agent_pids() -> list[int]:
    """This test's torchrun agents (the killed rank, a zombie until reaped, is passed over)."""
    pids = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "frenzy_prefect.launch.agent" in " ".join(p.cmdline()):
                pids.append(p.pid)
        except psutil.Error:
            pass
    return pids


def _rank_processes(agent_pids: list[int]) -> dict[int, psutil.Process]:
    ranks = {}
    for pid in agent_pids:
        try:
            for child in psutil.Process(pid).children(recursive=True):
                rank = child.environ().get("RANK")
                if rank is not None and "frenzy_prefect.training.entry" in " ".join(child.cmdline()):
                    ranks[int(rank)] = child
        except psutil.Error:
            pass
    return ranks


@pytest.mark.faults
def test_with_max_restarts_a_lost_rank_restarts_the_ranks_from_the_last_checkpoint(dataset, reference):
    _, ref = reference
    # A checkpoint after every step, so that rank 1 dies with most of the run still ahead of it
    # (checkpointing more often changes no loss).
    # Every checkpoint kept, so that the one resumed from can be checked untouched.
    job = job_of(dataset, "restarted", DP2, max_restarts=1, checkpoint_every=1, keep_checkpoints=9)
    killed: list[int] = []
    at_kill: list[tuple[int, dict[str, object]]] = []  # the newest complete checkpoint when rank 1 died, and its files

    def rank_1() -> psutil.Process | None:
        return _rank_processes(_agent_pids()).get(1)

    def kill_rank_1_after_a_checkpoint() -> None:
        _wait_for(lambda: complete_checkpoints(job.checkpoint_uri) and rank_1(), 180, "no checkpoint while rank 1 ran")
        victim = rank_1()
        killed.append(victim.pid)
        victim.send_signal(signal.SIGKILL)
        # Once torchrun has started the ranks again (and before they can have trained a step),
        # the newest complete checkpoint is the one they resume from.
        _wait_for(lambda: (r := rank_1()) is not None and r.pid != victim.pid, 180, "torchrun never restarted rank 1")
        newest = committed_checkpoints(job.checkpoint_uri)[0]
        at_kill.append((step_of(newest), files_of(newest)))

    killer = threading.Thread(target=kill_rank_1_after_a_checkpoint)
    killer.start()
    code, _ = launch(job)
    killer.join()
    assert killed and code == 0
    ((step, files),) = at_kill
    assert step < job.request.steps, "rank 1 died after the last checkpoint"
    assert_resumed_after(job, step, files)
    assert losses_of(job) == ref


def _train_attempt(rank: int, port: int, job_json: str, env: dict, folder: str) -> None:
    """One rank of an attempt, as torchrun starts it without a flow run (training.entry); rank
    0's log lines and every rank's stderr go to a file of its own in ``folder``."""
    from frenzy_prefect.training.entry import train_quietly

    os.environ.update(env | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    out = open(os.path.join(folder, f"rank-{rank}.log"), "a", buffering=1)  # (the process's own, to its end)
    sys.stderr = out

    def log(line: str) -> None:
        if rank == 0:
            out.write(line + "\n")

    train_quietly(TrainingJob.model_validate_json(job_json), DistributedContext(rank=rank, world_size=2), log=log)


def _start_attempt(job: TrainingJob, attempt: str, folder, poll_s: str = "0.2") -> list[multiprocessing.Process]:
    """The two ranks of an attempt of ``job`` (fence.ATTEMPT_ENV ``attempt``), watching the head every ``poll_s``."""
    folder.mkdir()
    spawn, port = multiprocessing.get_context("spawn"), free_port()
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")} | {ATTEMPT_ENV: attempt, POLL_ENV: poll_s}
    ranks = [spawn.Process(target=_train_attempt, args=(r, port, job.model_dump_json(), env, str(folder))) for r in (0, 1)]
    for p in ranks:
        p.start()
    return ranks


def _joined(ranks: list[multiprocessing.Process], timeout_s: float = 240) -> list[int | None]:
    for p in ranks:
        p.join(timeout=timeout_s)
        if p.is_alive():
            p.kill()
    return [p.exitcode for p in ranks]


@pytest.mark.faults
def test_a_frozen_older_generations_commit_is_refused_and_its_ranks_stop_once_a_newer_one_has_begun(dataset, reference, tmp_path):
    """Attempt 1.0 commits a checkpoint and is frozen (SIGSTOP, as a node cut off); attempt 1.1
    (the run's next submission) claims generation 2, resumes from that checkpoint and finishes.
    Thawed, the first attempt's next commit is refused by the storage (its watch is not polling)
    and its ranks stop, exit 0, with one line; and started again, it does not start."""
    _, ref = reference
    job = job_of(dataset, "fenced-commit", DP2, keep_checkpoints=3)  # the one resumed from is checked untouched
    old = _start_attempt(job, "1.0", tmp_path / "a", poll_s="3600")
    try:
        _wait_for(lambda: committed_checkpoints(job.checkpoint_uri), 180, "generation 1 committed no checkpoint")
        for p in old:
            os.kill(p.pid, signal.SIGSTOP)
        try:
            resumed = committed_checkpoints(job.checkpoint_uri)[0]
            step, kept = step_of(resumed), files_of(resumed)
            assert step < job.request.steps, "generation 1 finished before it was frozen"
            assert _joined(_start_attempt(job, "1.1", tmp_path / "b")) == [0, 0]
            assert_resumed_after(job, step, kept)
            assert losses_of(job) == ref
            head = read_versioned(head_uri(job.checkpoint_uri))
        finally:
            for p in old:
                os.kill(p.pid, signal.SIGCONT)
        assert _joined(old) == [0, 0]
    finally:
        for p in old:
            p.kill()
    lines = (tmp_path / "a" / "rank-0.log").read_text().splitlines()
    stops = [line for line in lines if line.startswith("generation 1 stops at step ")]
    assert len(stops) == 1 and lines[-1] == stops[0], lines[-5:]
    assert re.search(r": its checkpoint of step \d+ is refused: generation 2 \(attempt 1\.1\.0\) took the run over at ", stops[0]), stops
    assert read_versioned(head_uri(job.checkpoint_uri)) == head  # nothing of generation 1 committed since
    committed = read_head(job.checkpoint_uri)[0]
    assert committed.generation == 2 and all(c.generation == 2 for c in committed.committed if c.step > step), committed
    assert losses_of(job) == ref

    # Its torchrun restarting it: an older attempt than the one holding the run.
    files = _objects_under(job.checkpoint_uri)
    assert _joined(_start_attempt(job, "1.0", tmp_path / "again")) == [0, 0]
    said = (tmp_path / "again" / "rank-0.log").read_text().splitlines()
    assert said == ["attempt 1.0.0 does not start: generation 2 (attempt 1.1.0) holds the run"], said
    assert _objects_under(job.checkpoint_uri) == files and read_versioned(head_uri(job.checkpoint_uri)) == head


@pytest.mark.faults
def test_an_older_generation_stops_at_a_step_once_its_watch_sees_a_newer_one(dataset, reference, tmp_path):
    """Attempt 1.0 trains with no checkpoint due; attempt 1.1 claims the run and trains it to
    its end. The first attempt's watch (every 0.2 s) sees generation 2, and its ranks stop at
    a step's end, exit 0, with one line, having written nothing."""
    _, ref = reference
    job = job_of(dataset, "fenced-watch", DP2)
    endless = job.model_copy(update={"request": job.request.model_copy(update={"steps": 100_000, "checkpoint_every": 100_000})})
    old = _start_attempt(endless, "1.0", tmp_path / "a")
    try:
        _wait_for(lambda: "step 1/" in _text(tmp_path / "a" / "rank-0.log"), 180, "generation 1 trained no step")
        assert _joined(_start_attempt(job, "1.1", tmp_path / "b")) == [0, 0]
        assert _joined(old, timeout_s=120) == [0, 0]
    finally:
        for p in old:
            p.kill()
    lines = (tmp_path / "a" / "rank-0.log").read_text().splitlines()
    assert re.fullmatch(r"generation 1 stops at step \d+: generation 2 \(attempt 1\.1\.0\) took the run over at \d\d:\d\d:\d\dZ", lines[-1])
    assert sum(line.startswith("generation 1 stops") for line in lines) == 1, lines[-5:]
    assert "rank 1 stops" in (tmp_path / "a" / "rank-1.log").read_text()
    assert losses_of(job) == ref
    assert all(generation_of(uri) == 2 for uri in complete_checkpoints(job.checkpoint_uri))


def _text(path) -> str:
    return path.read_text() if path.exists() else ""
