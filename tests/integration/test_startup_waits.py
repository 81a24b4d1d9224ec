"""A scheduler replica's start-up waits for Redis (a fresh deployment starts Redis and the replicas at once) and for a
first worker, saying so while it waits, and gives up past its deadline with one line that says why."""

from __future__ import annotations

import asyncio
import logging

import pytest

from scheduler_service import server
from scheduler_service.store import RedisStore
from shared import redis_client
from shared.errors import StartupError
from shared.redis_server import RedisServer, free_port
from shared.registry_changes import RegistryChanges
from shared.worker_registry import WorkerRegistry

LONG_S = 120.0


def test_start_up_waits_for_a_redis_that_comes_later(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="scheduler_service.server")
    redis = RedisServer(port=free_port())

    def warned() -> bool:
        return any("does not answer yet" in r.getMessage() for r in caplog.records)

    async def go() -> None:
        store = RedisStore(redis_client.connect(redis.url))
        try:
            loop = asyncio.get_running_loop()
            waiting = asyncio.create_task(server.wait_for_redis(store, redis.url, loop.time() + LONG_S))
            while not warned():  # the first refused ping is logged at once
                assert not waiting.done(), waiting
                await asyncio.sleep(0.01)
            await asyncio.to_thread(redis.start)
            await asyncio.wait_for(waiting, LONG_S)
        finally:
            await store.close()

    try:
        asyncio.run(go())
    finally:
        redis.stop()
    (line,) = [r.getMessage() for r in caplog.records if "does not answer yet" in r.getMessage()]
    assert line.startswith(f"Redis at {redis.url} does not answer yet (the state store is unavailable: ")


def test_past_the_deadline_start_up_says_what_stayed_away() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there

    async def no_redis() -> None:
        store = RedisStore(redis_client.connect(url))
        try:
            await server.wait_for_redis(store, url, asyncio.get_running_loop().time() + 0.5)
        finally:
            await store.close()

    with pytest.raises(StartupError, match=rf"^Redis at {url} did not answer within 0 s: the state store is"):
        asyncio.run(no_redis())

    redis = RedisServer().start()

    async def no_worker() -> None:
        client = redis_client.connect(redis.url)
        changes, stop = RegistryChanges(client), asyncio.Event()
        task = asyncio.create_task(changes.run(stop))
        try:
            await server.wait_for_workers(WorkerRegistry(client), asyncio.get_running_loop().time() + 0.5, changes)
        finally:
            stop.set()
            await task
            await client.aclose()

    try:
        with pytest.raises(StartupError, match="^no worker registered in Redis within 0 s; start workers with the same"):
            asyncio.run(no_worker())
    finally:
        redis.stop()
