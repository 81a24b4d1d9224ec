"""RedisStore.commit leaves exactly the state its StepCommit describes, commit after commit.

The specification is `apply_reference`: one plain command per write, in the documented order, with the
synchronous client, on database 1 of the same server. The store commits the same StepCommits to
database 0; after every commit both databases must hold the same keys, values, stream entries (ids
included) and expiries. The sequence covers what decode, preemption, beam search, n > 1, best_of,
finishes, hand-overs and snapshots put in a commit.
"""

from __future__ import annotations

import asyncio

import pytest
import redis

from protos import common_pb2, generation_pb2, state_pb2
from scheduler_service import keys
from shared import defaults
from scheduler_service.leases import LeaseLostError
from scheduler_service.store import CacheStats, RedisStore, StepCommit
from shared.redis_dump import redis_state
from shared.worker_registry import heartbeat_key

W, OTHER, GONE = "w0", "w1", "w2"
EPOCH = 3


def apply_reference(r: redis.Redis, c: StepCommit) -> None:
    """What each StepCommit field means in Redis, one command at a time (no transaction: the test is serial)."""
    for request_id, seq_ids in c.reset_seqs.items():
        for s in seq_ids:
            r.delete(keys.seq_tokens(s))
            r.hdel(keys.request(request_id), f"finished:{s}")
            r.hdel(keys.request(request_id), f"cum:{s}")
    for s, tokens in c.new_tokens.items():
        for t in tokens:
            r.rpush(keys.seq_tokens(s), t)
    for s in c.dropped_seqs:
        r.delete(keys.seq_tokens(s))
    w = c.worker_id
    if c.reset_engine_state:
        for key in (keys.seq_states(w), keys.seq_progress(w), keys.cached_blocks(w), keys.engine(w)):
            r.delete(key)
    for key, written, dropped in ((keys.seq_states(w), c.seq_states, c.dropped_seq_states),
                                  (keys.seq_progress(w), c.seq_progress, c.dropped_seq_states),
                                  (keys.cached_blocks(w), c.cached_blocks, c.uncached_blocks),
                                  (keys.engine(w), c.engine_fields, c.dropped_engine_fields)):
        for f in dropped:
            r.hdel(key, f)
        for f, v in written.items():
            r.hset(key, f, v)
    for request_id, msg in c.outputs:
        stream = keys.output_stream(request_id)
        r.xadd(stream, {"m": msg.SerializeToString()}, id=f"0-{r.xlen(stream) + 1}")
    for request_id, cumulative in c.cumulative_logprobs.items():
        for s, v in cumulative.items():
            r.hset(keys.request(request_id), f"cum:{s}", repr(v))
    for request_id, seqs in c.finished_seqs.items():
        for s, status in seqs.items():
            r.hset(keys.request(request_id), f"finished:{s}", status)
    for request_id in c.finished_requests:
        r.expire(keys.output_stream(request_id), defaults.OUTPUT_RETENTION_S)
        r.expire(keys.digest(request_id), defaults.OUTPUT_RETENTION_S)
        r.delete(keys.request(request_id))
        r.srem(keys.live(c.worker_id), request_id)
    for rec, target in c.handed_over:
        # To a live target it moves; from one gone meanwhile it comes back to the giver's inbox.
        to = target if r.exists(heartbeat_key(target)) else c.worker_id
        moved = state_pb2.AdmittedRequest()
        moved.CopyFrom(rec)
        moved.worker_id, moved.handed_over = to, True
        r.hset(keys.request(rec.request_id), "request", moved.SerializeToString())
        if to == target:
            r.hset(keys.request(rec.request_id), "worker", target)
            r.srem(keys.live(c.worker_id), rec.request_id)
            r.sadd(keys.live(target), rec.request_id)
        r.rpush(keys.inbox(to), moved.SerializeToString())
    for request_id in [*c.newly_scheduled, *c.finished_requests, *(rec.request_id for rec, _ in c.handed_over)]:
        prompt_tokens = r.hget(keys.queued(c.worker_id), request_id)
        if prompt_tokens is not None:
            r.hdel(keys.queued(c.worker_id), request_id)
            r.hincrby(keys.queue(c.worker_id), "requests", -1)
            r.hincrby(keys.queue(c.worker_id), "tokens", -int(prompt_tokens))
    for key, snapshot in ((keys.waiting(W), c.waiting), (keys.running(W), c.running), (keys.swapped(W), c.swapped)):
        if snapshot is not None:
            r.delete(key)
            for request_id in snapshot:
                r.rpush(key, request_id)
    if c.cache_stats is not None:
        for name, value in c.cache_stats.as_hash().items():
            r.hset(keys.stats(c.worker_id), name, value)
    if c.num_preemptions:
        r.hincrby(keys.stats(c.worker_id), "preemptions", c.num_preemptions)
    if c.num_swaps:
        r.hincrby(keys.stats(c.worker_id), "swaps", c.num_swaps)
    if c.num_worker_failures:
        r.hincrby(keys.stats(c.worker_id), "worker_failures", c.num_worker_failures)
    if c.pick_up:
        r.lpop(keys.inbox(c.worker_id), 64)
        r.lpop(keys.aborts(c.worker_id), 64)


