"""What every command shares: the one error handler (bad input is one stderr line, exit 2, no
traceback), output helpers and the parsing of options several commands take."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

from frenzy_prefect.errors import FrenzyError, describe_validation_error
from frenzy_prefect.spec.request import TrainingRequest

USAGE_EXIT = 2


def fail(message: str, exit_code: int = USAGE_EXIT) -> None:
    """Print ``error: message`` as one line on stderr and exit (2 by default)."""
    typer.echo(f"error: {' '.join(message.splitlines())}", err=True)
    # A command that read a block before failing exits with the block's "loaded" event unsent:
    # Prefect's events worker sends it at exit and warns that it is "still processing" it, a
    # second line under the error.
    logging.getLogger("EventsWorker").setLevel(logging.ERROR)
    raise typer.Exit(exit_code)


@contextmanager
def one_line_errors() -> Iterator[None]:
    """Turn the errors bad input causes into one stderr line: the core's (FrenzyError), a
    model's validation (ValidationError) and click's own (a missing argument, a bad integer,
    an unknown command: typer's UsageError and BadParameter, both TyperExceptions)."""
    try:
        yield
    except typer.TyperException as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # no arguments at all (no_args_is_help): the help
            typer.echo(exc.ctx.get_help())  # on stdout, as --help prints it (click's plain mode would use stderr)
            raise typer.Exit(USAGE_EXIT) from None
        ctx = getattr(exc, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        fail(message + hint, getattr(exc, "exit_code", USAGE_EXIT))
    except ValidationError as exc:
        fail(describe_validation_error(exc))
    except FrenzyError as exc:
        fail(str(exc))


class OneLineErrors(TyperGroup):
    """The top-level group: parsing its arguments and invoking a command (which parses its own)
    both run under `one_line_errors`, so every command and sub-group gets it without a wrapper,
    under the console script, ``python -m frenzy_prefect.cli`` and typer's test runner alike."""

    def make_context(self, *args: Any, **kwargs: Any) -> typer.Context:
        with one_line_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: typer.Context) -> Any:
        with one_line_errors():
            return super().invoke(ctx)


def echo_json(data: Any) -> None:
    typer.echo(json.dumps(data))


def plain_table(caption: str | None = None) -> Table:
    """The commands' one table style: no borders (rich's boxes cost three characters a column,
    and are line art in a pipe), a bold header on a terminal, plain text otherwise. Cells wrap at
    spaces rather than end in an ellipsis; ``print_table`` puts the title above it."""
    return Table(caption=caption, box=None, header_style="bold", pad_edge=False, caption_justify="left")


def print_table(title: str, table: Table) -> Console:
    """The title on a line of its own (a table's own title wraps at the table's width), then the table."""
    console = Console()
    console.print(title)
    console.print(table)
    return console


def print_metrics(title: str, rows: list[tuple[str, str]]) -> None:
    table = plain_table()
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, value)
    print_table(title, table)


# Options shared by the memory commands and `frenzy plan`.
ATTENTION = typer.Option("flash", "--attention", help="flash (fused, no s^2 scores) or eager (scores materialised).")
MASTER_WEIGHTS = typer.Option(
    False,
    "--master-weights",
    help="frenzy: bf16/fp16 weights, fp32 main gradients and fp32 master weights in the optimizer (default: fp32 weights under autocast).",
)


def training_request(
    model: str,
    global_batch: int,
    seq_len: int,
    precision: str,
    optimizer: str,
    attention: str = "flash",
    master_weights: bool = False,
    pin: dict | None = None,
    **fields: object,
) -> TrainingRequest:
    """What `frenzy plan` asks the allocator, validated as a training request (it names no
    dataset: the allocator reads none), so that bad values get the same one-line errors as in a flow."""
    return TrainingRequest(
        model=model,
        dataset="-",
        global_batch=global_batch,
        seq_len=seq_len,
        precision=precision,
        attention=attention,
        master_weights=master_weights,
        optimizer={"name": optimizer},
        plan=pin,
        **({"steps": 1} | fields),
    )


def gpu_type(name: str):
    """A catalog GPU type by name (case and punctuation ignored, as in cluster files), or a
    one-line error naming the close and the known ones."""
    from frenzy_prefect.spec.catalog import GPU_CATALOG, catalog_type, type_key
    from frenzy_prefect.spec.names import did_you_mean

    found = catalog_type(name, GPU_CATALOG)
    if found is None:
        raise FrenzyError(f"unknown GPU type {name!r}{did_you_mean(name, GPU_CATALOG, key=type_key)}; known: {', '.join(GPU_CATALOG)}")
    return GPU_CATALOG[found]
