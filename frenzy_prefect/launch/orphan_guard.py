"""Run a command that dies with the process that started it: ``python -m
frenzy_prefect.launch.orphan_guard PARENT_PID ARGV...`` asks Linux to send it SIGTERM when its
parent (the worker) exits, however it exits (a ``kill -9`` included), then becomes the command.

torchrun answers SIGTERM by stopping its ranks; the ssh client's death closes the remote end's
stdin, which stops the remote ranks. So a worker killed with -9 leaves no rank running on GPUs
whose reservation nobody renews any more. Elsewhere than Linux the command runs unguarded.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def main() -> None:
    parent, argv = int(sys.argv[1]), sys.argv[2:]
    if sys.platform == "linux":
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent died before the request took effect
            sys.exit(128 + signal.SIGTERM)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
