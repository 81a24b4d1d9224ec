"""Registry changes against a real redis-server: a worker's announcement wakes schedulers at once."""

from __future__ import annotations

import asyncio

import pytest

from protos import worker_pb2
from scheduler_service.leases import Leases
from scheduler_service import server
from scheduler_service.router import Router
from scheduler_service.store import RedisStore
from scheduler_service.supervisor import Supervisor
from shared.registry_changes import RegistryChanges
from shared.worker_registry import CHANGES_CHANNEL, WorkerEntry, WorkerRegistry
from tests.integration.test_store import run
from tests.integration.test_supervisor import IdleLoop
from worker_service.registration import Registration, RegistrationConfig

W = "10.0.0.1:1"
# Far beyond any wait below: a test that passes did not wait for a tick or a poll.
LONG_S = 60.0


def description(instance: str = "i1") -> worker_pb2.WorkerDescription:
    return worker_pb2.WorkerDescription(instance_id=instance)


async def listening(store: RedisStore) -> tuple[RegistryChanges, asyncio.Event, asyncio.Task[None]]:
    """A subscribed listener (its subscription counts as a first change, consumed here)."""
    changes, stop = RegistryChanges(store.client), asyncio.Event()
    task = asyncio.create_task(changes.run(stop))
    assert await changes.wait(LONG_S), "the subscription wakes the first wait"
    return changes, stop, task


def test_an_announced_heartbeat_wakes_a_waiter_and_a_plain_one_does_not(url: str) -> None:
    async def body(store: RedisStore) -> None:
        changes, stop, task = await listening(store)
        registry = WorkerRegistry(store.client)
        await registry.heartbeat(W, description(), draining=False, ttl_s=30)
        assert not await changes.wait(0.2), "a routine heartbeat is no change"
        await registry.heartbeat(W, description(), draining=True, ttl_s=30, announce=True)
        assert await changes.wait(LONG_S)
        await registry.deregister(W, "i1")
        assert await changes.wait(LONG_S)
        stop.set()
        await task

    run(url, body)


def test_a_worker_announces_its_first_heartbeat_and_its_drain_only(url: str) -> None:
    async def body(store: RedisStore) -> None:
        pubsub = store.client.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(CHANGES_CHANNEL)
        config = RegistrationConfig("redis://x", W, drain_timeout_s=0)  # drain() marks it draining, no wait
        registration = Registration(WorkerRegistry(store.client), config, description)
        for _ in range(3):
            await registration.beat()
        await registration.drain()
        await registration.beat()
        await registration.beat()
        await registration.wait_registered()  # returns at once: registered
        await store.client.publish(CHANGES_CHANNEL, "end")  # what came before it is all there was
        messages: list[str] = []
        while messages[-1:] != ["end"]:
            message = await pubsub.get_message(timeout=1.0)  # None for the subscription's confirmation
            if message is not None:
                messages.append(message["data"].decode())
        messages.pop()
        assert messages == [W, W], "the first heartbeat and the first draining one"
        await pubsub.aclose()

    run(url, body)


def test_the_supervisor_takes_a_new_workers_lease_at_its_registration_not_a_tick(url: str) -> None:
    async def body(store: RedisStore) -> None:
        changes, stop, task = await listening(store)
        registry = WorkerRegistry(store.client)
        await registry.heartbeat(W, description(), draining=False, ttl_s=30)
        second = "10.0.0.2:1"
        leases = Leases(store.client, "a", ttl_s=LONG_S * 3)
        supervisor = Supervisor(registry, leases, Router(store), IdleLoop,  # type: ignore[arg-type]
                                tick_s=LONG_S, changes=changes)
        running = asyncio.create_task(supervisor.run(stop))
        while supervisor.worker_ids != [W]:  # its first tick
            await asyncio.sleep(0.01)
        await registry.heartbeat(second, description("i2"), draining=False, ttl_s=30, announce=True)
        while second not in supervisor.worker_ids:  # within the test's deadline, far less than a tick
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.gather(running, task)

    run(url, body)


def test_the_start_up_wait_for_a_worker_wakes_at_its_registration(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "WORKER_POLL_SECONDS", LONG_S)

    class ObservedRegistry(WorkerRegistry):
        """Tells when it has been read."""

        def __init__(self, client: object) -> None:
            super().__init__(client)  # type: ignore[arg-type]
            self.read = asyncio.Event()

        async def workers(self) -> list[WorkerEntry]:
            entries = await super().workers()
            self.read.set()
            return entries

    async def body(store: RedisStore) -> None:
        changes, stop, task = await listening(store)
        registry = ObservedRegistry(store.client)
        deadline = asyncio.get_running_loop().time() + LONG_S
        waiting = asyncio.create_task(server.wait_for_workers(registry, deadline, changes))
        await registry.read.wait()  # found nothing: it waits now
        await registry.heartbeat(W, description(), draining=False, ttl_s=30, announce=True)
        [entry] = await waiting
        assert entry.worker_id == W
        stop.set()
        await task

    run(url, body)
