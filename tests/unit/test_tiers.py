"""The tiers hold: a fast-tier test cannot start a process, and every test module stands in the
folder of what it starts (docs/testing.md)."""

import multiprocessing
import os
import subprocess

import pytest

from tests.support.stack import ROOT
from tests.unit.conftest import StartsAProcess

TIERS = {"unit", "ranks", "stack", "clusters"}


@pytest.mark.parametrize(
    "start",
    [
        lambda: subprocess.run(["true"]),
        lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
        lambda: multiprocessing.get_context("fork").Process(target=print).start(),
        lambda: os.system("true"),
    ],
    ids=["subprocess", "spawn", "fork", "system"],
)
def test_a_fast_tier_test_that_starts_a_process_fails_naming_the_tier(start):
    with pytest.raises(StartsAProcess, match=r"in the fast tier \(tests/unit\), which starts no process.*move it to tests/ranks"):
        start()


def test_every_test_module_stands_in_a_tier_and_helpers_in_support():
    tests = ROOT / "tests"
    stray = sorted(str(p.relative_to(tests)) for p in tests.rglob("test_*.py") if p.parent.name not in TIERS)
    assert not stray, f"test modules outside tests/{{{','.join(sorted(TIERS))}}}: {stray}"
    loose = sorted(p.name for p in tests.glob("*.py") if p.name not in ("__init__.py", "conftest.py"))
    assert not loose, f"helpers belong in tests/support/: {loose}"
