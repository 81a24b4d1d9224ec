"""Stream indexes, resume and idempotent admission against a real redis-server.

Covers the store (indexed output entries, stream_info, admit-or-attach in one Lua step) and the
reader the servicer streams through (scheduler_service/output_reader.py).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from protos import common_pb2, generation_pb2
from scheduler_service import keys
from shared import defaults
from scheduler_service.output_reader import check_resumable, follow
from scheduler_service.store import (
    AdmitOutcome,
    DuplicateRequestError,
    QueueFullError,
    QueueLimits,
    RedisStore,
    StepCommit,
    StreamInfo,
    StreamState,
)
from shared.errors import InvalidRequestError, NotFoundError, OutOfRangeError, status_for
from tests.integration.test_store import W, record, response, run


def final(request_id: str, token_ids: list[int]) -> generation_pb2.GenerateResponse:
    msg = response(request_id, "", token_ids, common_pb2.FINISH_REASON_LENGTH)
    msg.usage.prompt_tokens, msg.usage.completion_tokens = 3, 9
    return msg


def tokens(msgs: list[generation_pb2.GenerateResponse]) -> list[int]:
    return [t for m in msgs for d in m.outputs for t in d.token_ids]


async def collect(store: RedisStore, request_id: str, from_index: int, block_ms: int = 200) -> list[generation_pb2.GenerateResponse]:
    return [m async for m in follow(store, request_id, from_index, block_ms)]


# -- indexes -----------------------------------------------------------------------------


def test_messages_get_consecutive_indexes_and_can_be_read_from_any_index(url: str, plain) -> None:
    async def body(store: RedisStore) -> None:
        await store.admit(record("a"))
        await store.admit(record("b"))
        # Two messages of "a" in one commit, interleaved with "b": each stream counts its own.
        await store.commit(StepCommit(W, outputs=[("a", response("a", "x", [1])), ("b", response("b", "y", [9])),
                                                  ("a", response("a", "x", [2]))]))
        await store.commit(StepCommit(W, outputs=[("a", response("a", "x", [3]))]))
        got = await store.read_from("a", 0, block_ms=100)
        assert [m.index for m in got] == [0, 1, 2] and tokens(got) == [1, 2, 3]
        assert [m.index for m in await store.read_from("b", 0, block_ms=100)] == [0]
        # The index is the entry id: any replica reads "from 2 on" with one XREAD.
        assert [e for e, _ in plain.xrange(keys.output_stream("a"))] == ["0-1", "0-2", "0-3"]
        from_two = await store.read_from("a", 2, block_ms=100)
        assert [m.index for m in from_two] == [2] and tokens(from_two) == [3]
        # The stored message is unchanged; the index is set on the way out.
        assert from_two[0] == generation_pb2.GenerateResponse(index=2, request_id="a", outputs=response("a", "x", [3]).outputs)
        # An index not reached yet: nothing now (without waiting), and a waiting read returns it once committed.
        assert await store.read_from("a", 3, block_ms=None) == []
        reader = asyncio.ensure_future(store.read_from("a", 3, block_ms=5000))
        await asyncio.sleep(0.2)
        assert not reader.done()
        await store.commit(StepCommit(W, outputs=[("a", response("a", "x", [4]))]))
        assert [(m.index, tokens([m])) for m in await asyncio.wait_for(reader, 5)] == [(3, [4])]

    run(url, body)


def test_stream_info_tells_live_finished_and_gone(url: str, plain) -> None:
    async def body(store: RedisStore) -> None:
        assert await store.stream_info("r") == StreamInfo(StreamState.GONE, 0)
        await store.admit(record("r"))
        assert await store.stream_info("r") == StreamInfo(StreamState.LIVE, 0)  # queued, nothing streamed yet
        await store.commit(StepCommit(W, outputs=[("r", response("r", "x", [1]))]))
        assert await store.stream_info("r") == StreamInfo(StreamState.LIVE, 1)
        await store.commit(StepCommit(W, outputs=[("r", final("r", [2]))], finished_requests=["r"]))
        assert await store.stream_info("r") == StreamInfo(StreamState.FINISHED, 2)
        plain.delete(keys.output_stream("r"))  # what the TTL does after defaults.OUTPUT_RETENTION_S
        assert await store.stream_info("r") == StreamInfo(StreamState.GONE, 0)

    run(url, body)


# -- idempotent admission ------------------------------------------------------------------


def test_the_same_request_reattaches_while_live_and_while_kept(url: str, plain) -> None:
    async def body(store: RedisStore) -> None:
        assert await store.admit(record("idem", seq_ids=[1]), digest="d1") is AdmitOutcome.ADMITTED
        # Same id and digest while live (other seq ids, as a re-sent call reserves): nothing is queued again.
        assert await store.admit(record("idem", seq_ids=[2]), digest="d1") is AdmitOutcome.ATTACHED
        assert plain.llen(keys.inbox(W)) == 1 and plain.hget(keys.queue(W), "requests") == "1"
        # Another request under the live id is refused, with what to do instead.
        with pytest.raises(DuplicateRequestError, match="request id 'idem' is already in use") as info:
            await store.admit(record("idem", prompt=(7, 7)), digest="d2")
        assert status_for(info.value) == grpc.StatusCode.ALREADY_EXISTS and "same request" in str(info.value)
        assert [r.seq_ids for r in (await store.commit(StepCommit(W))).admitted] == [[1]]
        await store.commit(StepCommit(W, outputs=[("idem", final("idem", [5]))], finished_requests=["idem"]))
        # Finished: the digest lives as long as the stream, and a re-send attaches to the kept stream.
        assert 0 < plain.ttl(keys.digest("idem")) <= defaults.OUTPUT_RETENTION_S
        assert await store.admit(record("idem", seq_ids=[3]), digest="d1") is AdmitOutcome.ATTACHED
        assert plain.llen(keys.inbox(W)) == 0 and plain.xlen(keys.output_stream("idem")) == 1
        # Another request under the finished id starts afresh (as before): old outputs and digest replaced.
        assert await store.admit(record("idem", seq_ids=[4], prompt=(8,)), digest="d2") is AdmitOutcome.ADMITTED
        assert plain.exists(keys.output_stream("idem")) == 0
        assert plain.get(keys.digest("idem")) == "d2" and plain.ttl(keys.digest("idem")) == -1

    run(url, body)


def test_server_chosen_ids_store_no_digest_and_never_attach(url: str, plain) -> None:
    async def body(store: RedisStore) -> None:
        assert await store.admit(record("srv")) is AdmitOutcome.ADMITTED
        assert plain.exists(keys.digest("srv")) == 0
        with pytest.raises(DuplicateRequestError):
            await store.admit(record("srv"))
        # An empty digest never matches, not even a stale empty one.
        with pytest.raises(DuplicateRequestError):
            await store.admit(record("srv"), digest="")
        # A reused id that had a digest loses it when admitted without one.
        await store.admit(record("reuse"), digest="d")
        await store.commit(StepCommit(W, outputs=[("reuse", final("reuse", [1]))], finished_requests=["reuse"]))
        assert await store.admit(record("reuse")) is AdmitOutcome.ADMITTED
        assert plain.exists(keys.digest("reuse")) == 0

    run(url, body)


def test_the_same_request_after_an_abort_runs_afresh(url: str, plain) -> None:
    # Its caller left (or aborted it): sent again, the caller wants an answer, not the stream that was cut off.
    async def body(store: RedisStore) -> None:
        await store.admit(record("cut", seq_ids=[1]), digest="d")
        assert [r.seq_ids for r in (await store.commit(StepCommit(W))).admitted] == [[1]]
        aborted = response("cut", "", [], common_pb2.FINISH_REASON_ABORT)
        await store.commit(StepCommit(W, outputs=[("cut", aborted)], finished_requests=["cut"],
                                      aborted_requests=["cut"]))
        assert plain.exists(keys.digest("cut")) == 0 and plain.xlen(keys.output_stream("cut")) == 1  # Resume reads it
        assert await store.admit(record("cut", seq_ids=[2]), digest="d") is AdmitOutcome.ADMITTED
        assert plain.exists(keys.output_stream("cut")) == 0 and plain.get(keys.digest("cut")) == "d"
        assert [r.seq_ids for r in (await store.commit(StepCommit(W))).admitted] == [[2]]

    run(url, body)


def test_a_kept_digest_without_its_stream_admits_afresh(url: str, plain) -> None:
    async def body(store: RedisStore) -> None:
        await store.admit(record("x"), digest="d")
        await store.commit(StepCommit(W, outputs=[("x", final("x", [1]))], finished_requests=["x"]))
        plain.delete(keys.output_stream("x"))  # the stream expired a moment before the digest
        assert await store.admit(record("x"), digest="d") is AdmitOutcome.ADMITTED

    run(url, body)


def test_a_resent_request_attaches_even_when_the_queue_is_full(url: str) -> None:
    async def body(store: RedisStore) -> None:
        limits = QueueLimits(max_requests=1)
        await store.admit(record("first"), limits, digest="d")
        with pytest.raises(QueueFullError):
            await store.admit(record("second"), limits, digest="e")
        # Re-attaching adds no work, so the bound does not refuse it.
        assert await store.admit(record("first"), limits, digest="d") is AdmitOutcome.ATTACHED

    run(url, body)


def test_concurrent_resends_admit_exactly_once(url: str, plain) -> None:
    """Many replicas receive the same request at once: one Lua step each, so exactly one admits it."""

    async def body(store: RedisStore) -> None:
        others = [RedisStore.from_url(url) for _ in range(3)]
        try:
            stores = [store, *others]
            outcomes = await asyncio.gather(*(stores[i % 4].admit(record("race", seq_ids=[i + 1]), digest="d")
                                              for i in range(24)))
        finally:
            for other in others:
                await other.close()
        assert sorted(o.value for o in outcomes) == ["admitted"] + ["attached"] * 23
        assert plain.llen(keys.inbox(W)) == 1 and plain.hget(keys.queue(W), "requests") == "1"

    run(url, body)


# -- the reader ------------------------------------------------------------------------------


def test_follow_yields_from_an_index_to_the_final_message_across_commits(url: str) -> None:
    async def body(store: RedisStore) -> None:
        await store.admit(record("f"))
        await store.commit(StepCommit(W, outputs=[("f", response("f", "x", [1])), ("f", response("f", "x", [2]))]))

        async def commit_later() -> None:
            await asyncio.sleep(0.3)
            await store.commit(StepCommit(W, outputs=[("f", response("f", "x", [3]))]))
            await asyncio.sleep(0.3)
            await store.commit(StepCommit(W, outputs=[("f", final("f", [4]))], finished_requests=["f"]))

        # From index 1 (index 3 is not committed yet): it waits, and stops after the final message.
        got, _ = await asyncio.gather(collect(store, "f", 1, block_ms=5000), commit_later())
        assert [m.index for m in got] == [1, 2, 3] and tokens(got) == [2, 3, 4]
        whole = await collect(store, "f", 0)
        assert [m.index for m in whole] == [0, 1, 2, 3] and whole[-1].HasField("usage")
        # A resumed reader joined to the messages before its index gives the whole stream once.
        assert whole[:1] + got == whole

    run(url, body)


def test_resume_checks_name_unknown_ids_and_indexes_past_a_finished_end(url: str) -> None:
    async def body(store: RedisStore) -> None:
        with pytest.raises(NotFoundError, match="no request has id 'nope'") as info:
            await check_resumable(store, "nope", 0)
        assert status_for(info.value) == grpc.StatusCode.NOT_FOUND
        with pytest.raises(InvalidRequestError, match="request_id is required"):
            await check_resumable(store, "", 0)
        await store.admit(record("live"))
        await check_resumable(store, "live", 50)  # a live request's future index is waited for
        await store.commit(StepCommit(W, outputs=[("live", response("live", "x", [1])), ("live", final("live", [2]))],
                                      finished_requests=["live"]))
        await check_resumable(store, "live", 1)
        with pytest.raises(OutOfRangeError, match=r"finished with 2 messages \(indexes 0 to 1\); index 2 is past") as err:
            await check_resumable(store, "live", 2)
        assert status_for(err.value) == grpc.StatusCode.OUT_OF_RANGE

    run(url, body)


def test_a_waiting_reader_ends_when_the_request_ends_before_its_index_or_expires(url: str, plain) -> None:
    async def body(store: RedisStore) -> None:
        await store.admit(record("short"))
        reader = asyncio.ensure_future(collect(store, "short", 5, block_ms=100))
        await asyncio.sleep(0.3)
        assert not reader.done()  # live: it waits
        await store.commit(StepCommit(W, outputs=[("short", final("short", [1]))], finished_requests=["short"]))
        with pytest.raises(OutOfRangeError, match="index 5 is past its end"):
            await asyncio.wait_for(reader, 5)

        await store.admit(record("vanish"))
        reader = asyncio.ensure_future(collect(store, "vanish", 0, block_ms=100))
        await asyncio.sleep(0.3)
        plain.delete(keys.request("vanish"))  # the record and stream are gone (as after expiry / a flush)
        with pytest.raises(NotFoundError, match="expired while it was being read"):
            await asyncio.wait_for(reader, 5)

    run(url, body)
