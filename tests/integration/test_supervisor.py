"""The supervisor against a real redis-server: fair shares, and workers no replica drives."""

from __future__ import annotations

import asyncio

from protos import worker_pb2
from scheduler_service.leases import SCHEDULERS, Leases
from scheduler_service.router import Router
from scheduler_service.store import RedisStore
from scheduler_service.supervisor import Supervisor
from shared.registry_changes import RegistryChanges
from shared.worker_registry import WorkerEntry, WorkerRegistry
from tests.integration.test_store import run

WORKERS = ["10.0.0.1:1", "10.0.0.2:1"]


class IdleLoop:
    """Stands in for an engine loop: runs until stopped, never has work."""

    is_idle = True
    num_requests = 0

    def __init__(self, entry: WorkerEntry) -> None:
        self.worker_id = entry.worker_id

    def observe_registration(self, entry: WorkerEntry | None) -> None:
        pass

    async def run(self, stop: asyncio.Event) -> None:
        await stop.wait()


async def register(store: RedisStore) -> WorkerRegistry:
    registry = WorkerRegistry(store.client)
    for w in WORKERS:
        await registry.heartbeat(w, worker_pb2.WorkerDescription(instance_id=w), draining=False, ttl_s=30)
    return registry


def test_two_replicas_split_the_workers(url: str) -> None:
    async def body(store: RedisStore) -> None:
        registry = await register(store)
        a = Supervisor(registry, Leases(store.client, "a", 2), Router(store), IdleLoop,  # type: ignore[arg-type]
                       RegistryChanges(store.client))
        b = Supervisor(registry, Leases(store.client, "b", 2), Router(store), IdleLoop,  # type: ignore[arg-type]
                       RegistryChanges(store.client))
        await b._leases.announce()  # noqa: SLF001 - b is alive before a's first tick
        await a.tick()
        await b.tick()
        assert (len(a.worker_ids), len(b.worker_ids)) == (1, 1)
        assert set(a.worker_ids + b.worker_ids) == set(WORKERS)
        for s in (a, b):
            await s._stop_all()  # noqa: SLF001

    run(url, body)


def test_a_worker_no_replica_drives_is_taken_beyond_the_share(url: str) -> None:
    ttl_s = 2.0

    async def body(store: RedisStore) -> None:
        registry = await register(store)
        a = Supervisor(registry, Leases(store.client, "a", ttl_s), Router(store), IdleLoop,  # type: ignore[arg-type]
                       RegistryChanges(store.client))
        stuck = Leases(store.client, "stuck", 30)
        await stuck.announce()  # counted as alive for 15 s, but it never takes a lease
        loop = asyncio.get_running_loop()
        started = loop.time()
        await a.tick()
        assert len(a.worker_ids) == 1, "its share of two workers over two replicas"
        own = a.worker_ids[0]
        # Ticks well inside the TTL renew a's own lease; the other worker is taken once it has been free
        # for more than a TTL, however late the ticks of a loaded machine come.
        while len(a.worker_ids) < 2 and loop.time() - started < 4 * ttl_s:
            await asyncio.sleep(0.4)
            await a.tick()
            assert own in a.worker_ids, "a lost its own lease"
        taken_after = loop.time() - started
        assert a.worker_ids == sorted(WORKERS)
        assert taken_after > ttl_s, f"taken after {taken_after:.1f} s, before the worker was free for a TTL"
        await a._stop_all()  # noqa: SLF001

    run(url, body)


def test_a_front_only_replica_routes_but_takes_no_lease_and_no_share(url: str) -> None:
    async def body(store: RedisStore) -> None:
        registry = await register(store)
        router = Router(store)
        front = Supervisor(registry, Leases(store.client, "front", 2), router, IdleLoop,  # type: ignore[arg-type]
                           RegistryChanges(store.client), drives_workers=False)
        engine = Supervisor(registry, Leases(store.client, "engine", 2), Router(store), IdleLoop,  # type: ignore[arg-type]
                            RegistryChanges(store.client))
        await front.tick()
        await engine.tick()
        await front.tick()
        assert front.worker_ids == [] and router.workers == sorted(WORKERS)
        # The front is not in the roster: the one replica that drives workers has all of them as its share.
        assert sorted(engine.worker_ids) == sorted(WORKERS)
        assert await store.client.zrange(SCHEDULERS, 0, -1) == [b"engine"]
        for s in (front, engine):
            await s._stop_all()  # noqa: SLF001
        assert await store.client.zcard(SCHEDULERS) == 0

    run(url, body)
