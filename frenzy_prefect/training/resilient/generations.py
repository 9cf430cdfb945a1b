"""The generations of a ReCycle job's process group: who trains together, and how they agree.

A generation is a set of member ranks and a process group over them (on the store's prefix
``gen<N>``; generation 0 is the job's first group). It changes in two ways, both agreed through
the job's store (the agent hosts it, so a dead trainer cannot take it along):

- **After a failure** (``after_failure``): every survivor that meets the failure (a collective or
  a transfer with a dead rank fails; a death in the log) reports in; once every member has
  reported in or is dead (or RECOVERY_GRACE_S passed), the first proposal of the next members
  wins (``compare_set``), and the survivors form the next generation without the failed ranks.
- **At an iteration's commit point** (``commit``): every member arrives after its gradients
  are reduced and before it updates anything; the last to arrive decides for all, and a member
  that meets a failure first decides "abort" instead (both through ``compare_set`` on one key,
  so every member sees the same outcome). Committed: every member steps its optimizer; the
  decision also names the replacement ranks admitted at this boundary (``admitting``). Aborted:
  no member stepped, and the survivors run the whole iteration again on the adapted schedule.
  Without replacements to admit, the decision may also be to re-plan to a smaller layout
  (``steps.py``), from the next step.
  The commit point is why a failure never leaves the stages at different iterations; it costs
  ReCycle's staggered optimizer steps their overlap (the last stage waits for the first before
  stepping).
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.spec.result import TrainingResult
from frenzy_prefect.training.resilient.liveness import Incarnation, Log, append

RECOVERY_GRACE_S = 60.0  # how long survivors wait for a member that neither reports in nor is dead
GROUP_TIMEOUT = timedelta(seconds=60)  # no survivor waits longer in a collective with a hung peer
ABORT = "abort"
FINISHED = "finished"  # the run's result (JSON), set by the lowest member at the end, for whoever still waits
Position = tuple[int, int]  # (step, phase): where a member was in the run (phase 0: the step, 1: its checkpoint)


class Decision(NamedTuple):
    """What the members do after a committed step: admit these replacements, or re-plan."""

    admitted: list[Incarnation]
    replan: bool


class Interrupted(Exception):
    """A failure interrupted this iteration: nobody stepped; it runs again."""


class Excluded(FrenzyError):
    """The survivors formed the next generation without this rank (it reported in too late). Its
    trainer exits with EXCLUDED_EXIT, and its supervisor replaces it as it would a dead one."""


EXCLUDED_EXIT = 75


def form_group(store: dist.Store, number: int, members: list[int], rank: int) -> None:
    """Leave the current process group, if any, and join generation ``number``'s over ``members``."""
    if dist.is_initialized():
        dist.destroy_process_group()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    prefixed = dist.PrefixStore(f"gen{number}", store)
    dist.init_process_group(backend, store=prefixed, rank=members.index(rank), world_size=len(members), timeout=GROUP_TIMEOUT)


