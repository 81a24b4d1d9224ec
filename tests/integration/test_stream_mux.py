"""A replica's output streams read through one XREAD (scheduler_service/stream_mux.py), real redis-server."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import redis

from protos import common_pb2
from scheduler_service.output_reader import follow
from scheduler_service.store import RedisStore, StepCommit
from scheduler_service.stream_mux import StreamMux, _Reader
from shared.errors import UnavailableError
from tests.integration.test_store import W, record, response, run
from tests.integration.test_store_resume import final, tokens


def test_many_readers_get_their_own_messages_from_their_own_index(url: str) -> None:
    async def body(store: RedisStore) -> None:
        mux = StreamMux(store)
        names = [f"r{i}" for i in range(8)]
        for name in names:
            await store.admit(record(name))
        await store.commit(StepCommit(W, outputs=[(n, response(n, "", [i])) for i, n in enumerate(names)]))
        # Every reader waits at once; a late index waits for messages not committed yet.
        waits = [asyncio.create_task(mux.read_from(n, 0 if i % 2 else 1, 5000)) for i, n in enumerate(names)]
        await asyncio.sleep(0.05)
        await store.commit(StepCommit(W, outputs=[(n, response(n, "", [100 + i])) for i, n in enumerate(names)]))
        got = await asyncio.gather(*waits)
        for i, msgs in enumerate(got):
            assert [m.request_id for m in msgs] == [names[i]] * len(msgs)
            assert msgs[0].index == (0 if i % 2 else 1)
            assert tokens(msgs)[0] == (i if i % 2 else 100 + i)

    run(url, body)


def test_a_reader_joining_a_blocked_read_is_answered_at_once(url: str, plain: redis.Redis) -> None:
    """The shared XREAD blocks on stream a; b's reader wakes it, so b's message needs no timeout to pass."""
    async def body(store: RedisStore) -> None:
        mux = StreamMux(store)
        await store.admit(record("a"))
        await store.admit(record("b"))
        waiting_a = asyncio.create_task(mux.read_from("a", 0, 20_000))
        await asyncio.sleep(0.1)  # the XREAD on a alone is in flight
        await store.commit(StepCommit(W, outputs=[("b", response("b", "", [7]))]))
        loop = asyncio.get_running_loop()
        started = loop.time()
        got = await mux.read_from("b", 0, 20_000)
        # Without the wake the reader would wait for the shared XREAD's 5 s block to end.
        assert tokens(got) == [7] and loop.time() - started < 4.0
        assert not waiting_a.done()
        await store.commit(StepCommit(W, outputs=[("a", response("a", "", [8]))]))
        assert tokens(await waiting_a) == [8]
        assert plain.exists(mux._wake_key)

    run(url, body)


def test_a_reader_times_out_empty_and_follow_streams_to_the_end(url: str) -> None:
    async def body(store: RedisStore) -> None:
        mux = StreamMux(store)
        await store.admit(record("a"))
        assert await mux.read_from("a", 0, 100) == []

        async def writer() -> None:
            for i in range(5):
                await asyncio.sleep(0.02)
                await store.commit(StepCommit(W, outputs=[("a", response("a", "", [i]))]))
            await store.commit(StepCommit(W, outputs=[("a", final("a", [5]))], finished_requests=["a"]))

        task = asyncio.create_task(writer())
        msgs = [m async for m in follow(store, "a", 0, 2000, mux.read_from)]
        await task
        assert tokens(msgs) == [0, 1, 2, 3, 4, 5] and [m.index for m in msgs] == list(range(6))
        assert msgs[-1].outputs[0].finish_reason == common_pb2.FINISH_REASON_LENGTH

    run(url, body)


def test_readers_learn_that_redis_went_away(redis_server) -> None:
    async def body() -> None:
        store = RedisStore.from_url(redis_server.url)
        try:
            mux = StreamMux(store)
            await store.admit(record("a"))
            reading = asyncio.create_task(mux.read_from("a", 0, 20_000))
            await asyncio.sleep(0.1)
            redis_server.stop()
            with pytest.raises(UnavailableError):
                await asyncio.wait_for(reading, 60)
        finally:
            await store.close()

    asyncio.run(body())


def test_a_reader_coming_back_for_more_needs_no_wake(url: str) -> None:
    """Streaming one request, message after message: the shared XREAD reads on from where the reader left
    off, so only a reader it does not cover (a second request joining) wakes it."""
    async def body(store: RedisStore) -> None:
        mux = StreamMux(store)
        wakes = 0
        wake = store.wake_reader

        async def counted(key: str) -> None:
            nonlocal wakes
            wakes += 1
            await wake(key)

        store.wake_reader = counted  # type: ignore[method-assign]
        for name in ("a", "b", "idle"):
            await store.admit(record(name))
        # A reader of a stream that stays quiet keeps the shared XREAD going all along, as other clients do.
        idle = asyncio.create_task(mux.read_from("idle", 0, 20_000))
        await asyncio.sleep(0.05)

        async def writer() -> None:
            for i in range(10):
                await asyncio.sleep(0.03)
                await store.commit(StepCommit(W, outputs=[("a", response("a", "", [i])), ("b", response("b", "", [i]))]))
            await store.commit(StepCommit(W, outputs=[("a", final("a", [10])), ("b", final("b", [10]))],
                                          finished_requests=["a", "b"]))

        task = asyncio.create_task(writer())
        first = [m async for m in follow(store, "a", 0, 2000, mux.read_from)]
        # One wake: a's first read (the XREAD in flight read only the quiet stream); none for the ten after it.
        assert tokens(first) == list(range(11)) and wakes == 1
        second = [m async for m in follow(store, "b", 0, 2000, mux.read_from)]
        await task
        assert tokens(second) == list(range(11)) and wakes <= 2
        idle.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await idle

    run(url, body)


def test_a_reader_joining_below_the_read_in_flight_misses_nothing(url: str) -> None:
    """The same request read twice (an idempotent re-send): the second reader starts at 0 while the shared
    XREAD reads the stream from 1 for the first one; what that XREAD returns must not be its first answer."""
    async def body(store: RedisStore) -> None:
        mux = StreamMux(store)

        async def late_wake(key: str) -> None:  # the wake arrives after the messages (the race, made certain)
            return None

        store.wake_reader = late_wake  # type: ignore[method-assign]
        await store.admit(record("a"))
        await store.commit(StepCommit(W, outputs=[("a", response("a", "", [0]))]))
        assert tokens(await mux.read_from("a", 0, 5000)) == [0]
        first = asyncio.create_task(mux.read_from("a", 1, 5000))  # reads on from 1
        await asyncio.sleep(0.05)
        second = asyncio.create_task(mux.read_from("a", 0, 5000))
        await asyncio.sleep(0.05)
        await store.commit(StepCommit(W, outputs=[("a", response("a", "", [1]))]))
        assert tokens(await first) == [1]
        got = await second
        assert [m.index for m in got] == [0, 1] and tokens(got) == [0, 1]

    run(url, body)


def test_a_reader_whose_wait_ended_is_skipped_and_the_others_answered(url: str) -> None:
    """A reader's wait can end (its deadline's empty answer, or its caller cancelled) in the same turn of the event
    loop as the XREAD that brings its messages: the mux leaves that reader be and answers the others."""
    async def body(store: RedisStore) -> None:
        mux = StreamMux(store)
        timed_out, cancelled, live = _Reader(0), _Reader(0), _Reader(0)
        timed_out.answer.set_result([])
        cancelled.answer.cancel()
        mux._readers["a"] = [timed_out, cancelled, live]
        message = response("a", "", [7])
        mux._deliver("a", 0, [message])
        assert live.answer.result() == [message] and timed_out.answer.result() == []
        # The two that left stay listed until their read_from removes them; the stream is read on after the message.
        assert mux._readers["a"] == [timed_out, cancelled] and mux._hints["a"][0] == 1

    run(url, body)
