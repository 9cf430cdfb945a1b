"""GPU slots held by no live run, given back by the pool's workers.

A Prefect server that keeps concurrency leases in memory (its default) forgets them when it
restarts, while the slots they held stay taken in its database: a GPU held then would stay
taken for good. A holder that is still running keeps its GPUs and gives them back itself
(reservations.GpuHold); what no live run holds any more (its run ended, or its worker died,
during the outage) is given back here, by every worker at its heartbeat.

A GPU's slot counts as leaked once, at every look over LEAK_AFTER_S:

- its limit's row was the same (its ``updated``): no take, release, expiry or refused take
  touched it, so one and the same count held it all along;
- no run claimed it (run_labels.GPUS, read after the row). A run claims GPUs before it takes
  them and until it has given them back, so a live hold is never missed, nor a take between
  the server's answer and the worker's labelling of its run: the label comes first.
- LEAK_AFTER_S exceeds the lease (LEASE_S) plus the server's repossessor sweeps: a lease that
  still existed would have gone unrenewed (only a claiming run renews its lease), expired and
  been repossessed by then, changing the row. So the count is under no lease the server knows,
  and nothing else will ever free it.

Such slots are freed by name, by one worker at a time (a lock: a limit of its own, held under a
lease), each row read again just before, and each decrement sent once: a second one, by
another worker or a retry, could free a GPU that a run took in between.

A run whose worker is lost still claims its GPUs; the worker that reclaims it gives them back at
once, under the same lock (give_back_unclaimed), rather than leave them to this sweep, which
would count them claimed for RECENTLY_ENDED_S after the run's end, then wait LEAK_AFTER_S.

(Assumed: the server runs its repossessor, as Prefect's does by default; and a run's GPUs are
claimed only through this pool's workers.)
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta
from uuid import UUID

import anyio
from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterEndTime, FlowRunFilterState, FlowRunFilterStateType
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.exceptions import ObjectAlreadyExists, PrefectHTTPStatusError

from frenzy_prefect.pool import run_labels
from frenzy_prefect.pool.reservations import LEASE_S, PREFIX, give_back_slots, gpu_limits

REPOSSESSOR_S = 15.0  # Prefect's repossessor looks for expired leases this often (its default)
LEAK_AFTER_S = LEASE_S + 2 * REPOSSESSOR_S + 30.0
RECENTLY_ENDED_S = 3 * LEASE_S  # a run that ended this recently may still be giving its GPUs back
LOCK = f"{PREFIX}-leaks"  # not a GPU: no "." after the prefix
LOCK_LEASE_S = 300.0
LOCK_TRUSTED_S = 60.0  # a lock held longer than this (a frozen worker) is trusted with no more decrements
_LIVE = [StateType.PENDING, StateType.RUNNING, StateType.CANCELLING, StateType.PAUSED]
_PAGE = 200


class LeakedGpus:
    """One worker's looks at the GPU slots; ``sweep`` gives back those leaked."""

    def __init__(self, client: PrefectClient, logger: logging.Logger | logging.LoggerAdapter, after_s: float = LEAK_AFTER_S) -> None:
        self.client, self.logger, self.after_s = client, logger, after_s
        self._unclaimed: dict[str, tuple[datetime, float]] = {}  # slot -> (its row's version, when first seen unclaimed at it)

    async def sweep(self) -> list[str]:
        """Look at every GPU slot once more; give back those leaked. Returns their names."""
        held = {limit.name: limit.updated for limit in await gpu_limits(self.client) if limit.active_slots >= limit.limit}
        claimed = await claimed_gpus(self.client) if held else set()
        now, seen = time.monotonic(), self._unclaimed
        self._unclaimed = {
            name: seen[name] if name in seen and seen[name][0] == version else (version, now)
            for name, version in held.items()
            if name not in claimed
        }
        leaked = {name: version for name, (version, since) in self._unclaimed.items() if now - since >= self.after_s}
        return await self._give_back(leaked) if leaked else []

    async def _give_back(self, leaked: dict[str, datetime]) -> list[str]:
        lock = await _take_lock(self.client)
        if lock is None:
            return []  # another worker is at it
        locked, freed = time.monotonic(), []
        try:
            rows = {limit.name: limit for limit in await gpu_limits(self.client)}
            for name, version in leaked.items():
                row = rows.get(name)
                if row is None or row.updated != version or row.active_slots < row.limit or time.monotonic() - locked > LOCK_TRUSTED_S:
                    continue
                await give_back_slots(self.client, [name], "giving back a leaked GPU")
                self._unclaimed.pop(name, None)
                freed.append(name)
                self.logger.warning(
                    f"Gave back GPU {name}: its slot was taken under no lease the Prefect server knows, and no live run held it "
                    f"for {self.after_s:.0f} s (a server that keeps leases in memory forgets them when it restarts)"
                )
        finally:
            await self.client.release_concurrency_slots_with_lease(lock)
        return freed


