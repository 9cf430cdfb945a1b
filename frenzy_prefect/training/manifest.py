"""Which checkpoints under a run's prefix are complete and intact, read from their manifests
without torch: resume and prune (``checkpoint``) and the Slurm watcher, which names the step a
restarted job resumes from, read them. A checkpoint is complete when its manifest exists, intact
when that manifest reads and DCP's index of the pieces is beside it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime

from pydantic import BaseModel, Field, ValidationError

from frenzy_prefect.errors import FrenzyError, describe_validation_error
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.storage import filesystem, reaching

MANIFEST = "manifest.json"
METADATA = ".metadata"  # DCP's index of every rank's pieces, written after all of them


class CorruptCheckpoint(FrenzyError):
    """A checkpoint whose manifest exists but does not read, or lacks DCP's index: resume skips it."""


class Manifest(BaseModel):
    """What marks a checkpoint complete, and what resuming needs beside the tensors."""

    step: int
    plan: ParallelPlan
    model: ModelSpec
    written_at: datetime
    save_s: float
    losses: list[float] = Field(description="Mean loss of each step so far, for the run's result.")


def step_uri(prefix: str, step: int) -> str:
    return f"{prefix.rstrip('/')}/step-{step:06d}"


def step_of(uri: str) -> int:
    """The step of a checkpoint's URI or directory name (``step_uri``'s inverse)."""
    return int(uri.rsplit("/", 1)[-1].removeprefix("step-"))


def _step_files(prefix: str) -> dict[int, set[str]]:
    """The names of the files in each step directory under ``prefix``, by step (one listing)."""
    fs, path = filesystem(prefix)
    root = path.rstrip("/")
    with reaching(prefix):
        fs.invalidate_cache()  # s3fs caches listings (a directory's too, which its parent's invalidation keeps); other ranks write here
        found = fs.find(root)
    steps: dict[int, set[str]] = {}
    for file in found:
        folder, _, name = file.removeprefix(f"{root}/").partition("/")
        if folder.removeprefix("step-").isdigit() and name and "/" not in name:
            steps.setdefault(step_of(folder), set()).add(name)
    return steps


def complete_checkpoints(prefix: str) -> list[str]:
    """The complete checkpoints under ``prefix`` (those with a manifest), oldest first."""
    return [step_uri(prefix, step) for step, names in sorted(_step_files(prefix).items()) if MANIFEST in names]


def _intact_manifest(uri: str, names: set[str]) -> Manifest:
    """The manifest of the checkpoint at ``uri``, whose directory holds the files ``names``;
    CorruptCheckpoint, naming the file, if it does not parse, is of another step than its
    directory's, or DCP's index of the pieces is missing."""
    manifest_uri = f"{uri}/{MANIFEST}"
    if METADATA not in names:
        raise CorruptCheckpoint(f"it has a manifest but no {METADATA} (DCP's index of the pieces, written before the manifest)")
    fs, path = filesystem(manifest_uri)
    with reaching(manifest_uri):
        raw = fs.cat_file(path)
    try:
        manifest = Manifest.model_validate_json(raw)
    except ValidationError as exc:
        raise CorruptCheckpoint(f"its manifest {manifest_uri} is corrupt: {describe_validation_error(exc)}") from None
    if manifest.step != step_of(uri):
        raise CorruptCheckpoint(f"its manifest {manifest_uri} is of step {manifest.step}, not of its directory's step {step_of(uri)}")
    return manifest


def intact_checkpoints(prefix: str, warn: Callable[[str], None] = lambda _: None) -> Iterator[tuple[str, Manifest]]:
    """The intact checkpoints under ``prefix`` with their manifests, newest first: the complete
    ones whose manifest reads (``_intact_manifest``). Each complete one that is not is skipped,
    named to ``warn``; a torn one (no manifest) is skipped silently, as a crash leaves it."""
    for step, names in sorted(_step_files(prefix).items(), reverse=True):
        if MANIFEST not in names:
            continue
        uri = step_uri(prefix, step)
        try:
            manifest = _intact_manifest(uri, names)
        except CorruptCheckpoint as exc:
            warn(f"warning: skipping the checkpoint at {uri}: {exc}")
            continue
        yield uri, manifest


def latest(prefix: str, warn: Callable[[str], None] = lambda _: None) -> tuple[str, Manifest] | None:
    """The newest intact checkpoint under ``prefix`` and its manifest, or None; newer ones that
    are corrupt are named to ``warn`` (``intact_checkpoints``)."""
    return next(intact_checkpoints(prefix, warn), None)
