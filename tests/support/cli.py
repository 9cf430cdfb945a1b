"""The `frenzy` command line in the tests: run in this process (typer's CliRunner), for what a
command parses and prints, or as a process of its own, for what it imports or starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

from typer.testing import CliRunner


@dataclass
class Ran:
    """What a command printed and its exit status, as `subprocess.run` gives them."""

    returncode: int
    stdout: str
    stderr: str


def frenzy(*args: str, columns: int | None = None) -> Ran:
    """`frenzy ARGS` in this process, its output piped (as to a file or `less`); ``columns``: the
    terminal width it is told. An exception no command turns into its one line fails the test."""
    from frenzy_prefect.cli import app

    env = {"COLUMNS": str(columns)} if columns else {}
    result = CliRunner().invoke(app, list(args), env=env, catch_exceptions=False, prog_name="frenzy")
    return Ran(result.exit_code, result.stdout, result.stderr)


def timed_frenzy(*args: str) -> tuple[Ran, float]:
    """``frenzy`` in this process and the CPU seconds it used. CPU time, not wall time, so that a
    machine shared with other work does not make a bound flake."""
    before = time.process_time()
    out = frenzy(*args)
    return out, time.process_time() - before


def frenzy_process(*args: str, columns: int | None = None) -> subprocess.CompletedProcess:
    """The real command line as a process of its own (what it imports, what it starts), its output piped."""
    env = os.environ | ({"COLUMNS": str(columns)} if columns else {})
    return subprocess.run([sys.executable, "-m", "frenzy_prefect.cli", *args], capture_output=True, text=True, timeout=120, env=env)
