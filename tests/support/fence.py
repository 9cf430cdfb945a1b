"""The fence's cases (training.fence), each run on a checkpoint prefix of a real store: a local
path in tests/unit/test_fence.py, moto's S3 server in tests/stack/test_fence.py. Each case
takes a fresh prefix and pytest's monkeypatch."""

from __future__ import annotations

import time

import pytest

from frenzy_prefect.storage import WriteConflict, filesystem, read_versioned, write_if
from frenzy_prefect.training import fence
from frenzy_prefect.training.checkpoint import prune
from frenzy_prefect.training.fence import Fenced, FenceWatch, Superseded, claim, commit
from frenzy_prefect.training.manifest import HEAD, MANIFEST, METADATA, Committed, head_uri, step_uri

KEEP = 3


def _dirs(prefix: str) -> list[str]:
    fs, path = filesystem(prefix)
    fs.invalidate_cache()
    return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(path, detail=False) if "step-" in e)


def _checkpoint(prefix: str, step: int, generation: int, manifest: bytes = b"{}") -> str:
    """A checkpoint's directory as a save leaves it (what is in its files does not matter here)."""
    uri = step_uri(prefix, step, generation)
    fs, path = filesystem(uri)
    fs.makedirs(path, exist_ok=True)
    fs.pipe_file(f"{path}/{METADATA}", b"index")
    fs.pipe_file(f"{path}/{MANIFEST}", manifest)
    return uri


def _saved(held: fence.Fence, step: int):
    """Step ``step``'s checkpoint written and committed by ``held``, then pruned, as
    checkpoint.save does after DCP's files; returns the head written."""
    _checkpoint(held.prefix, step, held.generation)
    head = commit(held, step, KEEP)
    prune(held, head)
    return head


def a_newer_claim_fences_the_older_generations_commit(prefix: str, monkeypatch) -> None:
    first = claim(prefix, (1, 0, 0))
    assert first.generation == 1
    _saved(first, 3)
    second = claim(prefix, (1, 1, 0))
    assert (second.generation, second.committed) == (2, [Committed(step=3, generation=1)])
    before = read_versioned(head_uri(prefix))
    _checkpoint(prefix, 6, 1)
    with pytest.raises(Fenced, match=r"^generation 1 stops at step 6: its checkpoint of step 6 is refused: generation 2 "):
        commit(first, 6, KEEP)
    assert read_versioned(head_uri(prefix)) == before  # body and version
    assert _dirs(prefix) == ["step-000003", "step-000006"]  # the refused one is named by no head


def an_older_generations_prune_spares_the_newer_ones_checkpoints(prefix: str, monkeypatch) -> None:
    first = claim(prefix, None)
    _saved(first, 2)
    last_head = _saved(first, 4)
    second = claim(prefix, None)  # takes over [4, 2]
    _checkpoint(prefix, 6, 2)  # written, not yet committed
    _checkpoint(prefix, 5, 1)  # the older generation's write, whose commit the takeover refuses
    prune(first, last_head)  # the older generation's prune after its commit of step 4, overlapping the takeover
    assert _dirs(prefix) == ["step-000002", "step-000004", "step-000006-g2"]
    head = _saved(second, 6)
    assert head.committed == [Committed(step=6, generation=2), Committed(step=4, generation=1), Committed(step=2, generation=1)]
    _saved(second, 8)
    assert _dirs(prefix) == ["step-000004", "step-000006-g2", "step-000008-g2"]


def attempts_claim_in_order(prefix: str, monkeypatch) -> None:
    claim(prefix, (5, 0, 0))
    assert claim(prefix, (5, 1, 0)).generation == 2  # the new Slurm job
    with pytest.raises(Superseded, match=r"^attempt 5\.0\.1 does not start: generation 2 \(attempt 5\.1\.0\) holds the run$"):
        claim(prefix, (5, 0, 1))  # the old job's torchrun restart
    assert claim(prefix, (5, 1, 0)).generation == 2  # the one a watcher claimed for it: adopted
    assert claim(prefix, (6, 0, 0)).generation == 3  # a later launch
    assert claim(prefix, None).generation == 4  # no key: claims
    assert claim(prefix, (1, 0, 0)).generation == 5  # ... and is outranked by any key


def a_claim_whose_answer_was_lost_finds_its_own_write(prefix: str, monkeypatch) -> None:
    real = fence.write_if

    def landed_but_answered_412(uri: str, data: bytes, etag: str | None) -> str:
        real(uri, data, etag)  # the first try landed; its answer was lost, and the retry found it changed
        raise WriteConflict(f"{uri} changed since it was read")

    monkeypatch.setattr(fence, "write_if", landed_but_answered_412)
    assert claim(prefix, None).generation == 1
    monkeypatch.setattr(fence, "write_if", real)
    assert claim(prefix, None).generation == 2  # no generation spent twice


def commits_of_one_generation_interleaved_both_land(prefix: str, monkeypatch) -> None:
    held = claim(prefix, None)
    survivor = fence.Fence(prefix, held.generation, held.claimed_at)  # ReCycle: another member commits
    real, interleaved = fence.read_head, []

    def read_then_commit_beside(at: str):
        found = real(at)
        if not interleaved:
            interleaved.append(True)
            commit(survivor, 4, KEEP)  # lands between this commit's read and write
        return found

    monkeypatch.setattr(fence, "read_head", read_then_commit_beside)
    head = commit(held, 5, KEEP)
    assert [c.step for c in head.committed] == [5, 4]


def a_prefix_without_a_head_commits_its_complete_checkpoints(prefix: str, monkeypatch) -> None:
    _checkpoint(prefix, 3, 1)
    _checkpoint(prefix, 6, 2)
    fs, path = filesystem(step_uri(prefix, 9, 1))
    fs.makedirs(path, exist_ok=True)
    fs.pipe_file(f"{path}/__0_0.distcp", b"torn")  # no manifest
    held = claim(prefix, None)
    assert held.generation == 3
    assert held.committed == [Committed(step=6, generation=2), Committed(step=3, generation=1)]


def conditional_writes_refuse_a_stale_version(prefix: str, monkeypatch) -> None:
    uri = f"{prefix}/{HEAD}"
    first = write_if(uri, b"one", None)
    with pytest.raises(WriteConflict):
        write_if(uri, b"two", None)  # exists
    second = write_if(uri, b"two", first)
    with pytest.raises(WriteConflict):
        write_if(uri, b"three", first)  # stale
    assert read_versioned(uri) == (b"two", second)
    with pytest.raises(WriteConflict):
        write_if(f"{prefix}/gone.json", b"x", second)  # no object of that version
    assert read_versioned(f"{prefix}/gone.json") is None


def the_watch_sees_a_newer_generation(prefix: str, monkeypatch) -> None:
    held = claim(prefix, None)
    watch = FenceWatch(held, 0.01)
    try:
        time.sleep(0.1)
        assert watch.holder is None
        claim(prefix, None)
        deadline = time.monotonic() + 30
        while watch.holder is None:
            assert time.monotonic() < deadline, "the watch never saw generation 2"
            time.sleep(0.01)
        assert watch.holder.generation == 2
    finally:
        watch.stop()


CASES = [
    a_newer_claim_fences_the_older_generations_commit,
    an_older_generations_prune_spares_the_newer_ones_checkpoints,
    attempts_claim_in_order,
    a_claim_whose_answer_was_lost_finds_its_own_write,
    commits_of_one_generation_interleaved_both_land,
    a_prefix_without_a_head_commits_its_complete_checkpoints,
    conditional_writes_refuse_a_stale_version,
    the_watch_sees_a_newer_generation,
]