def record(request_id: str, seq_ids: list[int], **sampling: object) -> state_pb2.AdmittedRequest:
    return state_pb2.AdmittedRequest(
        request_id=request_id, worker_id=W, seq_ids=seq_ids, arrival_time=float(seq_ids[0]),
        prompt_token_ids=list(range(1, 20)), sampling=common_pb2.SamplingParams(max_tokens=8, **sampling),
    )


def delta(request_id: str, token_ids: list[int], text: str = " x", index: int = 0, finish: int = 0,
          usage: bool = False) -> tuple[str, generation_pb2.GenerateResponse]:
    msg = generation_pb2.GenerateResponse(request_id=request_id, outputs=[
        generation_pb2.CompletionDelta(index=index, text=text, token_ids=token_ids, finish_reason=finish)])
    if usage:
        msg.usage.prompt_tokens, msg.usage.completion_tokens = 19, 3
    return request_id, msg


RECORDS = [record("a", [1]), record("b", [2]), record("n2", [3, 4], n=2), record("best", [5, 6], best_of=2),
           record("beam", [7, 8], use_beam_search=True, n=2), record("moved", [9]), record("bounced", [10])]
LENGTH = common_pb2.FINISH_REASON_LENGTH


def commits() -> list[StepCommit]:
    """A loop's commits, step by step (each with the loop's epoch)."""
    steps = [
        # Prefill: the scheduler state rewritten, first tokens and messages, snapshots, the admission queue count, stats; the
        # queued requests and the abort stay queued (no pick-up) until the next commit.
        StepCommit(W, pick_up=False, new_tokens={1: [100], 2: [200], 3: [300], 4: [400], 5: [500], 6: [600], 7: [700]},
                   reset_engine_state=True, seq_states={s: b"running %d" % s for s in range(1, 8)},
                   seq_progress={s: b"%d:0" % (32 + s) for s in range(1, 8)},
                   engine_fields={"valid": b"1", "clock": b"3", "step": b"record"},
                   outputs=[delta("a", [100]), delta("b", [200]), delta("n2", [300]), delta("n2", [400], index=1)],
                   cumulative_logprobs={"best": {5: -0.5, 6: -1.25}},
                   newly_scheduled=["a", "b", "n2", "best", "beam"], waiting=["moved"],
                   running=["a", "b", "n2", "best", "beam"], swapped=[], cache_stats=CacheStats(50, 64)),
        # Decode, a block boundary for seq 1, a beam fork (copy-on-write of seq 8's last block).
        StepCommit(W, new_tokens={1: [101], 2: [201], 3: [301], 4: [401], 5: [501], 6: [601], 7: [701], 8: [702]},
                   seq_states={1: b"grown", 7: b"copied", 8: b"forked"}, cached_blocks={0: b"c0", 2: b"c2"},
                   seq_progress={s: b"%d:0" % (33 + s) for s in range(1, 9)},
                   engine_fields={"clock": b"9"}, dropped_engine_fields=["step"],
                   outputs=[delta("a", [101], text=""), delta("b", [201]), delta("n2", [301]),
                            delta("n2", [401], index=1)],
                   cumulative_logprobs={"best": {5: -0.75, 6: -1.5}, "beam": {7: -0.1, 8: -0.2}},
                   cache_stats=CacheStats(47, 64, 8, 2)),
        # Preemption of b by recompute (its table goes and comes back), n2's second sequence ends.
        StepCommit(W, new_tokens={1: [102], 3: [302], 4: [402]}, seq_states={2: b"waiting", 4: b"finished"},
                   seq_progress={1: b"35:0", 2: b"0:0", 3: b"36:1"},
                   uncached_blocks=[2],
                   outputs=[delta("a", [102]), delta("n2", [302]), delta("n2", [402], index=1, finish=LENGTH)],
                   finished_seqs={"n2": {4: "FINISHED_LENGTH"}}, running=["a", "n2", "best", "beam"],
                   waiting=["b", "moved"], num_preemptions=1),
        # Beam search drops beam 8 and reuses its id in the same commit; a swap-out; a step the worker failed.
        StepCommit(W, reset_seqs={"beam": [8]}, new_tokens={8: [703, 704]}, seq_states={8: b"reforked", 5: b"swapped"},
                   cumulative_logprobs={"beam": {7: -0.3, 8: -0.4}}, swapped=["best"],
                   running=["a", "n2", "beam"], num_preemptions=1, num_swaps=1, num_worker_failures=1),
        # Finishes: a (stop), n2 (its last sequence), an aborted waiting request; the waiting ones are handed
        # over, one to a live worker, one to a worker gone meanwhile (it comes back; picked up next commit).
        StepCommit(W, new_tokens={1: [103], 3: [303]},
                   outputs=[delta("a", [103], finish=common_pb2.FINISH_REASON_STOP, usage=True),
                            delta("n2", [303], finish=LENGTH, usage=True)],
                   finished_requests=["a", "n2"], dropped_seqs=[1, 3, 4], dropped_seq_states=[1, 3, 4],
                   handed_over=[(RECORDS[-2], OTHER), (RECORDS[-1], GONE)], running=["beam"], waiting=["b"],
                   cache_stats=CacheStats(55, 64, 8, 2)),
        # Only outputs; then only lists, one long (the script pushes it in chunks).
        StepCommit(W, outputs=[delta("b", [202], text="")], finished_requests=["b"], dropped_seqs=[2], waiting=[]),
        StepCommit(W, new_tokens={6: [602], 5: list(range(100, 10_100))}, swapped=[],
                   running=["best", "beam"]),
        # best_of picks at the end: its one message; beam search ends too; an idle commit picks up nothing.
        StepCommit(W, outputs=[delta("best", [500, 501], usage=True, finish=LENGTH),
                               delta("beam", [700, 701], usage=True, finish=LENGTH)],
                   finished_requests=["best", "beam"], dropped_seqs=[5, 6, 7, 8], running=[],
                   cache_stats=CacheStats(64, 64, 8, 2)),
        StepCommit(W),
    ]
    for c in steps:
        c.epoch = EPOCH
    return steps


