"""ReCycle on live ranks (issue 16): a dp=2 x pp=2 job on real gloo ranks keeps training through a
SIGKILLed (or hung) trainer without a restart, re-routing the dead worker's micro-batches to its
stage's live peer, and (when allowed) through its replacement's rejoin; the weights it ends with
equal a fault-free run's on the same data (summation order aside). A stage that loses both its
replicas restarts from its checkpoint; through the `frenzy` pool the run stays Running."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable

import psutil
import pytest
import torch

from frenzy_prefect.profiling.dataset import profile_dataset
from frenzy_prefect.spec.plan import ParallelPlan, Placement, TrainingJob
from frenzy_prefect.storage import filesystem, open_uri
from frenzy_prefect.training.manifest import committed_checkpoints, complete_checkpoints, step_of, step_uri
from frenzy_prefect.training.resilient.liveness import INCARNATION_ENV
from tests.support.ranks import is_trainer
from tests.support.resume import _whole_weights, assert_resumed_after, files_of
from tests.support.stack import BUCKET, ROOT
from tests.support.training import NANO, launch, make_job

pytestmark = [pytest.mark.recycle_live, pytest.mark.faults]  # every test kills or stops a rank

GRID = [Placement(node="n0", host="127.0.0.1", gpus=[0, 1, 2, 3])]


PLAN = ParallelPlan(dp=2, pp=2, micro_batch=2)  # global batch 16: 4 micro-batches per pipeline


# replan_after_s None: these tests prove re-routing (test_a_rank_away... the re-plan)
RUN = {"steps": 40, "checkpoint_every": 4, "keep_checkpoints": 1, "resilience": "recycle", "log_every": 1, "replan_after_s": None}


def job_of(dataset: str, name: str, **request) -> TrainingJob:
    return make_job(profile_dataset(dataset, 64, NANO.vocab_size), f"s3://{BUCKET}/runs/{name}", PLAN, GRID, **(RUN | request))


def metrics_of(job: TrainingJob) -> dict:
    with open_uri(job.metrics_uri, "r") as f:
        return json.load(f)


def is_supervisor(proc: psutil.Process, rank: int) -> bool:
    """``proc`` is ``rank``'s supervisor: the process torchrun started for it (the trainers'
    parent, without an incarnation)."""
    try:
        env, argv = proc.environ(), " ".join(proc.cmdline())
        return env.get("RANK") == str(rank) and INCARNATION_ENV not in env and "training.entry" in argv and "orphan_guard" not in argv
    except psutil.Error:
        return False


def trainer_of(rank: int, incarnation: int) -> psutil.Process | None:
    """The trainer process of ``rank``'s ``incarnation`` among this test's processes."""
    return next((p for p in psutil.Process().children(recursive=True) if is_trainer(p, rank, incarnation)), None)


def kill_when(
    ready: Callable[[], bool], rank: int, killed: list[int], how: signal.Signals = signal.SIGKILL, poll_s: float = 0.05
) -> threading.Thread:
    """A thread that sends ``how`` to ``rank``'s first trainer once ``ready()`` (asked every
    ``poll_s``) and the trainer runs."""

    def kill() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if ready() and (victim := trainer_of(rank, 0)) is not None:
                killed.append(victim.pid)
                victim.send_signal(how)
                return
            time.sleep(poll_s)

    thread = threading.Thread(target=kill)
    thread.start()
    return thread


def kill_after_first_checkpoint(job: TrainingJob, rank: int, killed: list[int], how: signal.Signals = signal.SIGKILL) -> threading.Thread:
    return kill_when(lambda: bool(complete_checkpoints(job.checkpoint_uri)), rank, killed, how)


def kill_as_a_checkpoint_begins(job: TrainingJob, rank: int, step: int, killed: list[int]) -> threading.Thread:
    """SIGKILL ``rank``'s first trainer as the first object of step ``step``'s checkpoint appears:
    the survivors are then inside the checkpoint's collectives, some further on than others."""
    fs, path = filesystem(step_uri(job.checkpoint_uri, step))

    def begun() -> bool:
        fs.invalidate_cache()
        return fs.exists(path)

    return kill_when(begun, rank, killed, poll_s=0.01)  # (a checkpoint takes ~0.3 s)


@pytest.fixture(scope="module")
def fault_free(dataset) -> tuple[list[float], dict[str, torch.Tensor]]:
    job = job_of(dataset, "recycle-fault-free")
    assert launch(job)[0] == 0
    metrics = metrics_of(job)
    return metrics["losses"], _whole_weights(metrics["checkpoint"])


