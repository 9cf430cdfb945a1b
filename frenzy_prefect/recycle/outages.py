"""How long a lost worker slot stays empty, learnt from the trace as it arrives (never from its future).

An outage runs from the instant a slot loses its node to the instant a node fills it again (the
same node repaired, or a replacement: spot traces bring new names). The expected outage is the
maximum-likelihood mean of an exponential duration with right-censoring: the time every slot has
spent empty so far, closed outages and the ones still open, over the number of outages that have
ended. Memoryless, so it is also the expected rest of an outage that has just begun. Until one
ends, nothing is known: infinite (as on a trace where nodes only leave)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from frenzy_prefect.recycle.membership import Change


@dataclass
class OutageHistory:
    opened: dict[int, float] = field(default_factory=dict)  # slot -> when it emptied
    ended: list[float] = field(default_factory=list)  # durations of outages that ended

    def observe(self, now: float, changes: list[Change]) -> None:
        """Record the slot changes of one instant (``membership.apply``'s, in order)."""
        for change in changes:
            if change.slot is None:
                continue
            if change.kind == "lost":
                self.opened[change.slot] = now
            elif change.kind == "filled" and change.slot in self.opened:
                self.ended.append(now - self.opened.pop(change.slot))

    def expected_s(self, now: float) -> float:
        """The expected length of an outage beginning now (inf until one has ended)."""
        if not self.ended:
            return math.inf
        exposure = sum(self.ended) + sum(now - t for t in self.opened.values())
        return exposure / len(self.ended)