def _db(url: str, db: int) -> str:
    return f"{url.rsplit('/', 1)[0]}/{db}"


@pytest.fixture()
def clients(url: str):
    """Database 0 (the store's) and database 1 (the reference's) of one server, set up alike: the epoch,
    the admitted requests (digests included), an abort waiting to be picked up."""

    async def admit(db_url: str) -> None:
        store = RedisStore.from_url(db_url)
        try:
            for rec in RECORDS:
                await store.admit(rec, digest=f"digest-{rec.request_id}")
            assert await store.route_aborts(["b", "never-admitted"]) == 1
        finally:
            await store.close()

    dbs = []
    for db in (0, 1):
        dbs.append(redis.Redis.from_url(_db(url, db)))
        dbs[-1].set(keys.epoch(W), EPOCH)
        dbs[-1].set(heartbeat_key(OTHER), "alive")  # GONE has none
        asyncio.run(admit(_db(url, db)))
    yield dbs
    for client in dbs:
        client.close()


def test_every_commit_leaves_the_state_the_reference_writes(url: str, clients) -> None:
    ours, reference = clients

    async def body() -> None:
        store = RedisStore.from_url(_db(url, 0))
        try:
            for step, c in enumerate(commits()):
                await store.commit(c)
                apply_reference(reference, c)
                assert redis_state(ours) == redis_state(reference), f"after commit {step}"
        finally:
            await store.close()

    asyncio.run(body())
    assert ours.dbsize() > 0  # the comparison compared something


def test_a_stale_epoch_writes_none_of_it(url: str, clients) -> None:
    ours, _ = clients
    before = redis_state(ours)

    async def body() -> None:
        store = RedisStore.from_url(_db(url, 0))
        try:
            for c in commits():
                c.epoch = EPOCH - 1
                with pytest.raises(LeaseLostError):
                    await store.commit(c)
        finally:
            await store.close()

    asyncio.run(body())
    assert redis_state(ours) == before