def test_a_killed_rank_is_survived_without_a_restart_and_rejoins_with_the_fault_free_weights(dataset, fault_free):
    losses, weights = fault_free
    job = job_of(dataset, "recycle-rejoin", max_replacements=1)
    killed: list[int] = []
    killer = kill_after_first_checkpoint(job, 3, killed)
    code, _ = launch(job)
    killer.join()
    assert killed and code == 0
    metrics = metrics_of(job)
    assert [(f["kind"], f["ranks"]) for f in metrics["failures"]] == [("failed", [3]), ("rejoined", [3])]
    assert metrics["losses"] == pytest.approx(losses, rel=1e-5)
    assert_same_weights(_whole_weights(metrics["checkpoint"]), weights)


def assert_same_weights(survived: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> None:
    """Equal up to summation order. The absolute tolerance is for the attention's key bias, whose
    true gradient is zero (softmax ignores a constant added to every score): Adam scales its
    rounding noise up to steps of the learning rate's order, differently for another order."""
    assert survived.keys() == weights.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(survived[name], tensor, rtol=1e-5, atol=1e-5, msg=name)


def test_a_hung_trainer_is_declared_dead_by_its_heartbeat_killed_and_replaced(dataset, fault_free):
    # SIGSTOP: the process lives and its connections stay open, so no transfer fails; only its
    # heartbeat, standing still on the agent's store, tells the others.
    losses, _ = fault_free
    job = job_of(dataset, "recycle-hung", max_replacements=1)
    stopped: list[int] = []
    killer = kill_after_first_checkpoint(job, 2, stopped, signal.SIGSTOP)
    code, _ = launch(job)
    killer.join()
    assert stopped and code == 0
    assert not psutil.pid_exists(stopped[0])  # its supervisor killed it
    metrics = metrics_of(job)
    assert metrics["losses"] == pytest.approx(losses, rel=1e-5)
    assert [(f["kind"], f["ranks"]) for f in metrics["failures"]] == [("failed", [2]), ("rejoined", [2])]


def test_without_a_replacement_the_survivors_train_to_the_end_and_checkpoint_re_routed(dataset, fault_free):
    """Killed as a checkpoint begins: the coordinator's gather fails at once while other survivors
    still wait inside it (on live peers); they must not wait out the groups' timeout (ranks that
    did were left out of the survivors, and the job failed: 3 of 10 such kills)."""
    losses, weights = fault_free
    job = job_of(dataset, "recycle-no-replacement", max_replacements=0)
    killed: list[int] = []
    killer = kill_as_a_checkpoint_begins(job, 1, 8, killed)  # stage 0 of pipeline 1, at the second checkpoint
    code, _ = launch(job)
    killer.join()
    assert killed and code == 0
    metrics = metrics_of(job)
    assert [(f["kind"], f["ranks"]) for f in metrics["failures"]] == [("failed", [1])]
    assert metrics["losses"] == pytest.approx(losses, rel=1e-5)
    assert_same_weights(_whole_weights(metrics["checkpoint"]), weights)  # written by three ranks


def test_a_stage_that_loses_every_replica_restarts_from_the_last_checkpoint(dataset, fault_free):
    losses, _ = fault_free
    # Every checkpoint kept, so that the one resumed from can be checked untouched.
    job = job_of(dataset, "recycle-wipe-out", max_replacements=0, max_restarts=1, keep_checkpoints=10)
    assert_restarts_from_the_last_checkpoint(job, (2, 3), losses)  # both replicas of stage 1


def assert_restarts_from_the_last_checkpoint(job: TrainingJob, ranks: tuple[int, ...], losses: list[float]) -> None:
    """Kill ``ranks``' trainers after the first checkpoint; the job must end well, every rank
    restarted by torchrun from the newest complete checkpoint at that moment, with ``losses``."""
    killed: list[int] = []
    killers = [kill_after_first_checkpoint(job, rank, killed) for rank in ranks]
    at_restart: list[tuple[int, dict[str, object]]] = []

    def note_the_checkpoint_resumed_from() -> None:
        # Once torchrun has started the ranks again (before they can have trained a step), the
        # newest complete checkpoint is the one they resume from.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (
            len(killed) == len(ranks) and (t := trainer_of(ranks[0], 0)) is not None and t.pid not in killed
        ):
            time.sleep(0.05)
        newest = committed_checkpoints(job.checkpoint_uri)[0]
        at_restart.append((step_of(newest), files_of(newest)))

    watcher = threading.Thread(target=note_the_checkpoint_resumed_from)
    watcher.start()
    code, _ = launch(job)
    for thread in (*killers, watcher):
        thread.join()
    assert len(killed) == len(ranks) and code == 0
    ((step, files),) = at_restart
    assert_resumed_after(job, step, files)
    assert metrics_of(job)["losses"] == pytest.approx(losses, rel=1e-5)


