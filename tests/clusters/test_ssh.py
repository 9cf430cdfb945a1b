"""The SSH launcher against a real sshd on 127.0.0.1 (Debian's openssh-server, started here
with its own host key and an authorized key, stopped by PID): a two-node job trains through
it, its rendezvous port is picked by the first node's remote end, stopping the ssh client stops
the remote command, and a host that cannot be reached or
whose key is not trusted fails with ssh's code and the host named; and a flow run whose job
variables pick the ssh launcher trains through the pool's worker and sshd."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.launch.command import Launch
from frenzy_prefect.launch.local import is_running, stop_process_groups
from frenzy_prefect.launch.ssh import SSH_UNREACHABLE, SshSettings, start_ssh
from frenzy_prefect.launch.torchrun import rank_launches
from frenzy_prefect.pool.worker import FrenzyJobConfiguration, _ssh_settings
from frenzy_prefect.profiling.dataset import profile_dataset
from frenzy_prefect.spec.plan import ParallelPlan, Placement
from frenzy_prefect.storage import open_uri
from frenzy_prefect.training.distributed import free_port
from tests.support.stack import BUCKET, ROOT, without_real_part
from tests.support.training import NANO, make_job

SSHD = "/usr/sbin/sshd"


@pytest.fixture(scope="module")
def sshd(tmp_path_factory) -> SshSettings:
    if not os.path.exists(SSHD):
        without_real_part("sshd", f"no {SSHD} here (Debian: apt-get install openssh-server)")
    d = tmp_path_factory.mktemp("sshd")
    for key in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    (d / "authorized_keys").write_text((d / "user_key.pub").read_text())
    port = free_port()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
        f"PidFile {d / 'sshd.pid'}\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nPubkeyAuthentication yes\n"
        "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n"
        f"SetEnv PYTHONPATH={ROOT}\n"  # the node runs this checkout's remote end, as the worker side does
    )
    (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {(d / 'host_key.pub').read_text()}")
    Path("/run/sshd").mkdir(exist_ok=True)  # its privilege-separation directory
    server = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config")], stderr=open(d / "sshd.log", "wb"))
    deadline = time.monotonic() + 20
    while not (d / "sshd.pid").exists():
        assert server.poll() is None and time.monotonic() < deadline, (d / "sshd.log").read_text()
        time.sleep(0.1)
    yield SshSettings(
        user=os.environ.get("USER") or "root", port=port, identity_file=d / "user_key", known_hosts=d / "known_hosts", python=sys.executable
    )
    os.kill(int((d / "sshd.pid").read_text()), signal.SIGTERM)
    server.wait(timeout=10)


def test_a_two_node_job_trains_through_sshd(sshd, dataset):
    placements = [Placement(node="n0", host="127.0.0.1", gpus=[0]), Placement(node="n1", host="127.0.0.1", gpus=[1])]
    job = make_job(
        profile_dataset(dataset, 64, NANO.vocab_size),
        f"s3://{BUCKET}/runs/over-ssh",
        ParallelPlan(dp=2, micro_batch=4),
        placements,
        steps=10,
    )

    async def run() -> tuple[int, int | None]:
        launches = rank_launches(job, python=sys.executable, env=dict(os.environ))
        group = await start_ssh(launches, sshd)
        return await group.wait(), group.rendezvous_port

    code, port = asyncio.run(run())
    assert code == 0 and port is not None
    with open_uri(job.metrics_uri, "r") as f:
        metrics = json.load(f)
    assert metrics["world_size"] == 2 and len(metrics["losses"]) == 10


def test_the_rendezvous_port_is_picked_on_the_first_node_and_given_to_every_node(sshd, tmp_path, capfd, monkeypatch):
    """The port the rendezvous listens on must be free where it listens: on the first node, not
    on the worker's machine. Both nodes are this host here, so the test shows who picked it: the
    launcher binds no socket at all, the first node's remote end reports the port, and every
    node's command gets that one port; still one ssh session per node."""
    seen = tmp_path / "seen"
    seen.mkdir()
    write = f"import os, pathlib; pathlib.Path({str(seen)!r}, os.environ['NODE']).write_text(os.environ['RDZV_PORT'])"
    launches = [
        Launch(host="127.0.0.1", node=f"n{i}", argv=[sys.executable, "-c", write], env={"NODE": f"n{i}"}, port_env="RDZV_PORT")
        for i in range(2)
    ]
    sshd_log = sshd.identity_file.parent / "sshd.log"
    accepted_before = sshd_log.read_text(errors="replace").count("Accepted publickey")

    def no_binding_here(*_):
        raise AssertionError("the launcher bound a socket on the worker's machine")

    async def run() -> tuple[int, int | None]:
        with monkeypatch.context() as m:
            m.setattr(socket.socket, "bind", no_binding_here)
            group = await start_ssh(launches, sshd)
        return await group.wait(), group.rendezvous_port

    code, port = asyncio.run(run())
    assert code == 0 and port is not None
    assert {p.name: int(p.read_text()) for p in seen.iterdir()} == {"n0": port, "n1": port}
    said = [line for line in capfd.readouterr().err.splitlines() if "rendezvous port" in line]
    assert said == [f"frenzy: rendezvous port {port} picked free on {socket.gethostname()}"]  # by n0's remote end, once
    assert sshd_log.read_text(errors="replace").count("Accepted publickey") == accepted_before + 2  # one session per node


