"""GPU reservations shared by every worker of a pool: one Prefect global concurrency limit per
GPU (``frenzy-gpu.CLUSTER.NODE.INDEX``, one slot), held through a lease. A run's GPUs are taken
in one server-side transaction (all of them or none), so two workers never hand out the same
GPU; the holder renews the lease while its ranks run and releases it when they end. A worker
killed with -9 stops renewing: the server's repossessor frees the GPUs once the lease expires
(LEASE_S, Prefect's minimum, plus the repossessor's 15-second sweep)."""

from __future__ import annotations

from uuid import UUID

from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.client.schemas.objects import ConcurrencyLeaseHolder
from prefect.exceptions import ObjectAlreadyExists, PrefectHTTPStatusError

from frenzy_prefect.spec.cluster import ClusterSpec, ClusterState
from frenzy_prefect.spec.plan import Placement

LEASE_S = 60.0
PREFIX = "frenzy-gpu"
_PAGE = 200


def gpu_limit(cluster: str, node: str, index: int) -> str:
    return f"{PREFIX}.{cluster}.{node}.{index}"


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
                names=names, slots=1, mode="concurrency", lease_duration=LEASE_S, holder=ConcurrencyLeaseHolder(type="flow_run", id=flow_run_id)
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
