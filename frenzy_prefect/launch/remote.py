"""The far end of the SSH launcher, started by ``ssh HOST PYTHON -m frenzy_prefect.launch.remote``.

It reads one JSON line from stdin, ``{"argv": [...], "env": {...}, "cwd": ...}``, runs the
argument list in its own session with that environment on top of this host's, and exits with
its code. The environment travels over the encrypted channel's stdin, never on a command line
(where ``ps`` would show secrets). When stdin closes, because the worker stopped its ssh client
or died, the command's whole process group is stopped: nothing outlives its job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

GRACE_S = 5.0


def _stop(child: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)


def main() -> int:
    spec = json.loads(sys.stdin.readline())
    child = subprocess.Popen(spec["argv"], env={**os.environ, **spec["env"]}, cwd=spec.get("cwd"), start_new_session=True)

    def stop_on_eof() -> None:
        sys.stdin.read()  # returns when the worker's side of the connection goes away
        _stop(child)

    threading.Thread(target=stop_on_eof, daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda *_: _stop(child))
    return child.wait()


if __name__ == "__main__":
    sys.exit(main())
