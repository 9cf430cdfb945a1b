"""The far end of the SSH launcher, started by ``ssh HOST PYTHON -m frenzy_prefect.launch.remote``.

It reads one JSON line from stdin, ``{"argv": [...], "env": {...}, "cwd": ..., "port_env": ...}``,
runs the argument list in its own session with that environment on top of this host's, and exits
with its code. The environment travels over the encrypted channel's stdin, never on a command
line (where ``ps`` would show secrets). When stdin closes, because the worker stopped its ssh
client or died, the command's whole process group is stopped: nothing outlives its job.

Its stdout is a channel to the launcher: lines ``frenzy-remote: {JSON}``, nothing else (the
command's stdout goes to stderr, with the command's stderr). With ``port_env`` set, it first
picks a TCP port free on this host, reports ``{"port": N}`` and gives the port to the command
in that variable: the job's rendezvous listens here, so its port must be free here. When the
command ends it reports ``{"exit": {"pid", "exitcode", ...}}``, with what the command left in
its failure file (failure.py: which rank failed, and how), and exits with the command's code
(128 + N for a command killed by signal N).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from frenzy_prefect.launch.failure import FAILURE_FILE_ENV, read_report

GRACE_S = 5.0
MESSAGE = "frenzy-remote: "  # the prefix of a message line on stdout


def _stop(child: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)


def say(**message: object) -> None:
    """One message to the launcher."""
    sys.stdout.write(MESSAGE + json.dumps(message) + "\n")
    sys.stdout.flush()


def free_port() -> int:
    """A TCP port nothing listens on, on any of this host's addresses."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def main() -> int:
    spec = json.loads(sys.stdin.readline())
    env = {**os.environ, **spec["env"]}
    if spec.get("port_env"):
        port = free_port()
        env[spec["port_env"]] = str(port)
        say(port=port)
        print(f"frenzy: rendezvous port {port} picked free on {socket.gethostname()}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="frenzy-remote-") as scratch:
        env[FAILURE_FILE_ENV] = os.path.join(scratch, "failure.json")
        child = subprocess.Popen(spec["argv"], env=env, cwd=spec.get("cwd"), start_new_session=True, stdout=sys.stderr)

        def stop_on_eof() -> None:
            sys.stdin.read()  # returns when the worker's side of the connection goes away
            _stop(child)

        threading.Thread(target=stop_on_eof, daemon=True).start()
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, lambda *_: _stop(child))
        code = child.wait()
        try:
            say(exit={"pid": child.pid, "exitcode": code, **(read_report(env[FAILURE_FILE_ENV]) or {})})
        except OSError:  # the launcher's side is gone (it stopped this job): nobody to tell
            pass
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