def test_stopping_the_ssh_client_stops_the_remote_command(sshd, tmp_path):
    marker = tmp_path / "alive"
    script = f"import pathlib, time\nwhile True:\n    pathlib.Path({str(marker)!r}).touch()\n    time.sleep(0.1)\n"

    async def run() -> list[int]:
        group = await start_ssh([Launch(host="127.0.0.1", argv=[sys.executable, "-c", script])], sshd)
        deadline = time.monotonic() + 20
        while not marker.exists():
            assert time.monotonic() < deadline, "the remote command never ran"
            await asyncio.sleep(0.1)
        await stop_process_groups(group.pids, grace_s=5)
        return group.pids

    pids = asyncio.run(run())
    assert not any(is_running(p) for p in pids)
    time.sleep(1.0)
    marker.unlink()
    time.sleep(1.0)
    assert not marker.exists(), "the remote command outlived its ssh client"


@pytest.mark.faults
def test_a_remote_rank_killed_with_sigkill_is_named_through_the_connection(sshd):
    """The remote end relays its command's account of a failure (what torchrun writes when a rank
    dies: the global rank, the rank's PID, its exit status) once the command has exited; a
    command that leaves none is named by its own (remote) PID. Stand-ins for torchrun here: the
    real agent's account is tested locally (test_worker)."""
    rank_dies = (
        "import os, signal\n"
        "from frenzy_prefect.launch.failure import write_report\n"
        "write_report({'rank': 3, 'local_rank': 1, 'pid': 4242, 'exitcode': -9})\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    dies = (
        "import os, pathlib, signal\npathlib.Path(os.environ['OUT']).write_text(str(os.getpid()))\nos.kill(os.getpid(), signal.SIGKILL)\n"
    )

    async def run(launch: Launch) -> tuple[int, str | None]:
        group = await start_ssh([launch], sshd)
        return await group.wait(), group.failure

    code, failure = asyncio.run(run(Launch(host="127.0.0.1", node="gpu-3", argv=[sys.executable, "-c", rank_dies])))
    assert code == 128 + signal.SIGKILL and failure == "rank 3 on gpu-3 (pid 4242) was killed by SIGKILL"
    out = sshd.identity_file.parent / "remote-pid"
    code, failure = asyncio.run(run(Launch(host="127.0.0.1", argv=[sys.executable, "-c", dies], env={"OUT": str(out)})))
    assert failure == f"the command on 127.0.0.1 (pid {out.read_text()}) was killed by SIGKILL"


@pytest.mark.parametrize("case", ["nothing listens", "unknown host key"])
def test_an_unreachable_or_untrusted_host_fails_with_the_host_named(sshd, tmp_path, case):
    if case == "nothing listens":
        settings = sshd.model_copy(update={"port": free_port()})
    else:
        (tmp_path / "known_hosts").write_text("")
        settings = sshd.model_copy(update={"known_hosts": tmp_path / "known_hosts"})

    async def run() -> tuple[int, str | None]:
        group = await start_ssh([Launch(host="127.0.0.1", argv=["true"])], settings)
        return await group.wait(), group.failed_host

    assert asyncio.run(run()) == (SSH_UNREACHABLE, "127.0.0.1")


