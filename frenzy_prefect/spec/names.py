"""A string field that names something (a URI, a preset, a column, a token): never empty or blank.

An empty field of Prefect's parameter form arrives as "", which would otherwise reach training
as a dataset URI naming the worker's working directory. The JSON schema says it too (a minimum
length and a pattern that needs one non-blank character), so that the form, and the server's
check of a deployment's parameters, refuse it before a run is created."""

from __future__ import annotations

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
