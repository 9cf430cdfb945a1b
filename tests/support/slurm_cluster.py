"""A real Slurm cluster on this machine for the `slurm` tests (the recipe of ../shared/SLURM.md):
munged, slurmctld and four slurmd (``slurmd -N NAME``, Debian builds Slurm with multiple slurmd
per host), two typed GPU kinds with two fake GPUs each (character devices under the cluster's
directory), device cgroups enforced. Ports are picked free for each test session; every daemon
is stopped by the PID in its pid file. Where Slurm or root is missing the tests skip, saying why."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

NODES = {"n1": "a10", "n2": "a10", "n3": "h100", "n4": "h100"}  # node -> GPU type (Slurm's names)
GPUS_PER_NODE = 2
START_TIMEOUT_S = 60.0
DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")


def missing() -> str | None:
    """Why a Slurm cluster cannot be started here, or None."""
    absent = [d for d in (*DAEMONS, shutil.which("sbatch") or "sbatch") if not os.path.exists(d)]
    if absent:
        return f"Slurm is not installed ({', '.join(absent)} missing)"
    if os.geteuid() != 0:
        return "the Slurm test cluster runs its slurmd as root (device cgroups, several slurmd on one host); run the tests as root"
    if not Path("/sys/fs/cgroup/devices").is_dir():
        return "no cgroup v1 devices controller at /sys/fs/cgroup/devices (the cluster constrains GPUs with it)"
    return None


def _ports_free(ports: list[int]) -> bool:
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _base_port() -> int:
    """A controller port P with P, P+1 and P+101..P+104 free (the recipe's layout)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + 200 < 65535 and _ports_free([p, p + 1, *(p + 101 + i for i in range(len(NODES)))]):
            return p
    raise RuntimeError("no free ports for the Slurm test cluster")


def slurm_conf(base: Path, port: int) -> str:
    host = socket.gethostname()
    nodes = "\n".join(
        f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={port + 101 + i} CPUs=2 RealMemory=2000 Gres=gpu:{t}:{GPUS_PER_NODE}"
        for i, (n, t) in enumerate(NODES.items())
    )
    return f"""ClusterName=frenzytest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={port}
SlurmdPort={port + 1}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={base}/munge/munge.sock
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool/%n
SlurmctldPidFile={base}/run/slurmctld.pid
SlurmdPidFile={base}/run/slurmd-%n.pid
SlurmctldLogFile={base}/log/slurmctld.log
SlurmdLogFile={base}/log/slurmd-%n.log
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={base}/log/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
MpiDefault=none
ReturnToService=2
SlurmdTimeout=30
KillWait=5
MinJobAge=3600
JobRequeue=0
SchedulerParameters=sched_interval=2
{nodes}
PartitionName=gpu Nodes=n[1-{len(NODES)}] Default=YES MaxTime=INFINITE State=UP
"""


def gres_conf(base: Path) -> str:
    types: dict[str, list[str]] = {}
    for n, t in NODES.items():
        types.setdefault(t, []).append(n)
    return "AutoDetect=off\n" + "".join(
        f"NodeName={','.join(ns)} Name=gpu Type={t} File={base}/dev/nvidia[0-{GPUS_PER_NODE - 1}]\n" for t, ns in types.items()
    )


@dataclass
class SlurmCluster:
    base: Path
    conf: Path
    port: int

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def cli(self, *argv: str, check: bool = True) -> str:
        """A Slurm command's stdout (``check``: its failure raises, with its stderr)."""
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def node_states(self) -> dict[str, str]:
        """Each node's compact state (idle, mix, alloc, down*, ...)."""
        rows = self.cli("sinfo", "-h", "-N", "-o", "%N %t", check=False).split("\n")
        return dict(row.split() for row in rows if row.strip())

    def wait_idle(self, timeout_s: float = START_TIMEOUT_S, nodes: tuple[str, ...] = tuple(NODES)) -> None:
        """Each of ``nodes`` idle (registered and running nothing)."""
        deadline = time.monotonic() + timeout_s
        while any(self.node_states().get(n) != "idle" for n in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm nodes {nodes} not idle after {timeout_s:.0f} s: {self.cli('sinfo', '-N', check=False)}")
            time.sleep(0.5)

    def kill_slurmd(self, node: str) -> None:
        """SIGKILL ``node``'s slurmd, as a crash or a network split between it and the controller
        would leave the node: its jobs' steps and ranks run on (orphans), and after SlurmdTimeout
        the controller declares the node down and its jobs NODE_FAIL."""
        os.kill(int((self.base / "run" / f"slurmd-{node}.pid").read_text().split()[0]), signal.SIGKILL)

    def start_slurmd(self, node: str) -> None:
        """Start ``node``'s slurmd again (it kills what is left of its lost jobs' steps); with
        ReturnToService=2 the controller takes the node back once it registers."""
        subprocess.run(["/usr/sbin/slurmd", "-f", str(self.conf), "-N", node], env=self.env, check=True, timeout=30)

    def pids(self) -> list[int]:
        files = [self.base / "munge" / "munged.pid", self.base / "run" / "slurmctld.pid"]
        files += [self.base / "run" / f"slurmd-{n}.pid" for n in NODES]
        pids = []
        for f in files:
            try:
                pids.append(int(f.read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                pass
        return pids


def _write_files(base: Path, port: int) -> Path:
    for d in ("munge", "etc", "log", "state", "run", "dev", *(f"spool/{n}" for n in NODES)):
        (base / d).mkdir(parents=True, exist_ok=True)
    (base / "munge").chmod(0o711)  # munged refuses a socket directory others cannot traverse
    key = base / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    for i in range(GPUS_PER_NODE):  # GRES File= must name character devices
        os.mknod(base / "dev" / f"nvidia{i}", 0o666 | 0o020000, os.makedev(195, i))
    conf = base / "etc" / "slurm.conf"
    conf.write_text(slurm_conf(base, port))
    (base / "etc" / "gres.conf").write_text(gres_conf(base))
    (base / "etc" / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nConstrainDevices=yes\n")
    return conf


def _stop(pids: list[int], timeout_s: float = 15.0) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _end_jobs(cluster: SlurmCluster, timeout_s: float = 30.0) -> None:
    """Cancel every job still there and wait for them to go: a job's slurmstepd outlives its
    slurmd, so stopping the daemons first would leave its processes running."""
    try:
        jobs = cluster.cli("squeue", "-h", "-o", "%A").split()
        if jobs:
            cluster.cli("scancel", *jobs, check=False)
        deadline = time.monotonic() + timeout_s
        while cluster.cli("squeue", "-h", "-t", "RUNNING,COMPLETING,PENDING", "-o", "%A", check=False).split():
            if time.monotonic() > deadline:
                return
            time.sleep(0.5)
    except (OSError, RuntimeError, subprocess.TimeoutExpired):  # slurmctld never started, or died: nothing to ask
        pass


def _step_daemons(base: Path) -> list[int]:
    """The slurmstepd processes of this cluster's jobs (their SLURM_CONF is under ``base``)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(b"slurmstepd"):
                if f"SLURM_CONF={base}/".encode() in (proc / "environ").read_bytes():
                    found.append(int(proc.name))
        except OSError:
            pass
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextmanager
def slurm_cluster() -> Iterator[SlurmCluster]:
    """The cluster running under a directory of its own (its config, state, logs, sockets and
    devices), removed afterwards. Not pytest's: munged wants every directory above its socket
    traversable by all."""
    base = Path(tempfile.mkdtemp(prefix="frenzy-slurm-"))
    base.chmod(0o711)
    port = _base_port()
    conf = _write_files(base, port)
    cluster = SlurmCluster(base=base, conf=conf, port=port)
    m = base / "munge"
    try:
        subprocess.run(
            ["/usr/sbin/munged", f"--socket={m}/munge.sock", f"--key-file={m}/munge.key", f"--pid-file={m}/munged.pid"]
            + [f"--log-file={m}/munged.log", f"--seed-file={m}/seed"],
            check=True,
            timeout=30,
        )
        subprocess.run(["/usr/sbin/slurmctld", "-f", str(conf)], env=cluster.env, check=True, timeout=30)
        for n in NODES:
            subprocess.run(["/usr/sbin/slurmd", "-f", str(conf), "-N", n], env=cluster.env, check=True, timeout=30)
        cluster.wait_idle()
        yield cluster
    finally:
        _end_jobs(cluster)
        _stop(cluster.pids())
        _stop(_step_daemons(base))
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":  # start one by hand: python -m tests.slurm_cluster (Ctrl-C stops it)
    with slurm_cluster() as c:
        print(f"export SLURM_CONF={c.conf}", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
