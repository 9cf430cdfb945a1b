"""Static checks that catch what a test path might miss: undefined or unused names, likely bugs."""

import subprocess
import sys

from .conftest import ROOT


def test_ruff_finds_nothing():
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--output-format", "concise", "frenzy_prefect", "tests", "examples"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
