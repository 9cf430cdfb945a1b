"""Node membership traces: when machines join and leave the job's cluster.

File format (the Bamboo authors' spot-instance traces): one event per line,
``time_ms,add|remove,nodeN`` -- time in whole milliseconds (non-decreasing), the event kind, and a
node name ``node`` + a positive integer. Blank lines and lines starting with ``#`` are skipped.
A line that does not parse raises naming the file, line and field. Adding a node that is already
present, or removing one that is not, is an error too: it means a corrupt or misread trace, and
guessing would silently change the number of alive workers.

Synthetic traces: ``transient_trace`` (every node fails after an exponential time with mean MTBF
and comes back after a fixed repair time, under the same name) and ``shrink_trace`` (nodes fail
the same way and never return). Both are deterministic for a seed.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from frenzy_prefect.errors import FrenzyError

NODE = re.compile(r"node([1-9][0-9]*)")


class NodeEvent(BaseModel):
    model_config = ConfigDict(frozen=True)

    time_s: float = Field(ge=0)
    kind: Literal["add", "remove"]
    node: str

    @property
    def index(self) -> int:
        """N of ``nodeN``."""
        return int(self.node[4:])


class FailureTrace(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    events: list[NodeEvent]

    def alive_over_time(self) -> list[tuple[float, int]]:
        """(time, alive node count) after each distinct event time."""
        alive: set[str] = set()
        points: list[tuple[float, int]] = []
        for event in self.events:
            (alive.add if event.kind == "add" else alive.discard)(event.node)
            if points and points[-1][0] == event.time_s:
                points[-1] = (event.time_s, len(alive))
            else:
                points.append((event.time_s, len(alive)))
        return points

    @property
    def end_s(self) -> float:
        return self.events[-1].time_s if self.events else 0.0


def read_fields(path: Path, what: str, layout: str) -> Iterator[tuple[str, list[str]]]:
    """("file:line", fields) of each line of a small comma-separated file with the fields of
    ``layout`` (e.g. ``time_ms,add|remove,nodeN``); blank and ``#`` lines are skipped."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise FrenzyError(f"cannot read {what} {path}: {exc.strerror}") from None
    count = len(layout.split(","))
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != count:
            raise FrenzyError(f"{path}:{number}: expected {count} fields {layout}, got {len(fields)}: {line!r}")
        yield f"{path}:{number}", fields


def load_failure_trace(path: Path) -> FailureTrace:
    events: list[NodeEvent] = []
    present: dict[str, str] = {}
    last_ms = 0
    for where, fields in read_fields(path, "failure trace", "time_ms,add|remove,nodeN"):
        time_text, kind, node = fields
        if not time_text.isdigit():
            raise FrenzyError(f"{where}: field 1 (time_ms): {time_text!r} is not a whole number of milliseconds")
        time_ms = int(time_text)
        if time_ms < last_ms:
            raise FrenzyError(
                f"{where}: field 1 (time_ms): {time_ms} is earlier than the previous event ({last_ms}); events must be in time order"
            )
        if kind not in ("add", "remove"):
            raise FrenzyError(f"{where}: field 2 (event): {kind!r} is not add or remove")
        if not NODE.fullmatch(node):
            raise FrenzyError(f"{where}: field 3 (node): {node!r} is not a node name like node7 (node + a positive integer)")
        if kind == "add" and node in present:
            raise FrenzyError(f"{where}: {node} is added but is already present (added at line {present[node].rsplit(':', 1)[1]})")
        if kind == "remove" and node not in present:
            raise FrenzyError(f"{where}: {node} is removed but is not present")
        if kind == "add":
            present[node] = where
        else:
            del present[node]
        last_ms = time_ms
        events.append(NodeEvent(time_s=time_ms / 1000, kind=kind, node=node))  # type: ignore[arg-type]
    if not events:
        raise FrenzyError(f"{path}: no events; expected lines time_ms,add|remove,nodeN")
    return FailureTrace(name=Path(path).stem, events=events)


def _sorted_trace(name: str, events: list[NodeEvent]) -> FailureTrace:
    return FailureTrace(name=name, events=sorted(events, key=lambda e: (e.time_s, e.kind == "add", e.index)))


def transient_trace(nodes: int, *, mtbf_s: float, repair_s: float, horizon_s: float, seed: int = 0) -> FailureTrace:
    """All nodes present at 0; each fails after Exp(mean=mtbf_s) of uptime and returns, under the
    same name, ``repair_s`` later. Events at or after the horizon are left out."""
    if nodes <= 0 or mtbf_s <= 0 or repair_s < 0 or horizon_s <= 0:
        raise FrenzyError("transient_trace needs nodes > 0, mtbf_s > 0, repair_s >= 0 and horizon_s > 0")
    rng = random.Random(seed)
    events = [NodeEvent(time_s=0.0, kind="add", node=f"node{k}") for k in range(1, nodes + 1)]
    for k in range(1, nodes + 1):
        t = 0.0
        while True:
            t += rng.expovariate(1 / mtbf_s)
            if t >= horizon_s:
                break
            events.append(NodeEvent(time_s=t, kind="remove", node=f"node{k}"))
            t += repair_s
            if t >= horizon_s:
                break
            events.append(NodeEvent(time_s=t, kind="add", node=f"node{k}"))
    return _sorted_trace(f"transient-mtbf{mtbf_s:g}s-repair{repair_s:g}s-seed{seed}", events)


def shrink_trace(nodes: int, *, mtbf_s: float, horizon_s: float, seed: int = 0) -> FailureTrace:
    """All nodes present at 0; each leaves after Exp(mean=mtbf_s) and never returns."""
    if nodes <= 0 or mtbf_s <= 0 or horizon_s <= 0:
        raise FrenzyError("shrink_trace needs nodes > 0, mtbf_s > 0 and horizon_s > 0")
    rng = random.Random(seed)
    events = [NodeEvent(time_s=0.0, kind="add", node=f"node{k}") for k in range(1, nodes + 1)]
    for k in range(1, nodes + 1):
        t = rng.expovariate(1 / mtbf_s)
        if t < horizon_s:
            events.append(NodeEvent(time_s=t, kind="remove", node=f"node{k}"))
    return _sorted_trace(f"shrink-mtbf{mtbf_s:g}s-seed{seed}", events)
