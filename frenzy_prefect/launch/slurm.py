"""The Slurm launcher: a training job becomes one Slurm job, watched by a local process.

``python -m frenzy_prefect.launch.slurm SUBMISSION`` (started, guarded, by the worker like any
launched command) submits the job with ``sbatch`` and stays with it until it ends: one ``srun``
step on exactly the allocator's nodes (``--nodelist``), ``--gres=gpu:TYPE:N`` on each (a
heterogeneous job when the nodes' counts or types differ), ``--no-requeue`` (a silent requeue
hides a failure). Its stdout is the job's story for the flow run's log: the job's id, each new
pending reason, the placement Slurm made (``scontrol -d show job``: nodes and GPU indices) and
every line of the nodes' log files, prefixed with the node (a traceback condensed to a line:
watcher.CondensedOutput). It exits with the job's outcome (0
when COMPLETED), leaving the first failure's account in the launcher's failure file: the rank
that failed, or the node a NODE_FAIL lost. SIGTERM (the worker cancelling the run, or dying:
orphan_guard) ``scancel``s the job: Slurm sends the ranks SIGTERM first, then SIGKILL after
KillWait, and the watcher exits once they are gone (each node's task marks its agent's end), so
that the run's GPUs are released only then. So no Slurm job outlives the worker that watches it;
a new worker does not adopt it.
With ``max_restarts``, a job that ends NODE_FAIL is followed by a new one on a replacement for
the failed node (launch.node_restart), which resumes from the last committed checkpoint as the
run's next generation (the old job's ranks, alive on a node Slurm lost, are fenced: they stop);
the flow run stays Running meanwhile (rank 0 leaves without a final state while restarts are left).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.launch.command import Launch
from frenzy_prefect.launch.failure import read_report, write_report
from frenzy_prefect.launch.node_restart import claimed_for_restart, moved_job, moved_nodes, replacements
from frenzy_prefect.launch.slurm_inventory import SlurmNode, parse_records, read_nodes, run_cli, slurm_env
from frenzy_prefect.launch.slurm_job import SPEC_ENV, ended_marker, failure_file, node_order
from frenzy_prefect.launch.watcher import ALREADY_LOGGED, CondensedOutput
from frenzy_prefect.spec.plan import JOB_ENV, TrainingJob

# The watcher's lines that tell the worker where the job stands (the rest it only logs).
SUBMITTED, PENDING, PLACED = "Submitted Slurm job ", "Slurm job {job} pending: ", "Slurm placed job {job}: "
POLL_S = 0.5
CANCEL_SLACK_S = 5.0  # after scancel, past Slurm's KillWait (its SIGKILL), before the watcher gives up on the ranks' end
NOT_YET_SCHEDULED = "not yet looked at by Slurm's scheduler"  # what Slurm's Reason=None means for a pending job
# After a node failure, before the new job: Slurm ends the job at once but a failed node's ranks
# may live on (KillWait, a node cut off, a dead slurmd) and commit one more checkpoint, which the
# new job then resumes from. After it the run's next generation is claimed for the new job, and
# what the old ranks commit is refused (training.fence): they stop.
RESTART_GRACE_S = 10.0
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
_KEEP_OUT = {"CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "ROCR_VISIBLE_DEVICES"}  # Slurm sets them for the GPUs it gives


class SlurmSettings(BaseModel):
    """The pool's Slurm variables."""

    model_config = ConfigDict(frozen=True)

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_limit: str | None = Field(default=None, description="sbatch --time, e.g. 2:00:00 or 1-00:00:00.")
    sbatch_args: list[str] = Field(default_factory=list, description="Further sbatch options, one argument each.")
    python: str = Field(description="The interpreter with frenzy-prefect on the nodes.")
    working_dir: Path = Field(description="Where the job starts (--chdir) and its log files go: shared by the worker and the nodes.")
    slurm_conf: Path | None = None


