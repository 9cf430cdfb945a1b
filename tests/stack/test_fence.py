"""One generation of a run's attempts at a time (training.fence) on S3, moto's server: the head's
conditional PUTs (If-Match, If-None-Match: *), claims, commits, prunes and the watch; the same
cases as tests/unit/test_fence.py's on a local prefix."""

from __future__ import annotations

import uuid

import pytest

from tests.support.fence import CASES
from tests.support.stack import BUCKET


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_the_fence_on_s3(case, s3, monkeypatch):
    case(f"s3://{BUCKET}/fence/{case.__name__}-{uuid.uuid4().hex[:8]}", monkeypatch)
