"""The embedded default stack: a Prefect server on SQLite, an S3 endpoint (moto's server) and a
`frenzy` worker, each a real process on 127.0.0.1, stopped by PID when the ``with`` block ends,
however it ends: an exception, Ctrl-C, SIGTERM or SIGHUP. Whatever the environment already
points at (PREFECT_API_URL, AWS_ENDPOINT_URL) is used instead of starting it.

On request the Prefect server keeps its database in PostgreSQL instead (`start_postgres`: the
machine's own PostgreSQL binaries, a fresh data directory, a server process on 127.0.0.1): the
production choice, since SQLite lets one writer in at a time and answers 503 ("database is
locked") when writes collide under load."""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from frenzy_prefect.training.distributed import free_port

DURABLE_LEASE_STORAGE = "prefect.server.concurrency.lease_storage.filesystem"
# How long a Prefect server or worker may take to come up, or a CLI command to run: under 30 s on
# quiet cores, but over 120 s measured on 2 cores shared by a dozen busy processes.
START_TIMEOUT_S = 300
LOCAL_S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "frenzy-local", "AWS_SECRET_ACCESS_KEY": "frenzy-local", "AWS_DEFAULT_REGION": "us-east-1"}


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # besides SIGINT (Ctrl-C), how a process is asked to stop


class StackError(RuntimeError):
    pass


class PostgresNotInstalled(StackError):
    """No PostgreSQL server binaries on this machine."""


