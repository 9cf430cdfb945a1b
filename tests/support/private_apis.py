"""Helpers shared by the tests of private_apis."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version

import pytest

from tests.support.stack import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


REQUIREMENT = re.compile(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)$")


def _ranges() -> dict[str, str]:
    project = PYPROJECT["project"]
    deps = [*project["dependencies"], *(d for extra in project["optional-dependencies"].values() for d in extra)]
    found = {}
    for dep in deps:
        name, _, spec = REQUIREMENT.match(dep.split(";")[0].strip()).groups()
        if name != "frenzy-prefect":
            found[name.lower()] = spec.replace(" ", "")
    return found


RANGES = _ranges()


@contextmanager
def relying_on(api: str, package: str) -> Iterator[None]:
    """Any failure inside reads: this API is not what we rely on, under this version, and the range we vouch for."""
    try:
        yield
    except Exception as exc:
        pytest.fail(
            f"{api} is not what frenzy-prefect relies on under {package} {version(package)} (pyproject.toml vouches for "
            f"{package}{RANGES[package]}; the use is routed through frenzy_prefect/{package}_private.py): {type(exc).__name__}: {exc}",
            pytrace=False,
        )
