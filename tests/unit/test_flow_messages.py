"""What a run says of a cause the flows can name: one line as its state message, and one line in
its log, not Prefect's tracebacks of it."""

import logging
import sys

from prefect.exceptions import FailedRun

from frenzy_prefect.errors import DatasetError
from frenzy_prefect.flows.error_records import without_tracebacks_of_named_causes
from frenzy_prefect.flows.tasks import ended_message


def test_a_training_runs_end_is_one_line_naming_its_cause():
    exception = "Flow run encountered an exception: StorageUnreachable: s3://b/x did not answer\nTraceback ...\n  more"
    assert (
        ended_message("crafty-otter", "Failed", exception)
        == "training run crafty-otter failed: StorageUnreachable: s3://b/x did not answer"
    )
    crash = "rank 1 on a10-node (pid 7) was killed by SIGKILL"
    assert ended_message("crafty-otter", "Crashed", crash) == f"training run crafty-otter crashed: {crash}"
    assert ended_message("crafty-otter", "Crashed", None) == "training run crafty-otter crashed: no reason given"
    assert len(ended_message("x", "Failed", "y" * 2000)) == 500


def records_about(exc: BaseException, logger: str, message: str = "Encountered exception: {exc!r}") -> logging.LogRecord:
    make = without_tracebacks_of_named_causes(logging.LogRecord)
    try:
        raise exc
    except BaseException:
        return make(logger, logging.ERROR, __file__, 1, message.format(exc=exc), None, sys.exc_info())


def test_prefects_records_of_a_named_cause_lose_their_traceback_and_a_bugs_keep_it():
    assert records_about(DatasetError("dataset s3://b/x does not exist"), "prefect.task_runs").exc_info is None
    assert records_about(RuntimeError("a bug"), "prefect.flow_runs").exc_info is not None
    assert records_about(DatasetError("ours"), "frenzy_prefect.flows").exc_info is not None  # (the project's own logs say what they mean)
    returned = records_about(FailedRun("dataset s3://b/x does not exist"), "prefect.flow_runs")  # a Failed state the flow returned
    assert returned.exc_info is None
    assert returned.getMessage() == "Encountered exception: FailedRun('dataset s3://b/x does not exist')"  # (said already: kept as is)
    unsaid = records_about(
        FailedRun("dataset s3://b/x does not exist"), "prefect.flow_engine", "Engine execution exited with unexpected exception"
    )
    assert unsaid.getMessage() == "Engine execution exited with unexpected exception: FailedRun: dataset s3://b/x does not exist"
