"""What a run's checkpoint prefix holds, read without torch: the checkpoints' directories and
manifests, and the head (``head.json``) that names the committed ones. Resume, prune
(``checkpoint``), the fence (``fence``) and the watchers that restart a run on another node read
them. A checkpoint is complete when its manifest exists, intact when that manifest reads and
DCP's index of the pieces is beside it, committed when the head names it: only a committed one
is resumed from (``latest``). A prefix written before the head existed has none: its complete
checkpoints count as committed until the first attempt that claims it writes one."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from datetime import datetime

from pydantic import BaseModel, Field, ValidationError

from frenzy_prefect.errors import FrenzyError, describe_validation_error
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.storage import filesystem, reaching, read_versioned

MANIFEST = "manifest.json"
METADATA = ".metadata"  # DCP's index of every rank's pieces, written after all of them
HEAD = "head.json"
_STEP_DIR = re.compile(r"step-(\d+)(?:-g(\d+))?")


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
    generation: int = Field(default=1, description="The generation of the run's attempts that wrote it (fence.py).")


class Committed(BaseModel):
    """A committed checkpoint: its step and the generation that wrote it (its directory)."""

    step: int
    generation: int


class Head(BaseModel):
    """``head.json``: which generation holds the run, and the checkpoints committed, newest
    first. Written only by a conditional write of the version read (fence.py)."""

    generation: int = Field(description="The generation that holds the run: the last to claim it.")
    attempt: list[int] | None = Field(description="The attempt that claimed it (fence.attempt_key), or None: any attempt outranks it.")
    claimed_at: datetime
    nonce: str = Field(description="Of the last write: a writer whose answer was lost finds out whether it landed.")
    committed: list[Committed] = Field(default_factory=list)


def step_uri(prefix: str, step: int, generation: int = 1) -> str:
    """The directory of step ``step``'s checkpoint by ``generation``: ``step-000400`` (the first
    generation), ``step-000400-g2`` (a later one: two generations never write the same object)."""
    return f"{prefix.rstrip('/')}/step-{step:06d}" + (f"-g{generation}" if generation > 1 else "")


def _parsed(uri: str) -> re.Match | None:
    return _STEP_DIR.fullmatch(uri.rstrip("/").rsplit("/", 1)[-1])


def step_of(uri: str) -> int:
    """The step of a checkpoint's URI or directory name (``step_uri``'s inverse)."""
    return int(_parsed(uri).group(1))


def generation_of(uri: str) -> int:
    """The generation that wrote the checkpoint at a URI or directory name."""
    return int(_parsed(uri).group(2) or 1)


def is_step_dir(name: str) -> bool:
    return _parsed(name) is not None


def head_uri(prefix: str) -> str:
    return f"{prefix.rstrip('/')}/{HEAD}"


def read_head(prefix: str) -> tuple[Head, str] | None:
    """The head of the run's prefix and its version tag, or None (no attempt has claimed it)."""
    found = read_versioned(head_uri(prefix))
    if found is None:
        return None
    raw, etag = found
    try:
        return Head.model_validate_json(raw), etag
    except ValidationError as exc:
        raise FrenzyError(f"{head_uri(prefix)} is corrupt: {describe_validation_error(exc)}") from None


def _step_files(prefix: str) -> dict[str, set[str]]:
    """The names of the files in each step directory under ``prefix``, by directory (one listing)."""
    fs, path = filesystem(prefix)
    root = path.rstrip("/")
    with reaching(prefix):
        fs.invalidate_cache()  # s3fs caches listings (a directory's too, which its parent's invalidation keeps); other ranks write here
        found = fs.find(root)
    folders: dict[str, set[str]] = {}
    for file in found:
        folder, _, name = file.removeprefix(f"{root}/").partition("/")
        if is_step_dir(folder) and name and "/" not in name:
            folders.setdefault(folder, set()).add(name)
    return folders


def complete_checkpoints(prefix: str) -> list[str]:
    """The complete checkpoints under ``prefix`` (those with a manifest), committed or not, oldest
    first (by step, then generation)."""
    complete = [folder for folder, names in _step_files(prefix).items() if MANIFEST in names]
    return [f"{prefix.rstrip('/')}/{f}" for f in sorted(complete, key=lambda f: (step_of(f), generation_of(f)))]


def committed_checkpoints(prefix: str) -> list[str]:
    """The committed checkpoints under ``prefix``, newest first: those the head names, or in a
    prefix that has none yet, the complete ones."""
    found = read_head(prefix)
    if found is None:
        return complete_checkpoints(prefix)[::-1]
    return [step_uri(prefix, c.step, c.generation) for c in found[0].committed]


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


def intact(prefix: str, uris: list[str], warn: Callable[[str], None] = lambda _: None) -> Iterator[tuple[str, Manifest]]:
    """Of the checkpoints ``uris`` under ``prefix`` (committed ones), in their order, those that
    are intact, with their manifests (``_intact_manifest``); each one that is not is skipped,
    named to ``warn``."""
    files = _step_files(prefix)
    for uri in uris:
        names = files.get(uri.rstrip("/").rsplit("/", 1)[-1], set())
        try:
            if MANIFEST not in names:
                raise CorruptCheckpoint("its manifest is missing")
            manifest = _intact_manifest(uri, names)
        except CorruptCheckpoint as exc:
            warn(f"warning: skipping the checkpoint at {uri}: {exc}")
            continue
        yield uri, manifest


def intact_checkpoints(prefix: str, warn: Callable[[str], None] = lambda _: None) -> Iterator[tuple[str, Manifest]]:
    """The intact committed checkpoints under ``prefix`` with their manifests, newest first."""
    return intact(prefix, committed_checkpoints(prefix), warn)


def latest(prefix: str, warn: Callable[[str], None] = lambda _: None) -> tuple[str, Manifest] | None:
    """The newest intact committed checkpoint under ``prefix`` and its manifest, or None; newer
    ones that are corrupt are named to ``warn`` (``intact``)."""
    return next(intact_checkpoints(prefix, warn), None)
