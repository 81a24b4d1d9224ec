"""Leases, fencing, the worker registry and request hand-over against a real redis-server."""

from __future__ import annotations

import asyncio

import pytest

from protos import worker_pb2
from scheduler_service import keys
from scheduler_service.leases import LeaseLostError, Leases
from scheduler_service.store import RedisStore, StepCommit
from shared.worker_registry import WorkerRegistry, drained_key
from tests.integration.test_store import alive, record, run

W = "10.0.0.1:50061"


def test_one_holder_at_a_time_and_release_frees_the_lease(url: str) -> None:
    async def body(store: RedisStore) -> None:
        a, b = Leases(store.client, "a", ttl_s=5), Leases(store.client, "b", ttl_s=5)
        assert await a.acquire(W)
        assert not await b.acquire(W)
        assert await a.acquire(W)  # re-acquiring one's own lease renews it
        assert await a.owners([W, "other:1"]) == {W: "a", "other:1": ""}
        assert await a.renew([W]) == {W: True}
        assert await b.renew([W]) == {W: False}
        await b.release(W)  # not b's: nothing happens
        assert (await a.owners([W]))[W] == "a"
        await a.release(W)
        assert await b.acquire(W)

    run(url, body)


def test_an_expired_lease_goes_to_another_replica_and_fences_the_old_owner(url: str) -> None:
    async def body(store: RedisStore) -> None:
        a, b = Leases(store.client, "a", ttl_s=1), Leases(store.client, "b", ttl_s=5)
        assert await a.acquire(W)
        epoch_a = await a.next_epoch(W)
        await asyncio.sleep(1.2)  # a stalls past its TTL
        assert await b.acquire(W)
        epoch_b = await b.next_epoch(W)
        assert epoch_b == epoch_a + 1
        # a can neither renew, nor take a newer epoch (which would reset the worker under b) ...
        assert await a.renew([W]) == {W: False}
        with pytest.raises(LeaseLostError, match="no longer holds the lease"):
            await a.next_epoch(W)
        # ... nor commit: its step writes nothing.
        with pytest.raises(LeaseLostError, match="moved on to epoch"):
            await store.commit(StepCommit(W, epoch_a, new_tokens={1: [5]}))
        assert await store.client.llen(keys.seq_tokens(1)) == 0
        await store.commit(StepCommit(W, epoch_b, new_tokens={1: [6]}))
        assert await store.client.lrange(keys.seq_tokens(1), 0, -1) == [b"6"]

    run(url, body)


def test_the_replica_roster_counts_live_replicas(url: str) -> None:
    async def body(store: RedisStore) -> None:
        # TTLs of seconds: a loaded machine may take a while between two calls.
        a, b = Leases(store.client, "a", ttl_s=4), Leases(store.client, "b", ttl_s=20)
        assert await a.announce() == 1
        assert await b.announce() == 2
        await asyncio.sleep(2.5)  # a is counted for half its TTL
        assert await b.announce() == 1  # a stopped announcing
        await b.withdraw()
        assert await a.announce() == 1

    run(url, body)


def test_registry_liveness_draining_and_forget(url: str) -> None:
    async def body(store: RedisStore) -> None:
        reg = WorkerRegistry(store.client)
        desc = worker_pb2.WorkerDescription(model="m", block_size=16, num_gpu_blocks=40, instance_id="i1")
        await reg.heartbeat(W, desc, draining=False, ttl_s=3)
        [entry] = await reg.workers()
        assert (entry.worker_id, entry.alive, entry.routable, entry.description.num_gpu_blocks) == (W, True, True, 40)
        await reg.heartbeat(W, desc, draining=True, ttl_s=3)
        [entry] = await reg.workers()
        assert entry.alive and entry.draining and not entry.routable
        assert not await reg.is_drained(W, "i1")
        await reg.mark_drained(W, "i1")
        assert await reg.is_drained(W, "i1") and not await reg.is_drained(W, "i2")
        await store.client.set(keys.engine(W), b"x")
        assert not await reg.forget(W, [keys.engine(W)])  # still alive: a scheduler must not drop it
        assert await store.client.exists(keys.engine(W)) == 1
        await asyncio.sleep(3.2)
        [entry] = await reg.workers()
        assert not entry.alive and not entry.routable
        # The worker's state goes with its registration, in the same step; its epoch stays.
        state = keys.worker_state(W)
        for key in state:
            await store.client.set(key, b"x")
        await store.client.set(keys.epoch(W), 7)
        assert await reg.forget(W, state)
        assert await reg.workers() == []
        assert await store.client.exists(*state, drained_key(W)) == 0
        assert int(await store.client.get(keys.epoch(W))) == 7

    run(url, body)


def test_deregister_leaves_a_restarted_instance_alone(url: str) -> None:
    async def body(store: RedisStore) -> None:
        reg = WorkerRegistry(store.client)
        await reg.heartbeat(W, worker_pb2.WorkerDescription(instance_id="new"), draining=False, ttl_s=5)
        await reg.deregister(W, "old")  # the old process exits late
        assert [e.alive_instance for e in await reg.workers()] == ["new"]
        await reg.deregister(W, "new")
        assert await reg.workers() == []

    run(url, body)


def test_hand_over_moves_a_request_with_its_outputs(url: str) -> None:
    async def body(store: RedisStore) -> None:
        rec = record("r", seq_ids=[7], worker_id=W)
        await store.admit(rec)
        await alive(store, "w2:1")
        assert [r.request_id for r in (await store.commit(StepCommit(W))).admitted] == ["r"]
        await store.commit(StepCommit(W, new_tokens={7: [11, 12]}, handed_over=[(rec, "w2:1")]))
        assert await store.client.hget(keys.request("r"), "worker") == b"w2:1"
        assert await store.client.smembers(keys.live(W)) == set()
        assert await store.client.smembers(keys.live("w2:1")) == {b"r"}
        pickup = await store.commit(StepCommit("w2:1"))
        assert pickup.admitted == []
        [moved] = pickup.handed_over
        assert moved.record.worker_id == "w2:1" and moved.record.handed_over
        assert moved.outputs == {7: [11, 12]}

    run(url, body)


def test_a_new_epoch_is_taken_above_the_workers_when_redis_lost_the_counter(url: str) -> None:
    async def body(store: RedisStore) -> None:
        a = Leases(store.client, "a", ttl_s=5)
        assert await a.acquire(W)
        # The counter starts again from 0 (Redis lost its data); the worker has seen epoch 41.
        assert await a.next_epoch(W, above=41) == 42
        assert await a.next_epoch(W) == 43  # the counter went on from there
        # A floor behind the counter changes nothing: the counter never goes back.
        assert await a.next_epoch(W, above=7) == 44
        assert int(await store.client.get(keys.epoch(W))) == 44

    run(url, body)