def test_the_worker_takes_the_ssh_key_from_a_secret_block_and_never_shows_it(stack, prefect_api, tmp_path):
    from prefect.blocks.system import Secret

    material = "-----BEGIN OPENSSH PRIVATE KEY-----\nc2VjcmV0LW1hdGVyaWFs\n-----END OPENSSH PRIVATE KEY-----"
    config = FrenzyJobConfiguration(
        launcher="ssh", ssh_user="trainer", ssh_key_secret="frenzy-test-key", ssh_known_hosts=tmp_path / "known_hosts"
    )
    with stack.client_settings():
        Secret(value=material).save("frenzy-test-key", overwrite=True)
        settings = asyncio.run(_ssh_settings(config, tmp_path))
        with pytest.raises(FrenzyError, match="no Secret block named 'absent' \\(ssh_key_secret\\)"):
            asyncio.run(_ssh_settings(config.model_copy(update={"ssh_key_secret": "absent"}), tmp_path))
    assert settings.identity_file.read_text() == material + "\n"
    assert settings.identity_file.stat().st_mode & 0o777 == 0o600
    assert "c2VjcmV0" not in repr(settings) + repr(config) + " ".join(ssh_argv_for(settings))
    with pytest.raises(FrenzyError, match="needs the pool's ssh_user, ssh_known_hosts set"):
        asyncio.run(_ssh_settings(FrenzyJobConfiguration(launcher="ssh", ssh_key_secret="k"), tmp_path))


def ssh_argv_for(settings: SshSettings) -> list[str]:
    from frenzy_prefect.launch.ssh import ssh_argv

    return ssh_argv("node-7", settings)


@pytest.mark.e2e
def test_a_run_whose_known_hosts_file_is_missing_fails_in_one_line_before_any_gpu_is_reserved(stack, worker_pool, dataset, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.deployments import run_deployment

    from tests.support.runs import training_job, wait_final

    missing = tmp_path / "absent_known_hosts"
    parameters = training_job(dataset, gpus=2, gpu_type="A10", steps=5, output=f"s3://{BUCKET}/runs/no-known-hosts")
    variables = {"launcher": "ssh", "ssh_user": "trainer", "ssh_key_secret": "never-read", "ssh_known_hosts": str(missing)}
    with stack.client_settings():
        run = wait_final(run_deployment("distributed-train/frenzy", parameters=parameters, job_variables=variables, timeout=0).id)
        with get_client(sync_client=True) as client:
            logs = [log.message for log in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))]
    message = run.state.message or ""
    assert not run.state.is_completed() and "\n" not in message.strip(), message
    assert f"FrenzyError: the ssh launcher's known_hosts file {missing} does not exist: set the pool's ssh_known_hosts" in message
    assert "ExceptionGroup" not in message and not any(m.startswith("Reserved GPUs") for m in logs), (message, logs)
    assert not run.labels.get("frenzy.gpus"), run.labels  # it never claimed a GPU


@pytest.mark.e2e
def test_a_flow_run_with_the_ssh_launcher_trains_through_sshd_via_the_worker(sshd, stack, worker_pool, dataset):
    """The whole path: a `distributed-train` run whose job variables pick the ssh launcher (key
    in a Secret block, host keys checked); the pool's worker reserves the GPUs and starts the
    ranks on the node's host through sshd, and rank 0 reports the run complete."""
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.deployments import run_deployment

    from tests.support.runs import free_now, training_job, wait_final

    sshd_log = sshd.identity_file.parent / "sshd.log"
    accepted_before = sshd_log.read_text(errors="replace").count("Accepted publickey")
    parameters = training_job(dataset, gpus=2, gpu_type="A10", steps=5, output=f"s3://{BUCKET}/runs/worker-over-ssh")
    variables = {
        "launcher": "ssh",
        "ssh_user": sshd.user,
        "ssh_port": sshd.port,
        "ssh_key_secret": "frenzy-ssh-e2e-key",
        "ssh_known_hosts": str(sshd.known_hosts),
    }
    with stack.client_settings():
        Secret(value=sshd.identity_file.read_text()).save("frenzy-ssh-e2e-key", overwrite=True)
        run = wait_final(run_deployment("distributed-train/frenzy", parameters=parameters, job_variables=variables, timeout=0).id)
        assert run.state.is_completed(), run.state.message
        # Logs reach the server in batches, and the worker releases the GPUs once the ssh
        # sessions end, just after rank 0 reports.
        deadline = time.monotonic() + 30
        with get_client(sync_client=True) as client:
            while True:
                logs = [log.message for log in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))]
                done = any(m.startswith("step 5/5 loss") for m in logs) and any(m.startswith("Releasing GPUs ") for m in logs)
                if done or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
    assert any(m.startswith("Reserved GPUs a10-node[0, 1]") for m in logs) and any(m.startswith("step 5/5 loss") for m in logs), logs
    assert sshd_log.read_text(errors="replace").count("Accepted publickey") == accepted_before + 1  # one node, one session
    assert sshd.identity_file.read_text().strip().splitlines()[1] not in "\n".join(logs)  # the key never reaches a log
    while free_now(stack) != {"a10-node": [0, 1], "t4-node": [0, 1]}:
        assert time.monotonic() < deadline + 10, f"GPUs still held: {free_now(stack)}"
        time.sleep(0.5)
