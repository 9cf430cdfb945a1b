"""Static checks that catch what a test path might miss: undefined or unused names, likely bugs."""

import ast

from tests.support.stack import ROOT

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
