"""Who is alive in a ReCycle job, kept on the job's rendezvous store (hosted by torchrun's agent,
so it outlives any trainer).

- Every trainer process (a rank's *incarnation*: 0 at the start, 1, 2, ... for replacements)
  counts a heartbeat ``hb/<rank>/<incarnation>`` up every HEARTBEAT_S from a thread.
- The death log ``dead/<k>`` (``dead/count`` entries of "rank:incarnation") says which
  incarnations are gone. A rank's supervisor appends to it the moment its trainer exits
  abnormally (``waitpid``); the agent's watcher (``watch_job_heartbeats``) appends an incarnation
  whose heartbeat stood still for STALE_S (a hung process, or a node lost with its supervisor);
  the supervisor of a trainer declared dead kills it (``supervisor.py``), so a declared death
  is a real one and its sockets close.
- A finished trainer writes ``hb/<rank>/<incarnation>/done`` so the watcher stops watching it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

HEARTBEAT_S = 0.1
# A heartbeat this old means a dead (or hung) process. A live trainer's beat can stand still for
# a while on a crowded host: the thread needs the GIL from a main thread that the kernel has
# descheduled, and the store's agent answers late. Measured on 2 cores running 8 trainers beside
# 4 busy loops: gaps up to 1.05 s, during the trainer's imports and its store round trips (a 1 s
# threshold killed 2 or 3 of 4 healthy trainers at their start there). 5 s keeps a margin of ~5x
# over that, and a hung trainer is still dead to its peers long before the groups' 60 s timeout.
STALE_S = 5.0

Incarnation = tuple[int, int]  # (rank, incarnation)
INCARNATION_ENV = "FRENZY_INCARNATION"  # set for a trainer under a supervisor: which incarnation of its rank it is


def incarnation_from_env() -> int:
    return int(os.environ.get(INCARNATION_ENV, 0))


def _entry(incarnation: Incarnation) -> str:
    return f"{incarnation[0]}:{incarnation[1]}"


def _parse(entry: bytes) -> Incarnation:
    rank, number = entry.decode().split(":")
    return int(rank), int(number)


def append(store: dist.Store, log: str, incarnation: Incarnation) -> None:
    """Add ``incarnation`` to a log of entries on the store (``dead`` or ``rejoin``)."""
    k = store.add(f"{log}/count", 1)
    store.set(f"{log}/{k}", _entry(incarnation))


class Log:
    """A reader of a store log that remembers what it has read: ``new()`` returns the entries
    appended since the last call (one round trip when there are none)."""

    def __init__(self, store: dist.Store, name: str) -> None:
        self.store, self.name, self.read = store, name, 0

    def new(self) -> list[Incarnation]:
        count = self.store.add(f"{self.name}/count", 0)
        if count == self.read:
            return []
        keys = [f"{self.name}/{k}" for k in range(self.read + 1, count + 1)]
        self.store.wait(keys)  # appended: the count first, then the entry
        self.read = count
        return [_parse(v) for v in self.store.multi_get(keys)]


def mark_dead(store: dist.Store, incarnation: Incarnation) -> None:
    append(store, "dead", incarnation)


class Heartbeat:
    """A daemon thread that counts this incarnation's heartbeat up every HEARTBEAT_S on its own
    store connection (the trainer's may be busy in a wait)."""

    def __init__(self, connect: Callable[[], dist.Store], incarnation: Incarnation) -> None:
        self.key = f"hb/{incarnation[0]}/{incarnation[1]}"
        self.connect, self.incarnation, self.stopped = connect, incarnation, threading.Event()
        store = connect()
        store.add(self.key, 1)
        append(store, "hb", incarnation)  # the watcher learns of it
        self.thread = threading.Thread(target=self._beat, name="frenzy-heartbeat", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        store = self.connect()
        while not self.stopped.wait(HEARTBEAT_S):
            store.add(self.key, 1)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()
        self.connect().set(f"{self.key}/done", "1")


def watch_job_heartbeats(host: str, port: int, stop: threading.Event, stale_s: float = STALE_S) -> None:
    """Until ``stop``: mark dead every incarnation whose heartbeat stood still for ``stale_s``, in the
    store at ``host:port`` (the launcher's agent runs this beside the store it hosts), following
    torchrun's restarts (each attempt has its own keys)."""
    base = dist.TCPStore(host, port, is_master=False, timeout=timedelta(minutes=5))
    attempt = 0
    while not stop.is_set():
        following = dist.PrefixStore(f"attempt-{attempt + 1}", base)
        _watch_attempt(dist.PrefixStore(f"attempt-{attempt}", base), stop, stale_s, lambda s=following: s.check(["hb/count"]))
        attempt += 1


def _watch_attempt(store: dist.Store, stop: threading.Event, stale_s: float, superseded: Callable[[], bool]) -> None:
    beats: dict[Incarnation, tuple[int, float]] = {}  # last count seen and when it changed
    registered = Log(store, "hb")
    while not stop.wait(HEARTBEAT_S) and not superseded():
        now = time.monotonic()
        for incarnation in registered.new():
            beats[incarnation] = (-1, now)
        for incarnation, (last, since) in list(beats.items()):
            key = f"hb/{incarnation[0]}/{incarnation[1]}"
            count = store.add(key, 0)
            if store.check([f"{key}/done"]):
                del beats[incarnation]
            elif count != last:
                beats[incarnation] = (count, now)
            elif now - since > stale_s:
                mark_dead(store, incarnation)
                del beats[incarnation]
