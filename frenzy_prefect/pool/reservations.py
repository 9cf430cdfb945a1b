"""GPU reservations shared by every worker of a pool: one Prefect global concurrency limit per
GPU (``frenzy-gpu.CLUSTER.NODE.INDEX``, one slot), held through a lease. A run's GPUs are taken
in one server-side transaction (all of them or none), so two workers never hand out the same
GPU; the holder renews the lease while its ranks run and releases it when they end. A worker
killed with -9 stops renewing: the server's repossessor frees the GPUs once the lease expires
(LEASE_S, plus the repossessor's 15-second sweep), unless another worker reclaims them first.

Leases live in the server's lease storage. Prefect's default keeps them in the server's memory,
so a restart forgets them while the slots they hold stay taken in the database. With a durable
storage (``PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE=prefect.server.concurrency.lease_storage.filesystem``,
as the embedded stack does, or prefect-redis's) a holder rides out a restart (GpuHold keeps
renewing through the outage), and takes its GPUs again if the outage outlasted the lease. On
the default one the pool converges too: a holder whose lease the server forgot keeps its GPUs'
slots, counted without a lease, and gives them back by name when its ranks end; slots held by
no live run at all are given back by the pool's workers (leaks.py).

Every take is announced first: the run is labelled with the GPUs it is taking (run_labels.GPUS)
before their slots are taken, and the label is cleared only once they are given back, so that a
GPU a live run holds is never taken for leaked (see leaks.py for why that is enough)."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar
from uuid import UUID

import anyio
from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.client.schemas.objects import ConcurrencyLeaseHolder
from prefect.client.schemas.responses import GlobalConcurrencyLimitResponse
from prefect.exceptions import ObjectAlreadyExists, PrefectHTTPStatusError

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.pool import run_labels
from frenzy_prefect.pool.server_calls import is_transient, patiently, without_client_retries
from frenzy_prefect.prefect_private import server_settings
from frenzy_prefect.spec.cluster import ClusterSpec, ClusterState
from frenzy_prefect.spec.plan import Placement

LEASE_S = 120.0  # a server outage shorter than this, less the renewal interval, loses no lease
RENEW_EVERY_S = 15.0  # the renewal interval, unless FRENZY_GPU_LEASE_RENEW_S sets another (< LEASE_S / 2)
RENEW_EVERY_ENV = "FRENZY_GPU_LEASE_RENEW_S"
PREFIX = "frenzy-gpu"
_PAGE = 200
T = TypeVar("T")
GONE = {404, 410}  # the server no longer knows the lease: expired, revoked or forgotten
# A lease last renewed less than LEASE_S minus this ago cannot have expired (the margin covers the
# renewal's round trip): if the server does not know it, it forgot it or it was revoked.
UNEXPIRED_MARGIN_S = 10.0

logger = logging.getLogger("frenzy_prefect.pool.reservations")


def renew_every_s() -> float:
    """How often a holder renews its lease: RENEW_EVERY_S, or the environment's setting."""
    raw = os.environ.get(RENEW_EVERY_ENV, "").strip()
    try:
        value = float(raw) if raw else RENEW_EVERY_S
    except ValueError:
        value = 0.0
    if not 0 < value < LEASE_S / 2:
        accepted = f"a number of seconds above 0 and below {LEASE_S / 2:g} (unset, {RENEW_EVERY_S:g})"
        raise FrenzyError(f"{RENEW_EVERY_ENV}={raw!r} is not {accepted}")
    return value


def gpu_limit(cluster: str, node: str, index: int) -> str:
    return f"{PREFIX}.{cluster}.{node}.{index}"


VOLATILE_LEASE_STORAGE = "prefect.server.concurrency.lease_storage.memory"


async def volatile_lease_storage_warning(client: PrefectClient) -> str | None:
    """What to tell an operator whose server keeps leases in memory (None when it does not, or
    when the server does not say: Prefect Cloud has no settings route)."""
    try:
        response = await server_settings(client)
        storage = response.json()["server"]["concurrency"]["lease_storage"] if response.status_code == 200 else None
    except (KeyError, TypeError, ValueError, PrefectHTTPStatusError):
        return None
    if storage != VOLATILE_LEASE_STORAGE:
        return None
    return (
        "this Prefect server keeps concurrency leases in memory: a restart forgets them. Runs that hold GPUs then keep them "
        "without a lease and the pool's workers give back those no live run holds, minutes later; to keep leases through a "
        "restart, start it with PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE=prefect.server.concurrency.lease_storage.filesystem "
        "(one server) or prefect-redis's lease storage (several)"
    )


