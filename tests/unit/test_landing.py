"""Runs when data lands (issue 17, part 2): `watch-datasets` announces each new version of a raw
dataset once its files stand still, and `frenzy deploy --on-new-data --approve` turns each
announcement into exactly one train-llm run, which prepares the version, plans and waits for
approval, on the real Prefect server, worker and moto S3."""

from __future__ import annotations

import pytest

from frenzy_prefect.datasets.landing import Watch, observe

pytestmark = pytest.mark.pipelines


def test_a_version_is_announced_once_after_it_stood_still_for_the_settle_time():
    watch, landed = observe(Watch(), "v1", now=0.0, settle_s=10)
    assert not landed and watch.fingerprint == "v1"
    watch, landed = observe(watch, "v1", now=5.0, settle_s=10)
    assert not landed  # not settled yet
    watch, landed = observe(watch, "v2", now=9.0, settle_s=10)  # another part arrived: the clock starts again
    assert not landed and watch.since == 9.0
    watch, landed = observe(watch, "v2", now=19.5, settle_s=10)
    assert landed and watch.announced == "v2"
    watch, landed = observe(watch, "v2", now=60.0, settle_s=10)
    assert not landed  # once
    assert not observe(Watch(), None, now=100.0, settle_s=0)[1]  # nothing there: nothing to announce