class SlurmSubmission(BaseModel):
    model_config = ConfigDict(frozen=True)

    settings: SlurmSettings
    job_name: str
    comment: str
    nodes: list[tuple[str, PositiveInt]] = Field(min_length=1, description="The allocator's nodes, in rank order, and their GPU counts.")
    max_restarts: int = 0


def _common_options(s: SlurmSettings) -> list[str]:
    named = {"--partition": s.partition, "--account": s.account, "--qos": s.qos, "--time": s.time_limit}
    return [f"{k}={v}" for k, v in named.items() if v]


def sbatch_argv(sub: SlurmSubmission, gres_types: dict[str, str], log_dir: Path) -> list[str]:
    """``sbatch`` for the job (its script on stdin): one component per node when the nodes
    differ in GPU type or count (a heterogeneous job), else one component on all of them."""
    s = sub.settings
    head = [
        "sbatch",
        "--parsable",
        "--no-requeue",
        f"--job-name={sub.job_name}",
        f"--comment={sub.comment}",
        "--export=ALL",
        f"--chdir={s.working_dir}",
        f"--output={log_dir / 'batch.log'}",
    ]
    shapes = {(gres_types[n], c) for n, c in sub.nodes}
    if len(shapes) == 1:
        (gpu, count), names = shapes.pop(), [n for n, _ in sub.nodes]
        one = [f"--nodelist={','.join(names)}", f"--nodes={len(names)}", "--ntasks-per-node=1", f"--gres=gpu:{gpu}:{count}"]
        return [*head, *_common_options(s), *one, *s.sbatch_args]
    argv = head
    for i, (node, count) in enumerate(sub.nodes):
        argv += [":"] if i else []
        argv += [
            *_common_options(s),
            f"--nodelist={node}",
            "--nodes=1",
            "--ntasks=1",
            f"--gres=gpu:{gres_types[node]}:{count}",
            *s.sbatch_args,
        ]
    return argv


def check_nodes(sub: SlurmSubmission, found: list[SlurmNode]) -> dict[str, SlurmNode]:
    """Slurm's record of each node the job wants; FrenzyError in one line when one is unknown
    to Slurm or has fewer GPUs than the job puts on it."""
    by_name = {n.name: n for n in found}
    for node, count in sub.nodes:
        n = by_name.get(node)
        if n is None:
            raise FrenzyError(f"Slurm has no node {node!r}: name the cluster's nodes as Slurm does (frenzy cluster discover --slurm)")
        if n.gpu_type is None or n.gpus < count:
            raise FrenzyError(f"Slurm node {node} has {n.gpus} GPU(s) ({n.gpu_type or 'untyped'}); the job puts {count} there")
    return by_name


def parse_job_id(out: str) -> str:
    """``sbatch --parsable``'s ``ID`` or ``ID;CLUSTER``."""
    job_id = out.strip().split(";")[0]
    if not job_id.isdigit():
        raise FrenzyError(f"sbatch answered {out.strip()!r}, not a job id")
    return job_id


def job_state(records: list[dict[str, str]]) -> tuple[str, str]:
    """(state, reason) of a job from its components' records: a NODE_FAIL anywhere is the
    job's, else the first component's."""
    if not records:
        return "GONE", "no longer in Slurm's records"
    for r in records:
        if r.get("JobState") == "NODE_FAIL":
            return "NODE_FAIL", r.get("Reason", "")
    return records[0].get("JobState", "UNKNOWN"), records[0].get("Reason", "")


def placement(detail: str) -> list[str]:
    """``n1 gpu:a10:2(IDX:0-1)``, one per node group of ``scontrol -d show job -o`` output."""
    return [f"{nodes} {gres}" for nodes, gres in re.findall(r"\bNodes=(\S+) CPU_IDs=\S+ Mem=\S+ GRES=(\S+)", detail)]


def exit_code(state: str, records: list[dict[str, str]]) -> int:
    """0 when COMPLETED; else the batch script's exit code, 128 + the signal that killed it, or 1."""
    if state == "COMPLETED":
        return 0
    code, _, sig = (records[0].get("ExitCode", "1:0") if records else "1:0").partition(":")
    if sig.isdigit() and int(sig):
        return 128 + int(sig)
    return int(code) if code.isdigit() and int(code) else 1


