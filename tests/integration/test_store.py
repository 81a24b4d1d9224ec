"""RedisStore against a real redis-server: admission, step commits, pickups, outputs, failures."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import grpc
import pytest
import redis

from protos import common_pb2, generation_pb2, state_pb2, worker_pb2
from scheduler_service import keys
from shared import defaults
from scheduler_service.output_reader import check_resumable
from scheduler_service.store import (
    INBOX_BATCH,
    CacheStats,
    DuplicateRequestError,
    Pickup,
    RedisStore,
    AdmitOutcome,
    StepCommit,
    WorkerGoneError,
)
from shared.errors import AlreadyExistsError, NotFoundError, UnavailableError, status_for
from shared.worker_registry import WorkerRegistry

W = "w0"


def unindexed(msgs: list[generation_pb2.GenerateResponse]) -> list[generation_pb2.GenerateResponse]:
    """The messages without the stream index read_from sets, to compare them with what was committed."""
    for m in msgs:
        m.ClearField("index")
    return msgs


def run(url: str, body: Callable[[RedisStore], Awaitable[None]]) -> None:
    """Runs one async test body with a fresh store (pytest-asyncio is not installed)."""

    async def main() -> None:
        store = RedisStore.from_url(url)
        try:
            await asyncio.wait_for(body(store), timeout=10)
        finally:
            await store.close()

    asyncio.run(main())


def record(request_id: str, seq_ids: list[int] | None = None, worker_id: str = W, prompt=(1, 2, 3)) -> state_pb2.AdmittedRequest:
    return state_pb2.AdmittedRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling=common_pb2.SamplingParams(max_tokens=5, temperature=0.5, seed=3, stop=["x"]),
        arrival_time=1700000000.25,
        seq_ids=seq_ids or [1],
        worker_id=worker_id,
    )


def response(request_id: str, text: str, token_ids: list[int], finish: int = 0) -> generation_pb2.GenerateResponse:
    return generation_pb2.GenerateResponse(
        request_id=request_id,
        outputs=[generation_pb2.CompletionDelta(index=0, text=text, token_ids=token_ids, finish_reason=finish)],
    )


# -- admission ---------------------------------------------------------------------------


def test_reserve_seq_ids_are_consecutive_and_unique(url: str) -> None:
    async def body(store: RedisStore) -> None:
        assert await store.reserve_seq_ids(1) == [1]
        assert await store.reserve_seq_ids(3) == [2, 3, 4]
        assert await store.reserve_seq_ids(2) == [5, 6]
        # Another replica (another client) continues the same sequence.
        other = RedisStore.from_url(url)
        try:
            assert await other.reserve_seq_ids(2) == [7, 8]
            batches = await asyncio.gather(*(s.reserve_seq_ids(n) for n in (1, 2, 3) for s in (store, other) for _ in range(5)))
        finally:
            await other.close()
        for batch in batches:
            assert batch == list(range(batch[0], batch[0] + len(batch)))
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(9, 9 + 5 * 2 * (1 + 2 + 3)))
        assert await store.reserve_seq_ids(1) == [9 + 60]

    run(url, body)


def test_admit_then_commit_picks_up_the_record(url: str, plain) -> None:
    rec = record("req-1", seq_ids=[4])

    async def body(store: RedisStore) -> None:
        await store.admit(rec)
        assert plain.hmget(keys.request("req-1"), ["worker", "state"]) == [W, "queued"]
        assert sorted(plain.hkeys(keys.request("req-1"))) == ["request", "state", "worker"]
        assert plain.llen(keys.inbox(W)) == 1
        pickup = await store.commit(StepCommit(W))
        assert isinstance(pickup, Pickup)
        assert pickup.aborts == []
        assert len(pickup.admitted) == 1
        got = pickup.admitted[0]
        assert got == rec
        assert got.SerializeToString() == rec.SerializeToString()
        assert got.sampling.HasField("seed") and got.sampling.seed == 3
        # Picked up once: the inbox is drained, the next commit gets nothing.
        assert plain.llen(keys.inbox(W)) == 0
        assert await store.commit(StepCommit(W)) == Pickup([], [])
        # The record stays until the request finishes.
        with redis.Redis.from_url(url) as raw_client:
            raw = raw_client.hget(keys.request("req-1"), "request")
        assert state_pb2.AdmittedRequest.FromString(raw) == rec

    run(url, body)


def test_admitted_requests_go_to_their_own_worker_in_order_and_in_batches(url: str) -> None:
    async def body(store: RedisStore) -> None:
        n = INBOX_BATCH + 6
        for i in range(n):
            await store.admit(record(f"r{i}", seq_ids=[i + 1]))
        await store.admit(record("other", worker_id="w1"))
        first = await store.commit(StepCommit(W))
        assert [r.request_id for r in first.admitted] == [f"r{i}" for i in range(INBOX_BATCH)]
        second = await store.commit(StepCommit(W))
        assert [r.request_id for r in second.admitted] == [f"r{i}" for i in range(INBOX_BATCH, n)]
        assert (await store.commit(StepCommit(W))).admitted == []
        assert [r.request_id for r in (await store.commit(StepCommit("w1"))).admitted] == ["other"]

    run(url, body)


def test_duplicate_request_id_is_refused(url: str, plain) -> None:
    async def body(store: RedisStore) -> None:
        await store.admit(record("dup", prompt=(1, 2)))
        with pytest.raises(DuplicateRequestError, match="request id 'dup' is already in use") as info:
            await store.admit(record("dup", prompt=(9, 9, 9)))
        assert isinstance(info.value, AlreadyExistsError)
        assert status_for(info.value) == grpc.StatusCode.ALREADY_EXISTS
        # Nothing of the second attempt was written.
        assert plain.llen(keys.inbox(W)) == 1
        pickup = await store.commit(StepCommit(W))
        assert [list(r.prompt_token_ids) for r in pickup.admitted] == [[1, 2]]
        # Once the request finished, its id may be used again.
        await store.commit(StepCommit(W, finished_requests=["dup"]))
        await store.admit(record("dup", prompt=(5,)))
        pickup = await store.commit(StepCommit(W))
        assert [list(r.prompt_token_ids) for r in pickup.admitted] == [[5]]

    run(url, body)


# -- commits -----------------------------------------------------------------------------


def test_commit_writes_tokens_sequence_states_snapshots_and_stats(url: str, plain) -> None:
    async def body(store: RedisStore) -> None:
        await store.commit(
            StepCommit(
                W,
                new_tokens={1: [10], 2: [20]},
                seq_states={1: b"one", 2: b"two"},
                waiting=["c", "d"],
                running=["a", "b"],
                swapped=["e"],
                cache_stats=CacheStats(13, 16),
                num_preemptions=2,
            )
        )
        assert plain.lrange(keys.seq_tokens(1), 0, -1) == ["10"]
        assert plain.lrange(keys.seq_tokens(2), 0, -1) == ["20"]
        assert plain.hgetall(keys.seq_states(W)) == {"1": "one", "2": "two"}
        assert plain.lrange(keys.waiting(W), 0, -1) == ["c", "d"]
        assert plain.lrange(keys.running(W), 0, -1) == ["a", "b"]
        assert plain.lrange(keys.swapped(W), 0, -1) == ["e"]
        assert plain.hgetall(keys.stats(W)) == {"free": "13", "total": "16", "prefix_cache_queries": "0", "prefix_cache_hits": "0", "preemptions": "2"}

        # Appends; unchanged snapshots (None) are left alone; an empty snapshot clears the list.
        await store.commit(
            StepCommit(W, new_tokens={1: [11, 12]}, seq_states={1: b"one'"}, dropped_seq_states=[2], waiting=[],
                       cache_stats=CacheStats(12, 16, 4, 1), num_preemptions=1)
        )
        assert plain.lrange(keys.seq_tokens(1), 0, -1) == ["10", "11", "12"]
        assert plain.hgetall(keys.seq_states(W)) == {"1": "one'"}
        assert plain.exists(keys.waiting(W)) == 0
        assert plain.lrange(keys.running(W), 0, -1) == ["a", "b"]
        assert plain.hgetall(keys.stats(W)) == {"free": "12", "total": "16", "prefix_cache_queries": "4", "prefix_cache_hits": "1", "preemptions": "3"}

        # A new snapshot replaces the old list entirely.
        await store.commit(StepCommit(W, running=["b"]))
        assert plain.lrange(keys.running(W), 0, -1) == ["b"]
        # Nothing else was touched by that commit.
        assert plain.lrange(keys.seq_tokens(2), 0, -1) == ["20"]
        assert plain.hgetall(keys.stats(W)) == {"free": "12", "total": "16", "prefix_cache_queries": "4", "prefix_cache_hits": "1", "preemptions": "3"}

    run(url, body)


def test_engine_state_rewrite_and_dropped_seqs(url: str, plain) -> None:
    async def body(store: RedisStore) -> None:
        await store.commit(StepCommit(W, new_tokens={1: [10], 2: [20]}, seq_states={1: b"a", 2: b"b"},
                                      cached_blocks={7: b"c7", 8: b"c8"}, engine_fields={"valid": b"1", "step": b"s"}))
        # A block leaves the cache, the step record goes; nothing else changes.
        await store.commit(StepCommit(W, uncached_blocks=[7], dropped_engine_fields=["step"]))
        assert plain.hgetall(keys.cached_blocks(W)) == {"8": "c8"}
        assert plain.hgetall(keys.engine(W)) == {"valid": "1"}
        # A rewrite drops the three hashes first, then writes what the commit holds.
        await store.commit(StepCommit(W, reset_engine_state=True, seq_states={2: b"b'"}, engine_fields={"valid": b"1"}))
        assert plain.hgetall(keys.seq_states(W)) == {"2": "b'"}
        assert plain.exists(keys.cached_blocks(W)) == 0
        assert plain.hgetall(keys.engine(W)) == {"valid": "1"}
        # Finished seqs lose their token lists.
        await store.commit(StepCommit(W, dropped_seqs=[1, 2]))
        assert plain.exists(keys.seq_tokens(1), keys.seq_tokens(2)) == 0

    run(url, body)


def test_reset_seqs_wipe_a_reused_seq_id_before_the_commit_writes_its_new_sequence(url: str, plain) -> None:
    async def body(store: RedisStore) -> None:
        await store.admit(record("beams", [1, 2]))
        await store.commit(StepCommit(
            W, new_tokens={1: [10, 11], 2: [12]},
            finished_seqs={"beams": {2: "FINISHED_STOPPED"}}, cumulative_logprobs={"beams": {1: -1.5, 2: -0.5}},
        ))
        # Beam 1 is dropped; its id comes back in the same commit as a fork with other tokens and blocks.
        await store.commit(StepCommit(
            W, reset_seqs={"beams": [1, 2]}, new_tokens={1: [10, 13]},
            cumulative_logprobs={"beams": {1: -2.0}},
        ))
        assert plain.lrange(keys.seq_tokens(1), 0, -1) == ["10", "13"]
        assert plain.exists(keys.seq_tokens(2)) == 0
        fields = plain.hkeys(keys.request("beams"))
        assert "cum:1" in fields and "cum:2" not in fields and "finished:2" not in fields
        assert plain.hget(keys.request("beams"), "cum:1") == "-2.0"

    run(url, body)


def test_outputs_are_read_in_order_and_finished_requests_expire(url: str, plain) -> None:
    async def body(store: RedisStore) -> None:
        await store.admit(record("a"))
        await store.admit(record("b"))
        await store.commit(StepCommit(W, outputs=[("a", response("a", "He", [1])), ("b", response("b", "X", [9]))]))
        await store.commit(StepCommit(W, outputs=[("a", response("a", "llo", [2, 3]))]))
        await store.commit(
            StepCommit(
                W,
                outputs=[("a", response("a", "!", [4], common_pb2.FINISH_REASON_STOP))],
                finished_requests=["a"],
                dropped_seqs=[1],
            )
        )
        got = await store.read_from("a", 0, block_ms=100)
        assert [m.index for m in got] == [0, 1, 2]
        assert unindexed(got) == [
            response("a", "He", [1]),
            response("a", "llo", [2, 3]),
            response("a", "!", [4], common_pb2.FINISH_REASON_STOP),
        ]
        # Reading from an index returns only what came from there on.
        later = await store.read_from("a", 1, block_ms=100)
        assert [m.index for m in later] == [1, 2]
        # Nothing from past the last index: waits block_ms and returns nothing.
        t0 = time.monotonic()
        assert await store.read_from("a", 3, block_ms=200) == []
        assert time.monotonic() - t0 >= 0.15
        # Finished: the stream lingers with a TTL, the request record is gone.
        assert 0 < plain.ttl(keys.output_stream("a")) <= defaults.OUTPUT_RETENTION_S
        assert plain.ttl(keys.output_stream("a")) > defaults.OUTPUT_RETENTION_S - 60
        assert plain.exists(keys.request("a")) == 0
        # The unfinished request keeps its record and a stream without TTL.
        assert plain.ttl(keys.output_stream("b")) == -1
        assert plain.exists(keys.request("b")) == 1
        assert unindexed(await store.read_from("b", 0, block_ms=100)) == [response("b", "X", [9])]

    run(url, body)


def test_a_finished_requests_output_is_kept_for_the_configured_retention(url: str, plain) -> None:
    async def body(store: RedisStore) -> None:
        kept = RedisStore(store.client, output_ttl_s=120)  # --output-retention 120
        await kept.admit(record("c"), digest="d1")
        # As the output processor commits it: without the request id, which the stream's key names.
        final = response("", "!", [4], common_pb2.FINISH_REASON_STOP)
        await kept.commit(StepCommit(W, outputs=[("c", final)], finished_requests=["c"], dropped_seqs=[1]))
        (read,) = await kept.read_from("c", 0, block_ms=None)
        assert read.request_id == "c" and read.outputs == final.outputs
        for key in (keys.output_stream("c"), keys.digest("c")):
            assert 60 < plain.ttl(key) <= 120
        with pytest.raises(NotFoundError, match="finished more than 120 s ago"):
            await check_resumable(kept, "gone", 0)

    run(url, body)


def test_read_from_waits_for_a_later_commit(url: str) -> None:
    async def body(store: RedisStore) -> None:
        reader = asyncio.ensure_future(store.read_from("r", 0, block_ms=5000))
        await asyncio.sleep(0.2)
        assert not reader.done()
        await store.commit(StepCommit(W, outputs=[("r", response("r", "hi", [5]))]))
        got = await asyncio.wait_for(reader, timeout=5)
        assert unindexed(got) == [response("r", "hi", [5])]

    run(url, body)


def test_aborts_go_to_the_worker_serving_the_request_and_the_next_commit_picks_them_up(url: str) -> None:
    async def body(store: RedisStore) -> None:
        await store.admit(record("a"))
        await store.admit(record("elsewhere", worker_id="w1", seq_ids=[2]))
        assert await store.route_aborts(["a", "zz", "elsewhere"]) == 2  # zz: no such request
        pickup = await store.commit(StepCommit(W))
        assert [r.request_id for r in pickup.admitted] == ["a"]
        assert pickup.aborts == ["a"]
        assert await store.commit(StepCommit(W)) == Pickup([], [])
        assert (await store.commit(StepCommit("w1"))).aborts == ["elsewhere"]

    run(url, body)


def test_an_abort_follows_a_handed_over_request_and_its_old_worker_forwards_none(url: str) -> None:
    async def body(store: RedisStore) -> None:
        rec = record("moving")
        await store.admit(rec)
        await store.commit(StepCommit(W))
        await alive(store, "w1")
        await store.commit(StepCommit(W, handed_over=[(rec, "w1")]))
        assert await store.route_aborts(["moving"]) == 1
        assert await store.route_aborts(["moving"], skip_worker="w1") == 0  # w1 itself does not forward it
        w1 = await store.commit(StepCommit("w1"))
        assert [r.record.request_id for r in w1.handed_over] == ["moving"] and w1.aborts == ["moving"]
        assert (await store.commit(StepCommit(W))).aborts == []

    run(url, body)


def test_a_commit_without_pick_up_leaves_the_queues_to_the_next_owner(url: str) -> None:
    async def body(store: RedisStore) -> None:
        await store.admit(record("queued"))
        await store.route_aborts(["queued"])
        assert await store.commit(StepCommit(W, pick_up=False, new_tokens={1: [5]})) == Pickup([], [])
        assert await store.client.lrange(keys.seq_tokens(1), 0, -1) == [b"5"]
        pickup = await store.commit(StepCommit(W))
        assert [r.request_id for r in pickup.admitted] == ["queued"] and pickup.aborts == ["queued"]

    run(url, body)


async def alive(store: RedisStore, worker_id: str) -> None:
    """Registers the worker with a heartbeat (as a running worker keeps doing)."""
    await WorkerRegistry(store.client).heartbeat(worker_id, worker_pb2.WorkerDescription(instance_id="i"), False, 5)


def test_admission_that_requires_a_live_worker_refuses_one_without_a_heartbeat(url: str) -> None:
    async def body(store: RedisStore) -> None:
        with pytest.raises(WorkerGoneError, match=f"worker {W} left"):
            await store.admit(record("late"), require_alive=True)
        assert not await store.client.exists(keys.request("late"), keys.inbox(W), keys.live(W))
        await alive(store, W)
        assert await store.admit(record("late"), require_alive=True) is AdmitOutcome.ADMITTED

    run(url, body)


def test_a_request_handed_over_to_a_worker_gone_meanwhile_comes_back_with_its_outputs(url: str) -> None:
    async def body(store: RedisStore) -> None:
        rec = record("bounce", seq_ids=[4])
        await store.admit(rec)
        await store.commit(StepCommit(W))
        # The same commit picks it up again (its pick-up comes after its writes).
        [back] = (await store.commit(StepCommit(W, new_tokens={4: [21, 22]}, handed_over=[(rec, "dead:1")]))).handed_over
        assert back.record.worker_id == W and back.record.handed_over and back.outputs == {4: [21, 22]}
        assert await store.client.hget(keys.request("bounce"), "worker") == W.encode()
        assert await store.client.smembers(keys.live(W)) == {b"bounce"}
        assert not await store.client.exists(keys.inbox("dead:1"), keys.live("dead:1"))

    run(url, body)


# -- waiting for work ----------------------------------------------------------------------


def test_wait_for_work_returns_a_record_admitted_while_it_waits(url: str) -> None:
    rec = record("late", seq_ids=[8])

    async def body(store: RedisStore) -> None:
        waiter = asyncio.ensure_future(store.wait_for_work(W, timeout=5))
        await asyncio.sleep(0.2)
        assert not waiter.done()
        admitter = RedisStore.from_url(url)
        try:
            await admitter.admit(rec)
        finally:
            await admitter.close()
        pickup = await asyncio.wait_for(waiter, timeout=5)
        assert pickup.admitted == [rec]
        assert pickup.aborts == []
        # Consumed: a commit does not see it again.
        assert (await store.commit(StepCommit(W))).admitted == []

    run(url, body)


def test_wait_for_work_returns_an_abort(url: str) -> None:
    async def body(store: RedisStore) -> None:
        await store.admit(record("x"))
        assert (await store.commit(StepCommit(W))).admitted  # picked up: only the abort will be queued
        waiter = asyncio.ensure_future(store.wait_for_work(W, timeout=5))
        await asyncio.sleep(0.1)
        await store.route_aborts(["x"])
        assert await asyncio.wait_for(waiter, timeout=5) == Pickup([], ["x"])

    run(url, body)


def test_wait_for_work_returns_immediately_when_work_is_queued(url: str) -> None:
    async def body(store: RedisStore) -> None:
        await store.admit(record("a"))
        await store.admit(record("b"))
        # Queued work is returned without waiting out the timeout: a wait of 600 s that had blocked would miss
        # the 30 s deadline, which is far above what the pickup takes on any machine.
        first = await asyncio.wait_for(store.wait_for_work(W, timeout=600), timeout=30)
        assert [r.request_id for r in first.admitted] == ["a"]
        # One item per wait; the rest is left for the next commit.
        assert [r.request_id for r in (await store.commit(StepCommit(W))).admitted] == ["b"]

    run(url, body)


def test_wait_for_work_times_out_with_an_empty_pickup(url: str) -> None:
    async def body(store: RedisStore) -> None:
        await store.admit(record("other", worker_id="w1"))  # another worker's work does not wake us
        t0 = time.monotonic()
        pickup = await store.wait_for_work(W, timeout=0.3)
        elapsed = time.monotonic() - t0
        assert pickup == Pickup([], [])
        assert 0.25 <= elapsed < 10.0  # at least the timeout; the bound only catches a wait that never ends

    run(url, body)


# -- failures ------------------------------------------------------------------------------


def test_ping_on_a_stopped_server_raises_unavailable(redis_server) -> None:
    async def body(store: RedisStore) -> None:
        await store.ping()
        redis_server.stop()
        with pytest.raises(UnavailableError, match="the state store is unavailable") as info:
            await store.ping()
        assert status_for(info.value) == grpc.StatusCode.UNAVAILABLE
        # A store that never connected fails the same way.
        fresh = RedisStore.from_url(redis_server_url)
        try:
            with pytest.raises(UnavailableError):
                await fresh.ping()
        finally:
            await fresh.close()

    redis_server_url = redis_server.url
    run(redis_server_url, body)


def test_reusing_a_finished_request_id_does_not_replay_old_outputs(url: str, plain) -> None:
    async def body(store: RedisStore) -> None:
        await store.admit(record("again"))
        old = response("again", "old", [1], common_pb2.FINISH_REASON_STOP)
        await store.commit(StepCommit(W, outputs=[("again", old)], finished_requests=["again"]))
        try:
            await store.admit(record("again"))
        except DuplicateRequestError:
            return  # refusing the reuse while old outputs are readable would also be correct
        await store.commit(StepCommit(W, outputs=[("again", response("again", "new", [2]))]))
        got = unindexed(await store.read_from("again", 0, block_ms=100))
        assert old not in got
        assert got == [response("again", "new", [2])]

    run(url, body)


def test_load_picked_up_returns_live_requests_with_outputs_and_finished_sequences(url: str, plain) -> None:
    async def body(store: RedisStore) -> None:
        first = record("a", seq_ids=[1, 2])
        first.arrival_time = 5.0
        second = record("b", seq_ids=[3])
        second.arrival_time = 2.0
        for r in (first, second):
            await store.admit(r)
        pickup = await store.commit(StepCommit(W, new_tokens={1: [7, 8], 2: [9], 3: [5]},
                                               finished_seqs={"a": {2: "FINISHED_STOPPED"}},
                                               cumulative_logprobs={"a": {1: -1.25, 2: -0.5}}))
        assert len(pickup.admitted) == 2
        # Admitted after the engine's last pickup: still in the inbox, so not the new owner's to restore.
        await store.admit(record("still-queued", seq_ids=[4]))
        restored = await store.load_picked_up(W)
        assert [r.record.request_id for r in restored] == ["b", "a"]  # FCFS by arrival
        assert restored[0].outputs == {3: [5]} and restored[0].finished == {}
        assert restored[1].outputs == {1: [7, 8], 2: [9]} and restored[1].finished == {2: "FINISHED_STOPPED"}
        assert restored[1].cumulative_logprobs == {1: -1.25, 2: -0.5} and restored[0].cumulative_logprobs == {}
        assert restored[1].record == first

    run(url, body)