async def gpu_limits(client: PrefectClient, prefix: str = f"{PREFIX}.") -> list[GlobalConcurrencyLimitResponse]:
    """The GPU limits whose names start with ``prefix`` (default: every cluster's)."""
    out, offset = [], 0
    while True:
        page = await client.read_global_concurrency_limits(limit=_PAGE, offset=offset)
        out += [limit for limit in page if limit.name.startswith(prefix)]
        if len(page) < _PAGE:
            return out
        offset += _PAGE


class GpuReservations:
    def __init__(self, client: PrefectClient, cluster: ClusterSpec) -> None:
        self.client = client
        self.cluster = cluster

    def _names(self, placements: list[Placement]) -> list[str]:
        return [gpu_limit(self.cluster.name, p.node, i) for p in placements for i in p.gpus]

    async def ensure(self) -> None:
        """Create the limit of every GPU of the cluster that has none yet (idempotent)."""
        existing = {limit.name for limit in await self._limits()}
        for node in self.cluster.nodes:
            for i in range(node.gpu_count):
                name = gpu_limit(self.cluster.name, node.name, i)
                if name not in existing:
                    try:
                        await self.client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
                    except ObjectAlreadyExists:
                        pass  # another worker created it first

    async def _limits(self) -> list:
        return await gpu_limits(self.client, f"{PREFIX}.{self.cluster.name}.")

    async def state(self) -> ClusterState:
        """Which GPUs nobody holds now (read only: a GPU whose limit no worker has created yet
        cannot be held)."""
        busy = {limit.name for limit in await self._limits() if limit.active_slots >= limit.limit}
        return ClusterState(
            cluster=self.cluster,
            free_gpus={
                n.name: [i for i in range(n.gpu_count) if gpu_limit(self.cluster.name, n.name, i) not in busy] for n in self.cluster.nodes
            },
        )

    async def acquire(self, placements: list[Placement], flow_run_id: UUID) -> UUID | None:
        """A lease on exactly these GPUs, or None if any of them is held (nothing is taken then).
        The run is labelled with them before they are taken (run_labels.GPUS), and unlabelled if
        they were not."""
        names = self._names(placements)
        await self.claim(flow_run_id, names)
        try:
            response = await self.client.increment_concurrency_slots_with_lease(
                names=names,
                slots=1,
                mode="concurrency",
                lease_duration=LEASE_S,
                holder=ConcurrencyLeaseHolder(type="flow_run", id=flow_run_id),
            )
        except PrefectHTTPStatusError as exc:
            if exc.response.status_code == 423:
                await self.claim(flow_run_id, [])
                return None
            raise
        body = response.json()
        lease = UUID(body["lease_id"])
        if len(body["limits"]) != len(names):  # a GPU without a limit would be unguarded
            await self.release(lease)
            raise RuntimeError(f"cluster {self.cluster.name!r} lacks reservation limits for some of {names}; run ensure() first")
        return lease

    async def claim(self, flow_run_id: UUID, names: list[str]) -> None:
        """Label the run with the GPU limits it holds or is taking (none: it holds none)."""
        labels = {run_labels.GPUS: " ".join(names)}
        await patiently(lambda: self.client.update_flow_run_labels(flow_run_id, labels), "labelling the flow run")

    async def renew(self, lease: UUID) -> None:
        await self.client.renew_concurrency_lease(lease, lease_duration=LEASE_S)

    async def release(self, lease: UUID) -> None:
        await self.client.release_concurrency_slots_with_lease(lease)

    async def give_back(self, placements: list[Placement]) -> None:
        """Free these GPUs' slots by name, without a lease (one the server forgot): the decrement
        goes once, and again only while the slots' rows show it did not arrive, since a second
        one would free a GPU another run took in between."""
        await give_back_slots(self.client, self._names(placements), "giving back GPUs the server forgot the lease of")


async def give_back_slots(client: PrefectClient, names: list[str], what: str, patience_s: float = 60.0) -> None:
    """Decrement the slots of GPU limits ``names`` (see GpuReservations.give_back)."""

    async def versions() -> dict[str, object]:  # a limit's row changes (its `updated`) whenever its slots do
        return {limit.name: limit.updated for limit in await gpu_limits(client) if limit.name in names}

    before = await patiently(versions, what)
    deadline = time.monotonic() + patience_s
    while True:
        try:
            with without_client_retries():
                await client.release_concurrency_slots(names=names, slots=1, occupancy_seconds=1.0)
            return
        except Exception as exc:
            if not is_transient(exc) or time.monotonic() > deadline:
                raise
        await anyio.sleep(2.0)
        if await patiently(versions, what) != before:  # it arrived, though its answer did not
            return


