"""The embedded default stack: a Prefect server on SQLite, an S3 endpoint (moto's server) and a
`frenzy` worker, each a real process on 127.0.0.1, stopped by PID when the ``with`` block ends,
however it ends: an exception, Ctrl-C, SIGTERM or SIGHUP. Whatever the environment already
points at (PREFECT_API_URL, AWS_ENDPOINT_URL) is used instead of starting it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from frenzy_prefect.training.distributed import free_port

LOCAL_S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "frenzy-local", "AWS_SECRET_ACCESS_KEY": "frenzy-local", "AWS_DEFAULT_REGION": "us-east-1"}


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # besides SIGINT (Ctrl-C), how a process is asked to stop


class StackError(RuntimeError):
    pass


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


class LocalStack:
    def __init__(self, home: Path, *, worker_query_seconds: int = 2):
        self.home = home.resolve()
        self.logs = self.home / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env: dict[str, str] = {
            **os.environ,
            "PREFECT_HOME": str(self.home / "prefect"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_WORKER_QUERY_SECONDS": str(worker_query_seconds),
        }
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.ui_url: str | None = None

    # -- processes ----------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "wb") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.processes[name] = proc
        return proc

    def _log_tail(self, name: str, lines: int = 15) -> str:
        return "\n".join((self.logs / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])

    def _wait_until(self, name: str, ready: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc = self.processes.get(name)
            if proc is not None and proc.poll() is not None:
                raise StackError(f"{name} exited with {proc.returncode}:\n{self._log_tail(name)}")
            try:
                if ready():
                    return
            except (httpx.HTTPError, OSError):
                pass
            time.sleep(0.3)
        raise StackError(f"{name} not ready after {timeout_s:.0f} s:\n{self._log_tail(name)}")

    def stop(self) -> None:
        """Stop what this stack started, newest first: SIGTERM, then SIGKILL after 10 s."""
        for proc in reversed(list(self.processes.values())):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=10)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.processes.clear()

    def __enter__(self) -> "LocalStack":
        """Inside the ``with`` block SIGTERM and SIGHUP act as Ctrl-C does (KeyboardInterrupt), so
        that however this process is asked to stop, it stops what it started on the way out."""
        self._handlers = {}
        if threading.current_thread() is threading.main_thread():
            self._handlers = {sig: signal.signal(sig, _interrupt) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        # A second signal must not cut the stopping short: held until everything is stopped,
        # then delivered under the handlers this process had before.
        held = set(STOP_SIGNALS) | {signal.SIGINT} if self._handlers else set()
        signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            self.stop()
        finally:
            for sig, handler in self._handlers.items():
                signal.signal(sig, handler)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, held)

    # -- services ----------------------------------------------------------------------------

    def start_s3(self) -> str:
        """The S3 endpoint: AWS_ENDPOINT_URL if set, else a moto server started here (and this
        process pointed at it)."""
        if os.environ.get("AWS_ENDPOINT_URL"):
            return os.environ["AWS_ENDPOINT_URL"]
        port = free_port()
        endpoint = f"http://127.0.0.1:{port}"
        self._spawn("s3", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)])
        self._wait_until("s3", lambda: httpx.get(f"{endpoint}/moto-api/").status_code == 200, 60)
        s3_env = {"AWS_ENDPOINT_URL": endpoint, **{k: os.environ.get(k) or v for k, v in LOCAL_S3_CREDENTIALS.items()}}
        self.env.update(s3_env)
        os.environ.update(s3_env)  # this process reads and writes the same buckets
        return endpoint

    def start_prefect(self) -> str:
        """The Prefect API: PREFECT_API_URL if set, else `prefect server start` on SQLite here."""
        if os.environ.get("PREFECT_API_URL"):
            self.env["PREFECT_API_URL"] = os.environ["PREFECT_API_URL"]
            self.ui_url = os.environ["PREFECT_API_URL"].removesuffix("/api")
            return self.env["PREFECT_API_URL"]
        port = free_port()
        api = f"http://127.0.0.1:{port}/api"
        self.env.update(PREFECT_UI_API_URL=api)
        self._spawn("prefect-server", [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)])
        self._wait_until("prefect-server", lambda: httpx.get(f"{api}/health").status_code == 200, 120)
        self.env["PREFECT_API_URL"] = api
        self.ui_url = f"http://127.0.0.1:{port}"
        return api

    def run_cli(self, *args: str) -> str:
        """A `prefect`/`frenzy` CLI command against this stack; its output, or StackError."""
        proc = subprocess.run([sys.executable, "-m", *args], env=self.env, capture_output=True, text=True, timeout=120)
        if proc.returncode:
            raise StackError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout

    def start_worker(self, pool: str, name: str = "frenzy-worker", limit: int | None = None) -> subprocess.Popen[bytes]:
        """`prefect worker start --pool POOL [--limit N]` for a `frenzy` pool (created if
        missing); waits until it polls. ``limit``: runs this worker holds at once, waiting ones
        included."""
        try:
            self.run_cli("prefect", "work-pool", "inspect", pool)
        except StackError:
            self.run_cli("prefect", "work-pool", "create", pool, "--type", "frenzy")
        argv = [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--name", name]
        proc = self._spawn(name, argv + (["--limit", str(limit)] if limit else []))
        self._wait_until(name, lambda: "started!" in (self.logs / f"{name}.log").read_text(errors="replace"), 120)
        return proc

    @contextmanager
    def client_settings(self) -> Iterator[None]:
        """Point this process's Prefect client at the stack."""
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: self.env["PREFECT_API_URL"]}):
            yield
