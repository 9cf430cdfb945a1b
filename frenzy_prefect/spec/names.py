"""A string field that names something (a URI, a preset, a column, a token): never empty or blank.

An empty field of Prefect's parameter form arrives as "", which would otherwise reach training
as a dataset URI naming the worker's working directory. The JSON schema says it too (a minimum
length and a pattern that needs one non-blank character), so that the form, and the server's
check of a deployment's parameters, refuse it before a run is created."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from typing import Annotated, Any

from pydantic import BeforeValidator, WithJsonSchema

NOT_BLANK_SCHEMA = WithJsonSchema({"type": "string", "minLength": 1, "pattern": r"\S"})


def refuse_blank(expected: str) -> BeforeValidator:
    """A validator that refuses an empty or whitespace-only string, saying what is ``expected``;
    other values pass on to the field's own validation (so it can sit on a union)."""

    def check(value: object) -> object:
        if isinstance(value, str) and not value.strip():
            raise ValueError(f"is empty; expected {expected}")
        return value

    return BeforeValidator(check)


def named(expected: str) -> Any:
    """The type of a string field that names ``expected``, e.g. ``named("a dataset URI")``."""
    return Annotated[str, NOT_BLANK_SCHEMA, refuse_blank(expected)]


def close_names(name: str, choices: Iterable[str], key: Callable[[str], str] = str.lower) -> list[str]:
    """Up to three of ``choices`` close to a mistyped ``name``, compared by ``key``: those it
    begins (``A100``: A100-80GB, A100-40GB), else the most alike."""
    keyed = {key(choice): choice for choice in choices}
    begun = [k for k in keyed if k.startswith(key(name))] if key(name) else []
    return [keyed[k] for k in (begun or difflib.get_close_matches(key(name), keyed, n=3, cutoff=0.6))[:3]]


def did_you_mean(name: str, choices: Iterable[str], key: Callable[[str], str] = str.lower) -> str:
    """The words " (did you mean X or Y?)" for the choices close to ``name`` (``close_names``), else ""."""
    close = close_names(name, choices, key)
    if not close:
        return ""
    return f" (did you mean {' or '.join(close) if len(close) < 3 else ', '.join(close[:-1]) + ' or ' + close[-1]}?)"