def postgres_bin_dir() -> Path | None:
    """The directory holding PostgreSQL's server programs (`initdb`, `postgres`, `pg_isready`,
    `createdb`): where `initdb` on PATH really lives, else Debian's /usr/lib/postgresql/VERSION/bin
    (newest version first); None if none has them all."""
    on_path = shutil.which("initdb")
    candidates = [Path(on_path).resolve().parent] if on_path else []
    candidates += sorted(
        Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0, reverse=True
    )
    return next((d for d in candidates if all((d / name).is_file() for name in ("initdb", "postgres", "pg_isready", "createdb"))), None)


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
            # GPU leases survive a server restart (the default keeps them in the server's memory).
            "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": DURABLE_LEASE_STORAGE,
        }
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._spawn_envs: dict[str, dict[str, str]] = {}  # what each service was started with, for a restart
        self.ui_url: str | None = None
        self._scratch: list[Path] = []  # directories outside home that stop() removes

    # -- processes ----------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        self._spawn_envs[name] = self.env if env is None else env
        with open(self.logs / f"{name}.log", "ab") as log:  # the child keeps its own descriptor; a restart appends
            proc = subprocess.Popen(argv, env=self._spawn_envs[name], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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
        for path in self._scratch:
            shutil.rmtree(path, ignore_errors=True)
        self._scratch.clear()

    def __enter__(self) -> LocalStack:
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

    def start_postgres(self, database: str = "prefect") -> str:
        """A PostgreSQL server for the Prefect server (`start_prefect(database_url=...)`); its
        SQLAlchemy URL. A fresh cluster (`initdb`: superuser `prefect` with a random password,
        password authentication) and `postgres` listening on 127.0.0.1 only, at a free port, no
        Unix socket; then `createdb DATABASE`. PostgreSQL refuses to run as root, so as root it
        runs as the `postgres` OS user (setpriv), in a data directory that user owns in the
        system's temporary directory (the stack's home may lie where only root can enter; home's
        `postgres` links to it, and stop() removes it). Raises PostgresNotInstalled without the
        binaries, StackError if the server does not come up."""
        bin_dir = postgres_bin_dir()
        if bin_dir is None:
            raise PostgresNotInstalled(
                "PostgreSQL is not installed (no initdb, postgres, pg_isready and createdb beside the initdb on PATH "
                "or under /usr/lib/postgresql/*/bin); "
                "on Debian: apt-get install postgresql"
            )
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "TZ": "UTC"}
        as_user: list[str] = []
        if os.geteuid() == 0:
            try:
                owner = pwd.getpwnam("postgres")
            except KeyError:
                raise StackError("PostgreSQL refuses to run as root, and there is no `postgres` OS user to run it as") from None
            if not shutil.which("setpriv"):
                raise StackError("PostgreSQL refuses to run as root, and setpriv (util-linux) is missing to run it as `postgres`")
            root = Path(tempfile.mkdtemp(prefix="frenzy-postgres-"))
            self._scratch.append(root)
            os.chown(root, owner.pw_uid, owner.pw_gid)
            (self.home / "postgres").symlink_to(root)
            as_user = ["setpriv", f"--reuid={owner.pw_uid}", f"--regid={owner.pw_gid}", "--init-groups", "--"]
        else:
            root = self.home / "postgres"
            root.mkdir()
        data, pwfile, password = root / "data", root / "password", secrets.token_urlsafe(24)
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
        if as_user:
            os.chown(pwfile, owner.pw_uid, owner.pw_gid)
        initdb = [
            str(bin_dir / "initdb"),
            "-D",
            str(data),
            "-U",
            "prefect",
            f"--pwfile={pwfile}",
            "--auth=scram-sha-256",
            "-E",
            "UTF8",
            "--no-locale",
        ]
        try:
            with open(self.logs / "postgres-initdb.log", "wb") as log:
                done = subprocess.run([*as_user, *initdb], env=env, stdout=log, stderr=subprocess.STDOUT, timeout=120)
        finally:
            pwfile.unlink()
        if done.returncode:
            raise StackError(f"initdb exited with {done.returncode}:\n{self._log_tail('postgres-initdb')}")

        port = str(free_port())
        self._spawn("postgres", [*as_user, str(bin_dir / "postgres"), "-D", str(data), "-h", "127.0.0.1", "-p", port, "-k", ""], env=env)
        client = ["-h", "127.0.0.1", "-p", port, "-U", "prefect"]
        ready = [str(bin_dir / "pg_isready"), "-q", *client]
        self._wait_until("postgres", lambda: subprocess.run(ready, env=env, timeout=10).returncode == 0, 60)
        created = subprocess.run(
            [str(bin_dir / "createdb"), *client, database], env=env | {"PGPASSWORD": password}, capture_output=True, text=True, timeout=60
        )
        if created.returncode:
            raise StackError(f"createdb {database} failed ({created.returncode}): {created.stderr.strip()}")
        return f"postgresql+asyncpg://prefect:{password}@127.0.0.1:{port}/{database}"

    def start_prefect(self, database_url: str | None = None) -> str:
        """The Prefect API: PREFECT_API_URL if set, else `prefect server start` here, its database
        on SQLite in PREFECT_HOME or at ``database_url`` (`postgresql+asyncpg://...`, as
        start_postgres returns; only the server process sees it)."""
        if os.environ.get("PREFECT_API_URL"):
            self.env["PREFECT_API_URL"] = os.environ["PREFECT_API_URL"]
            self.ui_url = os.environ["PREFECT_API_URL"].removesuffix("/api")
            return self.env["PREFECT_API_URL"]
        port = free_port()
        api = f"http://127.0.0.1:{port}/api"
        self.env.update(PREFECT_UI_API_URL=api)
        server_env = self.env | ({"PREFECT_SERVER_DATABASE_CONNECTION_URL": database_url} if database_url else {})
        argv = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
        self._spawn("prefect-server", argv, env=server_env)
        self._wait_until("prefect-server", lambda: httpx.get(f"{api}/health").status_code == 200, START_TIMEOUT_S)
        self.env["PREFECT_API_URL"] = api
        self.ui_url = f"http://127.0.0.1:{port}"
        return api

    def kill_prefect(self) -> None:
        """Kill the Prefect server this stack started with SIGKILL (a crash: nothing is flushed)."""
        proc = self.processes["prefect-server"]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def restart_prefect(self, **settings: str) -> None:
        """Start the killed Prefect server again, on the same port and database (``settings``:
        environment variables to change for it)."""
        argv = [str(a) for a in self.processes["prefect-server"].args]
        self._spawn("prefect-server", argv, self._spawn_envs["prefect-server"] | settings)
        api = self.env["PREFECT_API_URL"]
        self._wait_until("prefect-server", lambda: httpx.get(f"{api}/health").status_code == 200, START_TIMEOUT_S)

    def run_cli(self, *args: str) -> str:
        """A `prefect`/`frenzy` CLI command against this stack; its output, or StackError."""
        proc = subprocess.run([sys.executable, "-m", *args], env=self.env, capture_output=True, text=True, timeout=START_TIMEOUT_S)
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
        self._wait_until(name, lambda: "started!" in (self.logs / f"{name}.log").read_text(errors="replace"), START_TIMEOUT_S)
        return proc

    @contextmanager
    def client_settings(self) -> Iterator[None]:
        """Point this process's Prefect client at the stack."""
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: self.env["PREFECT_API_URL"]}):
            yield