@dataclass
class Generation:
    store: dist.Store
    number: int
    members: list[int]  # global ranks, ascending (a member's rank in the group is its position)
    rank: int
    incarnations: dict[int, int]  # each member's current incarnation
    deaths: Log = field(init=False)
    dead: set[Incarnation] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.deaths = Log(self.store, "dead")

    def _dead_members(self) -> set[int]:
        self.dead.update(self.deaths.new())
        return {m for m in self.members if (m, self.incarnations[m]) in self.dead}

    def _decided(self, key: str) -> str:
        """Wait for the decision at ``key``; decide "abort" when a member dies first."""
        pause = 0.0005
        while not self.store.check([key]):
            if self._dead_members():
                self.store.compare_set(key, "", ABORT)
            time.sleep(pause)
            pause = min(2 * pause, 0.005)
        return self.store.get(key).decode()

    def commit(self, step: int, rejoins: Log, replan: Callable[[], bool] = lambda: False) -> Decision:
        """Arrive at ``step``'s commit point; returns what the members do after it, or raises
        Interrupted. The last member to arrive decides for everyone: it reads the rejoin
        requests and, when there are none, asks ``replan()``."""
        key, before = f"g{self.number}/decision/{step}", rejoins.read
        if self.store.add(f"g{self.number}/commit/{step}", 1) == len(self.members):
            self._dead_members()  # (brings self.dead up to date: a replacement may have died waiting)
            fresh = [i for i in rejoins.new() if i[0] not in self.members and i not in self.dead]
            proposal = json.dumps({"read": rejoins.read, "admit": [list(i) for i in fresh], "replan": not fresh and replan()})
            decision = self.store.compare_set(key, "", proposal).decode()
        else:
            decision = self._decided(key)
        if decision == ABORT:
            rejoins.read = before  # the requests read for this decision are read again at the next
            raise Interrupted(f"step {step} was interrupted by a failure")
        agreed = json.loads(decision)
        rejoins.read = agreed["read"]
        return Decision([tuple(i) for i in agreed["admit"]], agreed["replan"])

    def abort(self, step: int) -> None:
        """Decide ``step`` aborted, unless it was decided already (this member met a failure)."""
        self.store.compare_set(f"g{self.number}/decision/{step}", "", ABORT)

    def after_failure(self, position: Position) -> tuple[Generation, Position, int]:
        """Report in at ``position`` and agree on the survivors; returns the next generation (its
        group formed), the position to resume at and the member that reached it: the furthest any
        survivor reached (a collective may have completed on some ranks and not on others, and
        what completed anywhere, a checkpoint, is complete)."""
        # Leave the broken groups first: their connections close (once nothing holds them: the
        # caller dropped its references, gc collects the cycles), so a member blocked on this rank
        # (not on the dead one) fails at once too, instead of waiting out the group's timeout.
        dist.destroy_process_group()
        gc.collect()
        n, store = self.number, self.store
        store.set(f"g{n}/here/{store.add(f'g{n}/here/count', 1)}", json.dumps([self.rank, *position]))
        deadline, proposal_key = time.monotonic() + RECOVERY_GRACE_S, f"g{n}/next"
        while not store.check([proposal_key]):
            here = self._reported(n)
            if set(self.members) <= here.keys() | self._dead_members() or time.monotonic() > deadline:
                store.compare_set(proposal_key, "", json.dumps(sorted(here)))
            else:
                time.sleep(0.005)
        members = json.loads(store.get(proposal_key))
        if self.rank not in members:
            raise Excluded(f"rank {self.rank} reported in after the survivors re-formed without it")
        here = self._reported(n)
        furthest = max(members, key=lambda m: (here[m], -m))
        return self._next(members, self.incarnations), here[furthest], furthest

    def _reported(self, n: int) -> dict[int, Position]:
        """The members that reported in after generation ``n`` failed, and where each was."""
        count = self.store.add(f"g{n}/here/count", 0)
        entries = self.store.multi_get([f"g{n}/here/{k}" for k in range(1, count + 1)]) if count else []
        return {rank: (step, phase) for rank, step, phase in map(json.loads, entries)}

    def admitting(self, admitted: list[Incarnation], payload: dict) -> Generation:
        """The next generation with the ``admitted`` replacements; the lowest member tells each of
        them where to join and ``payload`` (the step to train next, the losses so far)."""
        incarnations = self.incarnations | dict(admitted)
        members = sorted(set(self.members) | {r for r, _ in admitted})
        if self.rank == self.members[0]:
            for rank, number in admitted:
                note = {"generation": self.number + 1, "members": members, "incarnations": incarnations, **payload}
                self.store.set(f"admitted/{rank}/{number}", json.dumps(note))
        return self._next(members, incarnations)

    def _next(self, members: list[int], incarnations: dict[int, int]) -> Generation:
        following = Generation(self.store, self.number + 1, members, self.rank, {m: incarnations[m] for m in members})
        following.deaths.read, following.dead = self.deaths.read, self.dead
        form_group(self.store, following.number, members, self.rank)
        return following


def finished_result(store: dist.Store) -> TrainingResult | None:
    """The run's result once its members have finished, else None."""
    return TrainingResult.model_validate_json(store.get(FINISHED)) if store.check([FINISHED]) else None


def await_admission(store: dist.Store, incarnation: Incarnation) -> tuple[Generation, dict] | None:
    """A replacement's wait: until the members admit it (its generation formed, and what they
    sent), or None when the job finished first."""
    append(store, "rejoin", incarnation)
    key = f"admitted/{incarnation[0]}/{incarnation[1]}"
    while not store.check([key]):
        if store.check([FINISHED]):
            return None
        time.sleep(0.01)
    note = json.loads(store.get(key))
    incarnations = {int(r): n for r, n in note.pop("incarnations").items()}
    generation = Generation(store, note.pop("generation"), note.pop("members"), incarnation[0], incarnations)
    form_group(store, generation.number, generation.members, generation.rank)
    return generation, note