async def give_back_unclaimed(client: PrefectClient, run_id: UUID, lock_wait_s: float = LOCK_TRUSTED_S) -> list[str] | None:
    """Give back, by name, the GPUs that run ``run_id`` claims and no other run does, whose
    slots are still held: what a reclaimed run held under a lease the server no longer knows.
    Returns their names; None when another worker kept the lock for ``lock_wait_s`` (the sweep
    then gives them back later).

    Safe because the lease is gone from the server's storage: forgotten in a restart (its
    counts are still this run's, and nothing else frees them), or expired or revoked (the
    server decremented its slots first, and a run that took one since claims it: it is left).
    Under the lock, and only while the run still claims them: a second reclaimer, or a sweep,
    decrements nothing twice."""
    deadline = time.monotonic() + lock_wait_s
    while (lock := await _take_lock(client)) is None:
        if time.monotonic() > deadline:
            return None
        await anyio.sleep(0.5)
    try:
        names = str((await client.read_flow_run(run_id)).labels.get(run_labels.GPUS) or "").split()
        if not names:
            return []  # another worker gave them back first
        held = {limit.name for limit in await gpu_limits(client) if limit.active_slots >= limit.limit}
        others = await claimed_gpus(client, but=run_id) if held else set()  # (read after the rows: see the module doc)
        freed = [name for name in names if name in held and name not in others]
        if freed:
            await give_back_slots(client, freed, "giving back a reclaimed run's GPUs")
        await client.update_flow_run_labels(run_id, {run_labels.GPUS: ""})
        return freed
    finally:
        await client.release_concurrency_slots_with_lease(lock)


async def claimed_gpus(client: PrefectClient, but: UUID | None = None) -> set[str]:
    """The GPU limits claimed by runs that are live, or ended recently enough to be giving
    their GPUs back (any pool: a cluster's GPUs may serve several); ``but``: except that run's."""
    live = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=_LIVE)))
    ended = FlowRunFilter(end_time=FlowRunFilterEndTime(after_=datetime.now(UTC) - timedelta(seconds=RECENTLY_ENDED_S)))
    claimed: set[str] = set()
    for runs in (live, ended):
        for run in await _all_runs(client, runs):
            if run.id != but:
                claimed.update(str(run.labels.get(run_labels.GPUS) or "").split())
    return claimed


async def _all_runs(client: PrefectClient, runs: FlowRunFilter) -> list[FlowRun]:
    out: list[FlowRun] = []
    while True:
        page = await client.read_flow_runs(flow_run_filter=runs, limit=_PAGE, offset=len(out))
        out += page
        if len(page) < _PAGE:
            return out


async def _take_lock(client: PrefectClient) -> UUID | None:
    """A lease on LOCK (created on first use), or None if another worker holds it."""
    for _ in range(2):
        try:
            response = await client.increment_concurrency_slots_with_lease(
                names=[LOCK], slots=1, mode="concurrency", lease_duration=LOCK_LEASE_S
            )
        except PrefectHTTPStatusError as exc:
            if exc.response.status_code == 423:
                return None
            raise
        body = response.json()
        lease = UUID(body["lease_id"])
        if body["limits"]:
            return lease
        await client.release_concurrency_slots_with_lease(lease)  # no such limit yet: nothing was taken
        try:
            await client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=LOCK, limit=1))
        except ObjectAlreadyExists:
            pass
    return None
