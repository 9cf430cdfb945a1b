"""Datasets and object storage through a real S3 endpoint (moto's server) and s3fs."""

import threading

import pytest

from frenzy_prefect.errors import FrenzyError, StorageUnreachable
from frenzy_prefect.profiling.token_sample import BLOCK_BYTES, BLOCKS, EDGE_BYTES, sample_ranges
from frenzy_prefect.spec.dataset import TokenFile
from frenzy_prefect.storage import CHECKPOINT_WRITE_TIMEOUT_ENV, Bounds, Deadline, stall_bound_s
from tests.support.storage import SHORT_BOUNDS


def test_the_id_sample_is_the_same_size_for_a_file_of_100_gb():
    def sampled(tokens: int) -> int:
        return sum(n for _, _, n in sample_ranges((TokenFile(uri="s3://b/x.bin", tokens=tokens),), 2))

    bound = (2 * EDGE_BYTES + BLOCKS * BLOCK_BYTES) // 2
    assert sampled(50 * 10**9) == sampled(5 * 10**9) == bound
    assert sampled(1000) == 16 * 1000 + 2 * 1000  # a small file: its ranges overlap (merged when read)


def test_the_request_bounds_come_from_the_environment_and_bad_ones_are_refused_in_one_line(monkeypatch):
    assert Bounds.from_env() == Bounds() and stall_bound_s() == 3 * 17 + 1 + 2  # a frozen peer drops a send after 2 x 8 + 1 s
    for name, value in SHORT_BOUNDS.items():
        monkeypatch.setenv(name, value)
    assert Bounds.from_env() == Bounds(connect_s=2, read_s=3, send_s=2, attempts=2) and stall_bound_s() == 2 * 5 + 1
    monkeypatch.setenv("FRENZY_S3_ATTEMPTS", "two")
    with pytest.raises(FrenzyError, match=r"^FRENZY_S3_ATTEMPTS='two' is not a whole number > 0 \(unset, it is 3\)$"):
        Bounds.from_env()


def test_a_write_past_its_bound_says_whether_the_bound_was_set_or_the_default(monkeypatch):
    stalled = threading.Event()
    try:
        monkeypatch.delenv(CHECKPOINT_WRITE_TIMEOUT_ENV, raising=False)
        with pytest.raises(StorageUnreachable, match=rf"its bound \(0.2 s by default; {CHECKPOINT_WRITE_TIMEOUT_ENV} sets another\)$"):
            Deadline("s3://b/x", 0.2, "writing the checkpoint").run(stalled.wait)
        monkeypatch.setenv(CHECKPOINT_WRITE_TIMEOUT_ENV, " 0.2 ")
        with pytest.raises(StorageUnreachable, match=rf"its bound \({CHECKPOINT_WRITE_TIMEOUT_ENV}=0.2\)$"):
            Deadline("s3://b/x", 0.2, "writing the checkpoint").run(stalled.wait)
    finally:
        stalled.set()