class LogTail:
    """New complete lines of the log files in a directory, each prefixed with its file's name
    (the node's), less those rank 0 sent to the run's log itself, tracebacks condensed to a
    line (CondensedOutput)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._offsets: dict[Path, int] = {}
        self._condensed: dict[Path, CondensedOutput] = {}

    def lines(self) -> list[str]:
        out = []
        for path in sorted(self.directory.glob("*.log")):
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offsets[path] = self._offsets.get(path, 0) + end
            condensed = self._condensed.setdefault(path, CondensedOutput(str(path)))
            for line in data[:end].decode(errors="replace").splitlines():
                if not ALREADY_LOGGED.match(line):
                    out += [f"[{path.stem}] {said}" for said in condensed.feed(line)]
        return out


class Watcher:
    """One Slurm job from submission to its end."""

    def __init__(self, sub: SlurmSubmission) -> None:
        self.sub = sub
        self.conf = sub.settings.slurm_conf
        self.cancel_requested = False
        self.job_id = ""
        self.spec: dict = {}
        self.env = slurm_env(self.conf)  # the job's environment: the run's TrainingJob moves with a restart
        self.failed: set[str] = set()  # the nodes that failed under this run

    def say(self, line: str) -> None:
        try:
            print(line, flush=True)
        except OSError:  # the worker is gone (its end of the pipe closed): the job is being cancelled, nobody to tell
            pass

    def submit(self, log_dir: Path) -> str:
        s = self.sub.settings
        nodes = check_nodes(self.sub, read_nodes(self.conf, [n for n, _ in self.sub.nodes]))
        gres_types = {n: nodes[n].gpu_type or "" for n, _ in self.sub.nodes}
        spec = {
            "nodes": [{"name": n, "addr": nodes[n].addr, "gpus": c} for n, c in self.sub.nodes],
            "het": len({(gres_types[n], c) for n, c in self.sub.nodes}) > 1,
            "log_dir": str(log_dir),
            "python": s.python,
            "max_restarts": self.sub.max_restarts,
        }
        env = {k: v for k, v in self.env.items() if k not in _KEEP_OUT and not (k.startswith("SLURM_") and k != "SLURM_CONF")}
        env[SPEC_ENV] = json.dumps(spec)
        self.spec = spec
        script = f"#!/bin/sh\nexec {s.python} -m frenzy_prefect.launch.slurm_job batch\n"
        # --export=ALL: the job gets this environment, the run's secrets included (Slurm keeps a job's environment root-only)
        self.job_id = parse_job_id(run_cli(sbatch_argv(self.sub, gres_types, log_dir), stdin=script, env=env))
        self.say(f"{SUBMITTED}{self.job_id} ({self.sub.job_name}) on {', '.join(f'{n} x{c}' for n, c in self.sub.nodes)}")
        return self.job_id

    def records(self, detail: bool = False) -> list[dict[str, str]] | str:
        try:
            out = run_cli(["scontrol", *(["-d"] if detail else []), "-o", "show", "job", self.job_id], self.conf)
        except FrenzyError as exc:
            if "Invalid job id" in str(exc):
                return "" if detail else []
            raise
        return out if detail else parse_records(out)

    def run(self) -> int:
        """Submit the job and follow it to its end; after a node failure, with restarts left,
        again on a replacement node (launch.node_restart), until one ends otherwise."""
        while True:
            log_dir = Path(tempfile.mkdtemp(prefix=f"{self.sub.job_name}-", dir=self._log_root()))
            try:
                self.submit(log_dir)
            except FrenzyError as exc:
                self.say(f"error: {exc}")
                write_report({"command": "sbatch", "pid": os.getpid(), "ended": f"refused the job: {exc}", "exitcode": 2})
                return 2
            state, records = self.follow(log_dir)
            if not (state == "NODE_FAIL" and self.restarted_elsewhere()):
                return self.outcome(state, records, log_dir)

    def follow(self, log_dir: Path) -> tuple[str, list[dict[str, str]]]:
        """Poll the job until it ends, telling its news and its nodes' log lines. Cancelled, until
        its ranks are gone: every node's task marked ended, or Slurm shows the job ended, or
        Slurm's KillWait (after which it kills them) and CANCEL_SLACK_S have passed."""
        tail, state, said, give_up_at = LogTail(log_dir), "PENDING", "", None
        while True:
            if self.cancel_requested and give_up_at is None:
                run_cli(["scancel", self.job_id], self.conf)
                give_up_at = time.monotonic() + self.kill_wait_s() + CANCEL_SLACK_S
                self.say(f"Cancelling Slurm job {self.job_id} (scancel): SIGTERM to its ranks, SIGKILL after Slurm's KillWait")
            records = self.records()
            state, reason = job_state(records)  # type: ignore[arg-type]
            said = self._tell_news(state, reason, said)
            for line in tail.lines():
                self.say(line)
            if state in TERMINAL or state == "GONE":
                break
            if give_up_at is not None and (self.ranks_ended(log_dir) or time.monotonic() > give_up_at):
                break
            time.sleep(POLL_S)
        for line in tail.lines():
            self.say(line)
        return state, records  # type: ignore[return-value]

    def _tell_news(self, state: str, reason: str, said: str) -> str:
        """Say why the job is pending (Slurm's reason, "None" until its scheduler has looked at
        it) or where Slurm placed it, once each; what was said last."""
        news = ""
        if state == "PENDING":
            news = f"{PENDING.format(job=self.job_id)}{reason if reason not in ('', 'None') else NOT_YET_SCHEDULED}"
        elif state == "RUNNING" and not said.startswith("Slurm placed"):
            news = f"{PLACED.format(job=self.job_id)}{', '.join(placement(self.records(detail=True)))}"  # type: ignore[arg-type]
        if news and news != said:
            self.say(news)
            return news
        return said

    def ranks_ended(self, log_dir: Path) -> bool:
        """Whether every node's task has marked its ranks ended (slurm_job.ended_marker)."""
        return all(Path(ended_marker(str(log_dir), node)).exists() for node, _ in self.sub.nodes)

    def kill_wait_s(self) -> float:
        """Slurm's KillWait: how long it gives a cancelled job's processes after SIGTERM before
        SIGKILL (``scontrol show config``; 30 s, its default, where that cannot be read)."""
        try:
            found = re.search(r"^KillWait\s*=\s*(\d+)", run_cli(["scontrol", "show", "config"], self.conf), re.MULTILINE)
        except FrenzyError:
            found = None
        return float(found.group(1)) if found else 30.0

    def restarted_elsewhere(self) -> bool:
        """After a NODE_FAIL: True when the run goes on as a new job, its lost nodes replaced
        (a restart of ``max_restarts`` spent; torchrun gets the rest inside the new job)."""
        if self.cancel_requested or self.sub.max_restarts <= 0 or JOB_ENV not in self.env:
            return False
        lost = self._failed_nodes()  # now: a node set down by hand may be back within seconds
        self.failed |= set(lost)
        if not self.wait_out(RESTART_GRACE_S):
            return False
        moves = replacements(self.sub.nodes, lost, read_nodes(self.conf), self.failed)
        if moves is None:
            self.say(f"node {', '.join(lost)} failed; no other node of its GPU type takes jobs now: the run cannot restart")
            return False
        self.say(f"Slurm job {self.job_id} ended NODE_FAIL")
        job = moved_job(TrainingJob.model_validate_json(self.env[JOB_ENV]), moves)
        # The new job as the run's next generation: the lost node's ranks may live on (a dead slurmd, a cut-off node).
        self.env, resumes = claimed_for_restart(job, {**self.env, JOB_ENV: job.model_dump_json()})
        self.sub = self.sub.model_copy(update={"nodes": moved_nodes(self.sub.nodes, moves), "max_restarts": self.sub.max_restarts - 1})
        where = ", ".join(m.name for m in moves.values())
        self.say(f"node {', '.join(lost)} failed; restarting from {resumes} on {where} ({self.sub.max_restarts} restart(s) left)")
        return True

    def wait_out(self, seconds: float) -> bool:
        """Sleep ``seconds``; False as soon as the run is cancelled meanwhile."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.cancel_requested:
                return False
            time.sleep(min(POLL_S, max(0.0, end - time.monotonic())))
        return not self.cancel_requested

    def _log_root(self) -> Path:
        root = self.sub.settings.working_dir / "slurm-logs"
        root.mkdir(parents=True, exist_ok=True)
        return root

    def outcome(self, state: str, records: list[dict[str, str]], log_dir: Path) -> int:
        """The exit code, and the first failure's account in the launcher's failure file."""
        if self.cancel_requested:
            if self.ranks_ended(log_dir) or state in TERMINAL or state == "GONE":
                self.say(f"Slurm job {self.job_id} cancelled (scancel): every rank stopped")
            else:
                self.say(
                    f"Slurm job {self.job_id} cancelled (scancel): its ranks not all ended {CANCEL_SLACK_S:g} s past KillWait ({state})"
                )
            return 128 + signal.SIGTERM
        self.say(f"Slurm job {self.job_id} ended {state if state != 'GONE' else '(no longer in Slurm records)'}")
        code = exit_code(state, records)
        if code == 0:
            return 0
        if state == "NODE_FAIL":
            lost = self._failed_nodes()
            ended = f"ended NODE_FAIL: node {', '.join(lost)} failed"
            rank = self._first_rank_on(lost[0], records[0].get("BatchHost", "")) if records else None
            write_report({"command": f"Slurm job {self.job_id}", "node": ",".join(lost), "rank": rank, "ended": ended})
        elif ranks := self._rank_failures(log_dir):
            write_report(ranks[0])
        else:
            where = records[0].get("ExitCode", "?") if records else "?"
            write_report({"command": f"Slurm job {self.job_id}", "ended": f"ended {state} (exit code {where})"})
        return code

    def _first_rank_on(self, node: str, batch_host: str) -> int | None:
        """The lowest global rank on ``node`` (the ranks a lost node took with it: not rank 0's
        failure, unless the node was rank 0's)."""
        rank = 0
        for n in node_order(self.spec["nodes"], batch_host, self.spec["het"]):
            if n["name"] == node:
                return rank
            rank += n["gpus"]
        return None

    def _rank_failures(self, log_dir: Path) -> list[dict[str, object]]:
        """The agents' accounts of their failed ranks, first written first (the others were
        stopped by srun's --kill-on-bad-exit after it)."""
        files = [(Path(failure_file(str(log_dir), n)), n) for n, _ in self.sub.nodes]
        found = sorted((f.stat().st_mtime, n, f) for f, n in files if f.exists())
        return [{"node": n, **r} for _, n, f in found if (r := read_report(str(f))) is not None]

    def _failed_nodes(self) -> list[str]:
        """The job's nodes that Slurm has down or failing now."""
        nodes = read_nodes(self.conf, [n for n, _ in self.sub.nodes])
        return [n.name for n in nodes if not n.schedulable] or [n for n, _ in self.sub.nodes]


def main() -> int:
    watcher = Watcher(SlurmSubmission.model_validate_json(sys.argv[1]))

    def cancel(*_: object) -> None:
        watcher.cancel_requested = True

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, cancel)
    return watcher.run()


# The worker's side: the watcher as the run's one launched command.


def slurm_launch(sub: SlurmSubmission, env: dict[str, str], gpus: int) -> Launch:
    return Launch(
        host="127.0.0.1",
        node=f"Slurm ({', '.join(n for n, _ in sub.nodes)})",
        argv=[sys.executable, "-m", "frenzy_prefect.launch.slurm", sub.model_dump_json()],
        env=env,
        processes=gpus,
    )


if __name__ == "__main__":
    sys.exit(main())
