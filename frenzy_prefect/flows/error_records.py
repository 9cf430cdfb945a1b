"""A cause the flows can name (a FrenzyError: bad input, missing data, no plan that fits, a
training run's failure) is one line in a run's log, not four Prefect tracebacks.

Prefect's engines log a task's or flow's exception with its traceback at each level it passes
(the task engine, the flow engine, the engine's entry point), each record's message already
holding the exception's text. For a FrenzyError the traceback shows only the way Prefect called
the code: records of Prefect's own loggers about one lose it, and so do those about the Failed
state a flow returns with such a cause as its message. Any other exception (a bug) keeps its
traceback."""

from __future__ import annotations

import logging

from prefect.exceptions import FailedRun

from frenzy_prefect.errors import FrenzyError


def _named_cause(exc_info: object) -> BaseException | None:
    """The exception of ``exc_info`` when it names its cause: a FrenzyError, or Prefect's
    FailedRun, raised reading a Failed state a flow returned (its message is the cause)."""
    exc = exc_info[1] if isinstance(exc_info, tuple) and len(exc_info) == 3 else None
    return exc if isinstance(exc, (FrenzyError, FailedRun)) else None


def without_tracebacks_of_named_causes(factory: logging.LogRecordFactory) -> logging.LogRecordFactory:
    """``factory``, making records of the ``prefect`` loggers about a named cause one line: no
    traceback, the cause said in the message where it is not already."""

    def make(*args: object, **kwargs: object) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        if record.name.split(".")[0] == "prefect" and (exc := _named_cause(record.exc_info)) is not None:
            record.exc_info, record.exc_text = None, None
            if str(exc) not in record.getMessage():
                record.msg, record.args = f"{record.getMessage()}: {type(exc).__name__}: {exc}", None
        return record

    make.frenzy_quiets_named_causes = True  # type: ignore[attr-defined]
    return make


def quiet_named_causes() -> None:
    """Install the record factory in this process (once)."""
    factory = logging.getLogRecordFactory()
    if not getattr(factory, "frenzy_quiets_named_causes", False):
        logging.setLogRecordFactory(without_tracebacks_of_named_causes(factory))