def test_a_re_route_that_would_not_fit_runs_with_fewer_micro_batches_in_flight(dataset, fault_free):
    """The run's GPUs hold ReCycle's fault-free schedule but not the planner's re-routed one (the
    job's GPU memory set between the two predictions, as for a plan fitted with recycle_failures 0):
    when rank 3 (pipeline 1, stage 1) dies, its peer takes its micro-batches under the loosest
    in-flight bound that fits, and the run trains on without a restart, to the fault-free losses and
    weights. With less memory than one micro-batch in flight needs, the survivors would restart."""
    from frenzy_prefect.pipeline.costs import StageCosts
    from frenzy_prefect.pipeline.in_flight import schedule_peaks
    from frenzy_prefect.recycle.cache import PlanCache
    from frenzy_prefect.recycle.fits import ScheduleWouldNotFit, fitting_schedule, overflow
    from frenzy_prefect.training.measure import recycle_schedule

    losses, weights = fault_free
    job = job_of(dataset, "recycle-no-room", max_replacements=0, max_restarts=0)
    gpu, micro_batches = job.cluster.gpu_of(job.cluster.nodes[0]), PLAN.accumulation(job.request.global_batch)
    fault_free_schedule, rerouted = (recycle_schedule(PLAN, micro_batches, failed) for failed in ((), ((1, 1),)))
    need = [max(schedule_peaks(NANO, PLAN, job.request.workload, s, gpu).values()) for s in (fault_free_schedule, rerouted)]
    assert need[0] < need[1]

    def with_memory(gpu_memory_bytes: int) -> TrainingJob:
        return job.model_copy(update={"allocation": job.allocation.model_copy(update={"gpu_memory_bytes": gpu_memory_bytes})})

    def cache() -> PlanCache:
        return PlanCache(PLAN.dp, PLAN.pp, micro_batches, StageCosts.uniform(PLAN.pp), plan_on_demand=True)

    job = with_memory(sum(need) // 2)
    assert overflow(job, fault_free_schedule) is None and overflow(job, rerouted) is not None
    _, in_flight = fitting_schedule(job, cache(), {(1, 1)})
    assert in_flight is not None and in_flight < micro_batches * 2
    with pytest.raises(ScheduleWouldNotFit, match=r"would need .* even with one micro-batch in flight per worker"):
        fitting_schedule(with_memory(job.allocation.margin_bytes + 2**20), cache(), {(1, 1)})

    killed: list[int] = []
    killer = kill_after_first_checkpoint(job, 3, killed)
    code, _ = launch(job)
    killer.join()
    assert killed and code == 0  # max_restarts 0: a restart would have failed the job
    metrics = metrics_of(job)
    assert [(f["kind"], f["ranks"], f["in_flight"]) for f in metrics["failures"]] == [("failed", [3], in_flight)]
    assert metrics["losses"] == pytest.approx(losses, rel=1e-5)
    assert_same_weights(_whole_weights(metrics["checkpoint"]), weights)


def test_a_rank_away_past_the_horizon_leads_the_live_ranks_to_re_plan_smaller_and_its_return_back(dataset, fault_free):
    """Rank 3's node goes away: its trainer is killed and its supervisor stopped, so no replacement
    comes and only the agent's heartbeat watcher declares it dead. The three live ranks re-route,
    then (replan_after_s 0: at the first commit point) re-plan to dp 1 x pp 3, predicted faster,
    from a checkpoint. When a checkpoint of that plan exists the node returns (the supervisor
    continues and starts a replacement), which is absorbed as the run's own dp 2 x pp 2 resumes
    from a checkpoint. The run ends without a restart (max_restarts 0), on its own plan, with the
    fault-free run's losses and weights (summation order aside): every plan trains on the same
    global batch at each step."""
    from frenzy_prefect.training.manifest import intact_checkpoints

    losses, weights = fault_free
    job = job_of(dataset, "recycle-replan", max_replacements=1, max_restarts=0, checkpoint_every=2, replan_after_s=0)
    smaller = ParallelPlan(dp=1, pp=3, micro_batch=PLAN.micro_batch)
    stopped: list[psutil.Process] = []

    def newest_plan() -> ParallelPlan | None:
        try:
            found = next(intact_checkpoints(job.checkpoint_uri), None)
        except FileNotFoundError:  # pruned while read (keep_checkpoints 1): the next look finds the newer one
            return None
        return found[1].plan if found else None

    def away_until_replanned() -> None:
        deadline = time.monotonic() + 300
        try:
            while time.monotonic() < deadline and not stopped:
                supervisor = next((p for p in psutil.Process().children(recursive=True) if is_supervisor(p, 3)), None)
                if newest_plan() is not None and supervisor is not None and (trainer := trainer_of(3, 0)) is not None:
                    supervisor.send_signal(signal.SIGSTOP)
                    stopped.append(supervisor)
                    trainer.send_signal(signal.SIGKILL)
                time.sleep(0.05)
            while time.monotonic() < deadline and newest_plan() != smaller:
                time.sleep(0.1)
        finally:  # the node returns whatever happened here: a stopped supervisor would hold the job forever
            for supervisor in stopped:
                supervisor.send_signal(signal.SIGCONT)

    node = threading.Thread(target=away_until_replanned)
    node.start()
    try:
        code, _ = launch(job)
    finally:
        for supervisor in stopped:  # (a failed launch must not leave it stopped)
            if supervisor.is_running():
                supervisor.send_signal(signal.SIGCONT)
        node.join()
    assert stopped and code == 0
    metrics = metrics_of(job)
    changes = [(f["kind"], f["ranks"], f.get("plan")) for f in metrics["failures"]]
    assert changes == [("failed", [3], None), ("replanned", [0, 1, 2], smaller.label()), ("rejoined", [3], PLAN.label())], changes
    assert metrics["losses"] == pytest.approx(losses, rel=1e-5)
    assert newest_plan() == PLAN
    assert_same_weights(_whole_weights(metrics["checkpoint"]), weights)


def test_through_the_pool_a_train_llm_run_stays_running_through_a_killed_rank_and_reports_it(stack, worker_pool, dataset):
    """The product path: `train-llm` with resilience "recycle" on the four-GPU example cluster,
    dispatched by the `frenzy` worker; rank 3's trainer is killed after a checkpoint. The training
    flow run never leaves Running, emits frenzy.training.rank-failed/recovered/rejoined, and the
    train-llm run completes with a "failures-survived" artifact."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.deployments import run_deployment

    from frenzy_prefect.launch.local import host_and_pids
    from tests.support.ranks import rank_pid
    from tests.support.runs import GOOD, training_after_a_checkpoint, training_events, wait_final

    stack.run_cli("frenzy_prefect.cli", "cluster", "save", str(ROOT / "blocks" / "local-recycle.yaml"))
    request = GOOD | {"dataset": dataset, "steps": 40, "checkpoint_every": 5, "log_every": 1, "resilience": "recycle"}
    with stack.client_settings(), get_client(sync_client=True) as client:
        run_id = run_deployment("train-llm/frenzy", parameters={"request": request, "cluster": "local-recycle"}, timeout=0).id
        training = training_after_a_checkpoint(stack, client, run_id)
        _, (agent,) = host_and_pids(client.read_flow_run(training).infrastructure_pid)
        supervisor = psutil.Process(rank_pid(agent, 3))
        (trainer,) = [p for p in supervisor.children(recursive=True) if p.environ().get(INCARNATION_ENV) == "0"]
        trainer.send_signal(signal.SIGKILL)
        run = wait_final(run_id)
        states = [s.type.value for s in client.read_flow_run_states(training)]
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["failures-survived"])))
    assert run.state.is_completed(), run.state
    events = training_events(stack, training, until="frenzy.training.completed")
    assert states[-1] == "COMPLETED" and not {"FAILED", "CRASHED"} & set(states), states
    survived = [e for e in events if e["event"] in {"frenzy.training.rank-failed", "frenzy.training.recovered", "frenzy.training.rejoined"}]
    assert {e["event"] for e in survived} == {"frenzy.training.rank-failed", "frenzy.training.recovered", "frenzy.training.rejoined"}
    assert all(e["payload"]["ranks"] == [3] for e in survived), survived
    assert any(a.flow_run_id == run_id and "rank(s) 3 failed" in str(a.data) for a in artifacts), artifacts
