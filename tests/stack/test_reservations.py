"""GPU reservations on the real Prefect server's global concurrency limits: many holders at
once never share a GPU, a held GPU cannot be taken, and releasing frees it; a run is labelled
with the GPUs it takes before it takes them."""

import asyncio
import random
import time
from itertools import pairwise
from uuid import UUID, uuid4

import pytest
from prefect import flow
from prefect.client.orchestration import get_client

from frenzy_prefect.allocator.placement import place
from frenzy_prefect.pool import run_labels
from frenzy_prefect.pool.reservations import GpuReservations, gpu_limit
from frenzy_prefect.spec.cluster import ClusterSpec
from frenzy_prefect.spec.plan import Placement


@flow
def holding():
    pass


async def a_run(client) -> UUID:
    """A flow run to hold GPUs for (they are claimed on its labels)."""
    return (await client.create_flow_run(holding)).id


def small_cluster() -> ClusterSpec:
    nodes = [
        {"name": "a", "host": "127.0.0.1", "gpu_type": "A10", "gpu_count": 3},
        {"name": "b", "host": "127.0.0.1", "gpu_type": "A10", "gpu_count": 2},
    ]
    return ClusterSpec(name=f"res-{uuid4().hex[:8]}", nodes=nodes)


def test_twenty_concurrent_holders_never_share_a_gpu(stack, prefect_api):
    cluster = small_cluster()
    held: list[tuple[list[Placement], float, float]] = []

    async def holder(reservations: GpuReservations, k: int) -> None:
        rng = random.Random(k)
        gpus = rng.choice([1, 2, 3, 4])
        run = await a_run(reservations.client)
        while True:
            state = await reservations.state()
            placements = place(gpus, [(n, state.free_gpus[n.name]) for n in cluster.nodes])
            lease = placements and await reservations.acquire(placements, run)
            if lease:
                break
            await asyncio.sleep(rng.uniform(0.01, 0.05))
        start = time.monotonic()
        await asyncio.sleep(rng.uniform(0.05, 0.2))
        held.append((placements, start, time.monotonic()))
        await reservations.release(lease)

    async def scenario() -> dict[str, list[int]]:
        async with get_client() as client:
            reservations = GpuReservations(client, cluster)
            await reservations.ensure()
            await reservations.ensure()  # idempotent: a second worker starting
            await asyncio.gather(*(holder(reservations, k) for k in range(20)))
            return (await reservations.state()).free_gpus

    with stack.client_settings():
        free_after = asyncio.run(scenario())
    assert len(held) == 20  # every holder got its GPUs, 5 GPUs oversubscribed several times over
    intervals: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for placements, start, end in held:
        for p in placements:
            for i in p.gpus:
                intervals.setdefault((p.node, i), []).append((start, end))
    for gpu, spans in intervals.items():
        spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in pairwise(spans)), f"GPU {gpu} held twice at once"
    assert free_after == {"a": [0, 1, 2], "b": [0, 1]}


def test_a_held_gpu_cannot_be_taken_and_is_free_once_released(stack, prefect_api):
    cluster = small_cluster()

    async def scenario() -> None:
        async with get_client() as client:
            reservations = GpuReservations(client, cluster)
            assert (await reservations.state()).free_gpus == {"a": [0, 1, 2], "b": [0, 1]}  # no limits yet: all free
            holder, refused = await a_run(client), await a_run(client)
            with pytest.raises(RuntimeError, match="lacks reservation limits"):
                await reservations.acquire([Placement(node="a", host="127.0.0.1", gpus=[0])], holder)
            await reservations.ensure()
            first = await reservations.acquire([Placement(node="a", host="127.0.0.1", gpus=[0, 1])], holder)
            assert first is not None
            claimed = (await client.read_flow_run(holder)).labels[run_labels.GPUS]
            assert claimed == f"{gpu_limit(cluster.name, 'a', 0)} {gpu_limit(cluster.name, 'a', 1)}"
            # Overlapping by one GPU: nothing is taken, not even the free GPU 2, and nothing is claimed.
            assert await reservations.acquire([Placement(node="a", host="127.0.0.1", gpus=[1, 2])], refused) is None
            assert (await client.read_flow_run(refused)).labels[run_labels.GPUS] == ""
            assert (await reservations.state()).free_gpus == {"a": [2], "b": [0, 1]}
            limit = await client.read_global_concurrency_limit_by_name(gpu_limit(cluster.name, "a", 2))
            assert limit.active_slots == 0
            await reservations.renew(first)
            await reservations.release(first)
            assert (await reservations.state()).free_gpus == {"a": [0, 1, 2], "b": [0, 1]}

    with stack.client_settings():
        asyncio.run(scenario())


def test_the_embedded_server_keeps_leases_where_a_restart_finds_them(stack, prefect_api):
    from frenzy_prefect.localstack import DURABLE_LEASE_STORAGE
    from frenzy_prefect.pool.reservations import volatile_lease_storage_warning

    async def scenario() -> tuple[str, str | None]:
        async with get_client() as client:
            settings = (await client._client.get("/admin/settings")).json()
            return settings["server"]["concurrency"]["lease_storage"], await volatile_lease_storage_warning(client)

    with stack.client_settings():
        storage, warning = asyncio.run(scenario())
    assert storage == DURABLE_LEASE_STORAGE and warning is None