class GpuHold:
    """One run's GPUs, held for as long as its ranks live: the lease is renewed every
    renew_every_s(), through server outages. If the server no longer knows it:

    - before it could have expired, and no worker reclaimed the run: the server forgot it (a
      restart of a server that keeps leases in memory) and its GPUs' slots are still this run's,
      counted without a lease (nothing else frees or takes them): the run keeps them, ``unleased``,
      and gives them back by name at the end;
    - else (the outage outlasted LEASE_S, and the repossessor freed the GPUs): the same GPUs are
      taken again at once; if another run took one in between, ``lost`` is set and
      ``lost_reason`` says why: the holder must stop its ranks, since a GPU is never used by two
      runs. ``on_release`` is told of the GPUs
    given back (placements, lease)."""

    def __init__(
        self,
        reservations: GpuReservations,
        placements: list[Placement],
        holder: UUID,
        lease: UUID,
        on_release: Callable[[list[Placement], UUID], None] | None = None,
    ) -> None:
        self.reservations = reservations
        self.on_release = on_release
        self.placements = placements
        self.holder = holder
        self.lease = lease
        self.unleased = False
        self.lost = anyio.Event()
        self.lost_reason = ""
        self._renewed_at = time.monotonic()  # when the last renewal that succeeded was asked for (or the lease taken)
        self._renew_every_s = renew_every_s()

    async def keep(self, on_new_lease: Callable[[UUID], Awaitable[None]], say: Callable[[str], None]) -> None:
        """Renew until cancelled, lost or unleased; ``on_new_lease`` is told of a lease taken
        again, ``say`` what happened to the lease (the run's log)."""
        while True:
            await anyio.sleep(self._renew_every_s)
            asked = time.monotonic()
            try:
                await _insistently(lambda: self.reservations.renew(self.lease), "renewing a GPU lease")
                self._renewed_at = asked
                if (waited := time.monotonic() - asked) > self._renew_every_s:
                    logger.warning("GPU lease %s renewed after %.0f s without the Prefect server", self.lease, waited)
            except PrefectHTTPStatusError as exc:
                if exc.response.status_code not in GONE:
                    raise
                if await self._forgotten():
                    say(
                        f"The Prefect server forgot GPU lease {self.lease} (it keeps leases in memory and restarted): "
                        "the GPUs stay this run's, their slots held without a lease, and are given back when it ends"
                    )
                    return
                if not await self._take_again(on_new_lease, say):
                    return

    async def _forgotten(self) -> bool:
        """Whether the server forgot the lease, rather than let it expire or have it revoked
        (a worker that reclaims a run labels it so before it releases its lease); if so, the hold
        is ``unleased`` from now on."""
        if time.monotonic() - self._renewed_at >= LEASE_S - UNEXPIRED_MARGIN_S:
            return False
        run = await _insistently(lambda: self.reservations.client.read_flow_run(self.holder), "reading the flow run")
        self.unleased = run_labels.RECLAIMED_BY not in run.labels
        return self.unleased

    async def _take_again(self, on_new_lease: Callable[[UUID], Awaitable[None]], say: Callable[[str], None]) -> bool:
        retaken = await _insistently(lambda: self.reservations.acquire(self.placements, self.holder), "taking GPUs again")
        if retaken is None:
            self.lost_reason = (
                f"the Prefect server no longer knows this run's GPU lease {self.lease} (an outage longer than the lease's "
                f"{LEASE_S:.0f} s, or the run was reclaimed by another worker) and some of its GPUs are taken now"
            )
            self.lost.set()
            return False
        say(f"GPU lease {self.lease} was gone after a server outage; took the same GPUs again as {retaken}")
        self.lease, self._renewed_at = retaken, time.monotonic()
        await on_new_lease(retaken)
        return True

    async def release(self) -> None:
        """Let the GPUs go (if the server stays unreachable, the lease expires by itself). A
        lease the server forgot would be released in silence, its slots left taken: so it is
        renewed first, and a forgotten one's slots are given back by name."""
        if self.lost.is_set():
            return
        if not self.unleased:
            try:
                await patiently(lambda: self.reservations.renew(self.lease), "releasing GPUs", patience_s=60.0)
            except PrefectHTTPStatusError as exc:
                if exc.response.status_code not in GONE:
                    raise
                if not await self._forgotten():
                    return  # expired or revoked: these slots are not this run's to free any more
        if self.unleased:
            await self.reservations.give_back(self.placements)
        else:
            await patiently(lambda: self.reservations.release(self.lease), "releasing GPUs", patience_s=60.0)
            if self.on_release is not None:
                self.on_release(self.placements, self.lease)


async def _insistently(call: Callable[[], Awaitable[T]], what: str) -> T:
    """``call()`` retried every ~2 s for as long as the server is away, without the Prefect
    client's own backoff (up to 32 s), so that a held GPU is renewed the moment it is back."""
    with without_client_retries():
        return await patiently(call, what, math.inf, max_backoff_s=2.0)
