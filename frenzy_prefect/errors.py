"""Errors the user can act on, and how a pydantic validation error reads as one line."""

from __future__ import annotations

from collections.abc import Iterator

from pydantic import ValidationError


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling, each once."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


class FrenzyError(ValueError):
    """Bad input or an impossible request: the message says what is wrong and what would work."""


class NoFeasiblePlan(FrenzyError):
    """No GPU type in the cluster can hold the job under any plan."""


class ClusterBusy(FrenzyError):
    """Plans fit the cluster's GPU types, but not the GPUs that are free now."""


class DatasetError(FrenzyError):
    """A dataset URI that does not exist, cannot be read or has the wrong format."""


class NoRawFiles(DatasetError):
    """A raw dataset prefix holds no files (yet)."""


class StorageUnreachable(FrenzyError):
    """The object store (S3 endpoint) cannot be reached."""


SHOWN_INPUT_CHARS = 80


def _shortened(text: str) -> str:
    """``text`` cut to SHOWN_INPUT_CHARS: an invalid JSON document is the input, whole."""
    return text if len(text) <= SHOWN_INPUT_CHARS else f"{text[: SHOWN_INPUT_CHARS - 3]}..."


def describe_validation_error(exc: ValidationError) -> str:
    """One line per problem: ``field.path: message (got value)``."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or exc.title
        got = err.get("input")
        shown = "" if isinstance(got, dict) or got is None else f" (got {_shortened(repr(got))})"
        message = err["msg"].removeprefix("Value error, ")  # a validator's own sentence, not pydantic's label
        lines.append(f"{where}: {message}{shown}")
    return "; ".join(lines)
