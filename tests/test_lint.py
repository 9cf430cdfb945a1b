"""Static checks that catch what a test path might miss: undefined or unused names, likely bugs."""

import ast
import subprocess
import sys

from .conftest import ROOT

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


MAX_FUNCTION_LINES = 80


def test_no_function_in_the_package_is_longer_than_80_lines():
    """Short functions (the team's rule): every function's body, docstring and nested functions
    included, from its first statement to its last line, is at most MAX_FUNCTION_LINES lines."""
    long = []
    for path in sorted((ROOT / "frenzy_prefect").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.body[0].lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions over 80 lines: " + ", ".join(long)
