"""The demo (scripts/demo runs examples/quickstart.py) stops everything it started however it is
asked to stop: SIGTERM while it keeps the services up (the whole demo, on its own stack: its
own home, ports picked free), and SIGHUP to any process inside a LocalStack block."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.stack import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.faults]


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), or None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(root: int) -> dict[int, str]:
    """Every process under ``root`` (recursively): PID -> its start time (to tell it from a later
    process given the same PID)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        if (fields := _stat(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if (fields := _stat(child)) is not None:
                found[child] = fields[19]
                todo.append(child)
    return found


def alive(pid: int, started: str) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z" and fields[19] == started


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def own_env(home: Path) -> dict[str, str]:
    """This checkout first on the path; no endpoints of the test session's stack (its S3 endpoint
    is in os.environ), so the child starts its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "AWS_ENDPOINT_URL", "AWS_PROFILE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env["PREFECT_HOME"] = str(home / "prefect")
    return env


def wait_for(path: Path, text: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text(errors="replace"):
        assert proc.poll() is None, f"exited {proc.returncode} before {text!r}:\n{path.read_text(errors='replace')[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} after {timeout_s:.0f} s:\n{path.read_text(errors='replace')[-3000:]}"
        time.sleep(0.5)


def assert_all_gone(started: dict[int, str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s  # a failure guard: the stack's stop allows 10 s a process
    while left := {pid: cmdline(pid) for pid, t in started.items() if alive(pid, t)}:
        assert time.monotonic() < deadline, f"still running after their parent stopped: {left}"
        time.sleep(0.2)


def test_sigterm_to_the_demo_keeping_its_services_up_stops_all_of_them(tmp_path):
    out = tmp_path / "demo.out"
    with open(out, "wb") as f:
        demo = subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--keep-running", "--steps", "3", "--home", str(tmp_path / "home")],
            cwd=ROOT,
            env=own_env(tmp_path / "home"),
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(out, "Services stay up", demo, timeout_s=400)
        started = descendants(demo.pid)
        commands = " | ".join(cmdline(pid) for pid in started)
        for service in ("moto.server", "prefect server start", "prefect worker start"):
            assert service in commands, commands
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=60) == 0, out.read_text()[-3000:]
        assert "Stopping the services" in out.read_text()
        assert_all_gone(started, timeout_s=30)
    finally:
        if demo.poll() is None:
            demo.kill()


STACK_SCRIPT = """
import signal, sys
from pathlib import Path
from frenzy_prefect.localstack import LocalStack
with LocalStack(Path(sys.argv[1])) as stack:
    print("S3", stack.start_s3(), flush=True)
    while True:
        signal.pause()
"""


def test_sighup_inside_a_localstack_block_stops_what_it_started(tmp_path):
    out = tmp_path / "stack.out"
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", STACK_SCRIPT, str(tmp_path / "home")],
            cwd=ROOT,
            env=own_env(tmp_path / "home"),
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(out, "S3 http://", proc, timeout_s=120)
        started = descendants(proc.pid)
        assert "moto.server" in " ".join(cmdline(pid) for pid in started)
        proc.send_signal(signal.SIGHUP)
        proc.wait(timeout=60)
        assert "KeyboardInterrupt: SIGHUP" in out.read_text()  # raised as Ctrl-C would be, after the stack stopped
        assert_all_gone(started, timeout_s=30)
    finally:
        if proc.poll() is None:
            proc.kill()
