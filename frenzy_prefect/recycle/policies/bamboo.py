"""Bamboo (NSDI'23): redundant computation -- every node also runs its successor stage's forward
pass, so it always pays ``bamboo_overhead``. When a node fails its predecessor in the pipeline
(its shadow, stages in a ring) fails over and runs both stages: that pipeline, and with it the
synchronous grid, runs ``bamboo_failover_slowdown`` times slower. Two adjacent dead stages in a
pipeline leave no shadow: restart from the last checkpoint, and run only pipelines without
adjacent holes until nodes fill them. Joining nodes are taken in at a ``reconfigure_s`` pause.
The interrupted iteration survives a failover only: the shadow already ran its successor's
forward passes, which is what Bamboo's redundancy buys (NSDI'23); a restart or a re-formed set of
pipelines redoes it."""

from __future__ import annotations

from typing import ClassVar

from frenzy_prefect.recycle.policies.base import Decision, View, grid_label, stalled


def _broken(dead: list[int], pp: int) -> bool:
    holes = set(dead)
    return pp == 1 and bool(holes) or any((s + 1) % pp in holes for s in holes) or len(holes) == pp


class Bamboo:
    name: ClassVar[str] = "bamboo"

    def __init__(self) -> None:
        self.running: set[int] = set()

    def _decide(self, view: View, kind: str, pause_s: float, **extra) -> Decision:
        m, model, knobs = view.membership, view.model, view.knobs
        if not self.running:
            return stalled("no pipeline can fail over")
        degraded = any(m.dead_stages(p) for p in self.running)
        base = model.fault_free_s(len(self.running), model.pp)
        if base is None:
            return stalled(f"{len(self.running)} pipelines cannot run by the step times")
        iteration_s = base * knobs.bamboo_overhead * (knobs.bamboo_failover_slowdown if degraded else 1.0)
        note = f"{len(self.running)} pipelines" + (", failed over" if degraded else "")
        return Decision(kind, iteration_s, grid_label(len(self.running), model.pp), pause_s=pause_s, note=note, **extra)  # type: ignore[arg-type]

    def react(self, view: View) -> Decision | None:
        if not view.slot_changes:
            return None
        m, model, knobs = view.membership, view.model, view.knobs
        usable = {p for p in range(model.dp) if not _broken(m.dead_stages(p), model.pp)}
        if view.first or m.lost_stages() or self.running - usable:
            self.running = usable
            return self._decide(view, "checkpoint-restart", knobs.restart_s, keep_in_flight=False, rollback=True, restore_state=True)
        if any(c.kind == "filled" for c in view.slot_changes):
            self.running = usable
            return self._decide(view, "reconfigure", knobs.reconfigure_s, keep_in_flight=False, restore_state=True)
        hit = {c.slot // model.pp for c in view.slot_changes if c.kind == "lost" and c.slot is not None}
        if not hit & self.running:
            return None
        return self._decide(view, "failover", knobs.detection_s, keep_in_flight=True)
