"""One attempt of a run trains it at a time: attempts are fenced by the run's checkpoint prefix.

A run can have two attempts alive at once: the ranks of a node Slurm declared failed (its slurmd
dead, the ranks not) while the replacement job trains, a Kubernetes node that comes back, an SSH
host cut off while a retry runs. Each attempt therefore *claims* the run before it resumes: it
takes the next **generation** in the prefix's head (``head.json``, manifest.Head) by a
conditional write of the version it read. From then on the storage decides, not the old ranks'
goodwill: a checkpoint is committed only by a conditional write of the head that still names
the writer's generation, so an older generation's commit fails however late it lands. Each
generation writes into directories of its own (manifest.step_uri), prunes only after its own
commit and never a newer generation's directories, and the next generation resumes from the
head's committed checkpoints, never from a listing. An older generation finds out at its next
commit, or sooner from ``FenceWatch`` (rank 0 reads the head every FRENZY_FENCE_POLL_S), and
stops: rank 0 logs one line and every rank exits 0, so that torchrun restarts nothing.

Attempts are ordered by ``attempt_key``: (when the worker launched the run, its launcher's
submission, torchrun's restart). A claim by an attempt older than the head's is refused
(Superseded): the old Slurm job's torchrun restart cannot take the run back from the new job.
An attempt without a key (a direct ``train()``) claims whatever the head says, and any attempt
with a key claims over it. Torch-free: the watchers that restart a run on another node claim for
the new job (``claim``), whose rank 0 then adopts the generation claimed for its key.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from frenzy_prefect.errors import FrenzyError, exception_chain
from frenzy_prefect.storage import WriteConflict, write_if
from frenzy_prefect.training.manifest import Committed, Head, complete_checkpoints, generation_of, head_uri, read_head, step_of, step_uri

ATTEMPT_ENV = "FRENZY_ATTEMPT"  # "B.J": when the worker launched the run (ms), the launcher's submission (0, 1, ...)
POLL_ENV = "FRENZY_FENCE_POLL_S"
POLL_S = 2.0
TRIES = 10  # conditional writes in a row that lose to another writer before a claim or commit gives up


class Fenced(FrenzyError):
    """A newer generation holds the run: this attempt's ranks stop (exit 0), committing nothing more."""


class Superseded(Fenced):
    """This attempt is older than the one holding the run: it does not start."""


def attempt_key(env: Mapping[str, str] = os.environ) -> tuple[int, int, int] | None:
    """This attempt's place in the run's order: (B, J, torchrun's restart count), or None."""
    raw = env.get(ATTEMPT_ENV, "").strip()
    if not raw:
        return None
    parts = raw.split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise FrenzyError(f"{ATTEMPT_ENV}={raw!r} is not an attempt: its launcher sets B.J (two whole numbers)")
    return int(parts[0]), int(parts[1]), int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def first_attempt() -> str:
    """ATTEMPT_ENV for a training flow run's launch: the time of it (ms; a later launch of the
    run, or of a retry's new flow run, outranks it), submission 0."""
    return f"{time.time_ns() // 1_000_000}.0"


def next_submission(raw: str) -> str:
    """ATTEMPT_ENV for a launcher's next submission of the run (B.J -> B.J+1)."""
    first, second = raw.split(".")
    return f"{first}.{int(second) + 1}"


def shown(key: tuple[int, ...] | list[int] | None) -> str:
    return "without an attempt key" if key is None else "attempt " + ".".join(map(str, key))


def _at(head: Head) -> str:
    return head.claimed_at.astimezone(UTC).strftime("%H:%M:%SZ")


@dataclass
class Fence:
    """This attempt's hold on the run: its generation and, from its claim, the checkpoints it
    resumes from (newest first). Every rank holds the same; rank 0 (the process group's)
    commits."""

    prefix: str
    generation: int
    claimed_at: datetime
    committed: list[Committed] = field(default_factory=list)
    skipped: set[tuple[int, int]] = field(default_factory=set)  # committed ones resume found not intact
    decided_at: datetime | None = None  # when rank 0 sent its last commit

    def uris(self) -> list[str]:
        return [step_uri(self.prefix, c.step, c.generation) for c in self.committed]

    def skip(self, uri: str) -> None:
        """Leave the checkpoint at ``uri`` (not intact) out of the next commit's list."""
        self.skipped.add((step_of(uri), generation_of(uri)))

    def stopped(self, step: int, head: Head, refused: bool = False) -> str:
        """The line a fenced attempt's rank 0 logs."""
        what = f"its checkpoint of step {step} is refused: " if refused else ""
        return (
            f"generation {self.generation} stops at step {step}: {what}generation {head.generation} "
            f"({shown(head.attempt)}) took the run over at {_at(head)}"
        )


