"""One generation of a run's attempts at a time (training.fence), on a local checkpoint prefix: the
head's conditional writes (a lock file and an atomic rename), claims, commits, prunes and the
watch; resume from the committed checkpoints. tests/stack/test_fence.py runs the same cases on
S3 (moto's server)."""

from __future__ import annotations

import pytest

from frenzy_prefect.spec.plan import ParallelPlan, Placement
from frenzy_prefect.training.fence import ATTEMPT_ENV, POLL_ENV, attempt_key, claim, commit, next_submission, poll_s
from frenzy_prefect.training.manifest import Committed, committed_checkpoints, step_uri
from frenzy_prefect.training.trainer import resume
from tests.support.fence import CASES, _checkpoint, _dirs, _saved
from tests.support.training import make_job, unchecked


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_the_fence_on_a_local_prefix(case, tmp_path, monkeypatch):
    case(str(tmp_path / "checkpoints"), monkeypatch)


def test_the_attempt_key_comes_from_the_launcher_and_torchrun_and_a_bad_one_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv(POLL_ENV, "soon")
    with pytest.raises(ValueError, match=r"^FRENZY_FENCE_POLL_S='soon' is not a number of seconds > 0 \(unset, it is 2\)$"):
        poll_s()
    assert attempt_key({}) is None
    assert attempt_key({ATTEMPT_ENV: "1700000000000.2", "TORCHELASTIC_RESTART_COUNT": "1"}) == (1700000000000, 2, 1)
    assert next_submission("1700000000000.2") == "1700000000000.3"
    with pytest.raises(ValueError, match=r"^FRENZY_ATTEMPT='x\.1' is not an attempt: its launcher sets B\.J \(two whole numbers\)$"):
        attempt_key({ATTEMPT_ENV: "x.1"})


def test_a_run_whose_every_committed_checkpoint_is_corrupt_says_it_starts_from_step_1_and_commits_past_them(tmp_path):
    job = make_job(unchecked(str(tmp_path / "data.bin")), str(tmp_path / "out"), ParallelPlan(), [Placement(node="n", host="h", gpus=[0])])
    prefix = job.checkpoint_uri
    for step in (3, 6):
        _checkpoint(prefix, step, 1, manifest=b'{"step": ')
    held = claim(prefix, None)
    lines: list[str] = []
    assert resume(job, None, lines.append, held) is None  # (no engine: nothing is loaded)
    assert [line.split(": ")[1] for line in lines[:2]] == [f"skipping the checkpoint at {step_uri(prefix, s)}" for s in (6, 3)]
    assert lines[2:] == [
        f"no intact checkpoint left among the 2 committed under {prefix}: training starts from step 1",
        "generation 2 takes the run over from generation 1: starting from step 1",
    ]
    _saved(held, 2)
    assert committed_checkpoints(prefix) == [step_uri(prefix, 2, 2)]
    assert _dirs(prefix) == ["step-000002-g2"]


def test_a_checkpoint_resume_passed_over_is_left_out_of_the_next_commit_so_it_displaces_no_intact_one(tmp_path):
    prefix = str(tmp_path / "checkpoints")
    held = claim(prefix, None)
    for step in (6, 9):
        _saved(held, step)
    again = claim(prefix, None)
    again.skip(step_uri(prefix, 9))  # what resume does with a corrupt one
    head = commit(again, 7, 2)  # keep_checkpoints=2
    assert head.committed == [Committed(step=7, generation=2), Committed(step=6, generation=1)]
