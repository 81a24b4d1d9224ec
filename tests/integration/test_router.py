"""The router against a real redis-server: live-request loads and the prompt-prefix index."""

from __future__ import annotations

import pytest

from protos import worker_pb2
from scheduler_service import keys
from scheduler_service.router import Router
from scheduler_service.store import RedisStore
from shared.errors import UnavailableError
from shared.worker_registry import WorkerEntry
from tests.integration.test_store import run

A, B = "10.0.0.1:50061", "10.0.0.2:50061"


def entries(*ids: str, draining: str = "", dead: str = "") -> list[WorkerEntry]:
    return [WorkerEntry(w, worker_pb2.WorkerDescription(), w == draining, "" if w == dead else "i") for w in ids]


def test_requests_sharing_a_prefix_follow_it_and_others_go_to_the_least_loaded(url: str) -> None:
    system = list(range(100, 148))  # three full blocks of 16 shared by both prompts

    async def body(store: RedisStore) -> None:
        router = Router(store, prefix_aware=True, block_size=16)
        router.update(entries(A, B))
        await store.client.sadd(keys.live(A), "x")  # A is busier by one live request
        first = await router.pick("r1", system + [1, 2, 3])
        assert first == B
        await store.client.sadd(keys.live(B), "r1")
        # Equal loads now; the shared prefix decides, whatever the request id hashes to.
        for i in range(8):
            assert await router.pick(f"r{i + 2}", system + [7, i]) == B
        # A prompt with another prefix goes to the least loaded worker.
        await store.client.sadd(keys.live(B), "y", "z", "w")
        assert await router.pick("other", list(range(500, 540))) == A
        # Once the prefix holder is busier than the slack allows, the prefix is recomputed elsewhere.
        assert await router.pick("again", system + [9]) == A

    run(url, body)


def test_without_prefix_caching_the_least_loaded_wins_and_nothing_is_indexed(url: str) -> None:
    async def body(store: RedisStore) -> None:
        router = Router(store, prefix_aware=False, block_size=16)
        router.update(entries(A, B))
        await store.client.sadd(keys.live(B), "x", "y")
        assert await router.pick("r", list(range(64))) == A
        assert await store.client.keys(keys.prefix_holder("*")) == []

    run(url, body)


def test_draining_and_dead_workers_get_nothing(url: str) -> None:
    async def body(store: RedisStore) -> None:
        router = Router(store)
        router.update(entries(A, B, "c:1", draining=A, dead="c:1"))
        assert router.workers == [B]
        assert {await router.pick(f"r{i}", [1, 2, 3]) for i in range(10)} == {B}
        router.update(entries(A, draining=A))
        with pytest.raises(UnavailableError, match="no worker is ready"):
            await router.pick("r", [1, 2, 3])

    run(url, body)