def claim(prefix: str, key: tuple[int, int, int] | None) -> Fence:
    """Take the next generation of the run at ``prefix`` for the attempt ``key``; or the one a
    watcher claimed for it (the head names ``key``). Superseded if a newer attempt holds it."""
    for _ in range(TRIES):
        found = read_head(prefix)
        head, etag = found if found is not None else (_first_head(prefix), None)
        if key is not None and head.attempt is not None:
            if key < tuple(head.attempt):
                raise Superseded(f"{shown(key)} does not start: generation {head.generation} ({shown(head.attempt)}) holds the run")
            if key == tuple(head.attempt):
                return Fence(prefix, head.generation, head.claimed_at, list(head.committed))
        mine = head.model_copy(
            update={
                "generation": head.generation + 1,
                "attempt": None if key is None else list(key),
                "claimed_at": datetime.now(UTC),
                "nonce": uuid.uuid4().hex,
            }
        )
        if _written(prefix, mine, etag):
            return Fence(prefix, mine.generation, mine.claimed_at, list(mine.committed))
    raise FrenzyError(f"could not claim the run at {prefix}: {head_uri(prefix)} changed under each of {TRIES} tries")


def _first_head(prefix: str) -> Head:
    """The head before any claim: a prefix written before heads existed commits its complete
    checkpoints, and the generation after the newest that wrote any (generation 0 before none)."""
    complete = complete_checkpoints(prefix)[::-1]
    committed = [Committed(step=step_of(u), generation=generation_of(u)) for u in complete]
    newest = max((c.generation for c in committed), default=0)
    return Head(generation=newest, attempt=None, claimed_at=datetime.now(UTC), nonce="", committed=committed)


def _written(prefix: str, head: Head, etag: str | None) -> bool:
    """Whether ``head`` is now the prefix's head: written over version ``etag``, or found there
    when the write was refused (its first try landed, and its answer was lost)."""
    try:
        write_if(head_uri(prefix), head.model_dump_json(indent=2).encode(), etag)
        return True
    except WriteConflict:
        now = read_head(prefix)
        return now is not None and now[0].nonce == head.nonce


def commit(fence: Fence, step: int, keep: int) -> Head:
    """Commit step ``step``'s checkpoint (its manifest written) as the newest of the run, keeping
    the ``keep`` newest committed in the head; returns the head written. Fenced, with nothing
    written, once another generation holds the run."""
    fence.decided_at = datetime.now(UTC)  # before the write: the storage decides after it
    for _ in range(TRIES):
        found = read_head(fence.prefix)
        if found is None:
            raise FrenzyError(f"{head_uri(fence.prefix)} is gone: generation {fence.generation} cannot commit step {step}")
        head, etag = found
        if head.generation != fence.generation:
            raise Fenced(fence.stopped(step, head, refused=True))
        this = Committed(step=step, generation=fence.generation)
        older = [c for c in head.committed if c != this and (c.step, c.generation) not in fence.skipped]
        mine = head.model_copy(update={"committed": [this, *older][:keep], "nonce": uuid.uuid4().hex})
        if _written(fence.prefix, mine, etag):
            return mine
    raise FrenzyError(f"could not commit step {step} at {fence.prefix}: {head_uri(fence.prefix)} changed under each of {TRIES} tries")


def newer_holder(fence: Fence) -> Head | None:
    """The head, if another generation holds the run now."""
    found = read_head(fence.prefix)
    return found[0] if found is not None and found[0].generation != fence.generation else None


def fenced_in(exc: BaseException) -> Fenced | None:
    """The Fenced that ``exc`` is or comes from (a peer's PeerFailed raised from it), if any."""
    return next((e for e in exception_chain(exc) if isinstance(e, Fenced)), None)


def poll_s() -> float:
    raw = os.environ.get(POLL_ENV, "").strip()
    try:
        value = float(raw) if raw else POLL_S
    except ValueError:
        value = 0
    if not value > 0:
        raise FrenzyError(f"{POLL_ENV}={raw!r} is not a number of seconds > 0 (unset, it is {POLL_S:g})")
    return value


class FenceWatch:
    """Rank 0's look at the head every ``poll_s``, in a thread of its own: ``holder`` is the head
    of the newer generation once one has claimed the run (the trainer stops at the next step).
    A read that fails is passed over: the next commit meets the storage anyway."""

    def __init__(self, fence: Fence, poll_s: float, read: Callable[[Fence], Head | None] = newer_holder) -> None:
        self.holder: Head | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(fence, poll_s, read), name="frenzy-fence", daemon=True)
        self._thread.start()

    def _watch(self, fence: Fence, poll_s: float, read: Callable[[Fence], Head | None]) -> None:
        while not self._stop.wait(poll_s):
            try:
                self.holder = read(fence)
            except Exception:  # (unreachable storage: the run's own reads and writes report it)
                continue
            if self.holder is not None:
                return

    def stop(self) -> None:
        self._stop.set()
