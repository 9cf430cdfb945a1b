"""GPU reservations shared by every worker of a pool: one Prefect global concurrency limit per
GPU (``frenzy-gpu.CLUSTER.NODE.INDEX``, one slot), held through a lease. A run's GPUs are taken
in one server-side transaction (all of them or none), so two workers never hand out the same
GPU; the holder renews the lease while its ranks run and releases it when they end. A worker
killed with -9 stops renewing: the server's repossessor frees the GPUs once the lease expires
(LEASE_S, plus the repossessor's 15-second sweep), unless another worker reclaims them first.

Leases live in the server's lease storage. Prefect's default keeps them in the server's memory,
so a restart forgets them while the slots they hold stay taken in the database: every GPU held
at that moment leaks. Run the server with a durable storage (``PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE=
prefect.server.concurrency.lease_storage.filesystem``, as the embedded stack does, or prefect-redis's);
a holder then rides out a restart (GpuHold keeps renewing through the outage), and takes its
GPUs again if the outage outlasted the lease."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar
from uuid import UUID

import anyio
from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.client.schemas.objects import ConcurrencyLeaseHolder
from prefect.exceptions import ObjectAlreadyExists, PrefectHTTPStatusError

from frenzy_prefect.pool.server_calls import patiently, without_client_retries
from frenzy_prefect.spec.cluster import ClusterSpec, ClusterState
from frenzy_prefect.spec.plan import Placement

LEASE_S = 120.0  # a server outage shorter than this, less RENEW_EVERY_S, loses no lease
RENEW_EVERY_S = 15.0
PREFIX = "frenzy-gpu"
_PAGE = 200
T = TypeVar("T")
_GONE = {404, 410}  # the server no longer knows the lease: expired, revoked or forgotten

logger = logging.getLogger("frenzy_prefect.pool.reservations")


def gpu_limit(cluster: str, node: str, index: int) -> str:
    return f"{PREFIX}.{cluster}.{node}.{index}"


VOLATILE_LEASE_STORAGE = "prefect.server.concurrency.lease_storage.memory"


async def volatile_lease_storage_warning(client: PrefectClient) -> str | None:
    """What to tell an operator whose server keeps leases in memory (None when it does not, or
    when the server does not say: Prefect Cloud has no settings route)."""
    try:
        response = await client._client.get("/admin/settings")
        storage = response.json()["server"]["concurrency"]["lease_storage"] if response.status_code == 200 else None
    except (KeyError, TypeError, ValueError, PrefectHTTPStatusError):
        return None
    if storage != VOLATILE_LEASE_STORAGE:
        return None
    return (
        "this Prefect server keeps concurrency leases in memory: a server restart would leak every GPU reserved at that moment. "
        "Start it with PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE=prefect.server.concurrency.lease_storage.filesystem "
        "(one server) or prefect-redis's lease storage (several)"
    )


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
        out, offset = [], 0
        while True:
            page = await self.client.read_global_concurrency_limits(limit=_PAGE, offset=offset)
            out += [limit for limit in page if limit.name.startswith(f"{PREFIX}.{self.cluster.name}.")]
            if len(page) < _PAGE:
                return out
            offset += _PAGE

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
        """A lease on exactly these GPUs, or None if any of them is held (nothing is taken then)."""
        names = self._names(placements)
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
                return None
            raise
        body = response.json()
        lease = UUID(body["lease_id"])
        if len(body["limits"]) != len(names):  # a GPU without a limit would be unguarded
            await self.release(lease)
            raise RuntimeError(f"cluster {self.cluster.name!r} lacks reservation limits for some of {names}; run ensure() first")
        return lease

    async def renew(self, lease: UUID) -> None:
        await self.client.renew_concurrency_lease(lease, lease_duration=LEASE_S)

    async def release(self, lease: UUID) -> None:
        await self.client.release_concurrency_slots_with_lease(lease)


class GpuHold:
    """One run's GPUs, held for as long as its ranks live: the lease is renewed every RENEW_EVERY_S,
    through server outages; if the server no longer knows it (the outage outlasted LEASE_S and the
    repossessor freed the GPUs) the same GPUs are taken again at once. If another run took them
    in between, ``lost`` is set and ``lost_reason`` says why: the holder must stop its ranks, since
    a GPU is never used by two runs."""

    def __init__(self, reservations: GpuReservations, placements: list[Placement], holder: UUID, lease: UUID) -> None:
        self.reservations = reservations
        self.placements = placements
        self.holder = holder
        self.lease = lease
        self.lost = anyio.Event()
        self.lost_reason = ""

    async def keep(self, on_new_lease: Callable[[UUID], Awaitable[None]]) -> None:
        """Renew until cancelled or lost; ``on_new_lease`` is told of a lease taken again."""
        while True:
            await anyio.sleep(RENEW_EVERY_S)
            asked = time.monotonic()
            try:
                await _insistently(lambda: self.reservations.renew(self.lease), "renewing a GPU lease")
                if (waited := time.monotonic() - asked) > RENEW_EVERY_S:
                    logger.warning("GPU lease %s renewed after %.0f s without the Prefect server", self.lease, waited)
            except PrefectHTTPStatusError as exc:
                if exc.response.status_code not in _GONE:
                    raise
                retaken = await _insistently(lambda: self.reservations.acquire(self.placements, self.holder), "taking GPUs again")
                if retaken is None:
                    self.lost_reason = (
                        f"the Prefect server forgot this run's GPU lease {self.lease} (an outage longer than {LEASE_S:.0f} s, "
                        "or a server without durable lease storage) and other runs hold some of its GPUs now"
                    )
                    self.lost.set()
                    return
                logger.warning("GPU lease %s was gone after a server outage; took the same GPUs again as %s", self.lease, retaken)
                self.lease = retaken
                await on_new_lease(retaken)

    async def release(self) -> None:
        """Let the GPUs go (if the server stays unreachable, the lease expires by itself)."""
        if not self.lost.is_set():
            await patiently(lambda: self.reservations.release(self.lease), "releasing GPUs", patience_s=60.0)


async def _insistently(call: Callable[[], Awaitable[T]], what: str) -> T:
    """``call()`` retried every ~2 s for as long as the server is away, without the Prefect
    client's own backoff (up to 32 s), so that a held GPU is renewed the moment it is back."""
    with without_client_retries():
        return await patiently(call, what, math.inf, max_backoff_s=2.0)
