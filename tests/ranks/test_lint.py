"""Static checks that catch what a test path might miss: undefined or unused names, likely bugs."""

import subprocess
import sys

from tests.support.stack import ROOT

SOURCES = ["frenzy_prefect", "tests", "examples", "benchmarks"]


def test_ruff_finds_nothing():
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--output-format", "concise", *SOURCES], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_code_is_laid_out_as_ruff_format_lays_it_out():
    out = subprocess.run([sys.executable, "-m", "ruff", "format", "--check", *SOURCES], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_pure_core_imports_no_prefect():
    core = ["spec", "profiling", "datasets", "memory", "allocator", "pipeline", "training", "launch", "scheduling", "recycle"]
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for package in core
        for p in (ROOT / "frenzy_prefect" / package).rglob("*.py")
        if p.name != "__init__.py"
    )
    probe = (
        f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] == 'prefect'))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"the core pulled in Prefect: {out.stdout[:300]}"
