"""Redis holds enough after every commit to rebuild the scheduler exactly (state_journal.py, takeover.py).

The scheduler state machines of the unit tests drive a live scheduler; at random points (a step planned
and not run included) the engine loop's journal writes what changed into a commit, RedisStore commits it
to a real redis-server, and a new owner's load (RedisStore.load_engine_state, takeover_from_store,
restore_scheduler) must give the same scheduler: queues, tables, reference counts, free lists, prefix
hashes and the evictor's order, computed counts, swapped tables, and the step in flight. The machine then
goes on with the rebuilt scheduler, so every later check of the machine runs against it.
"""

from __future__ import annotations

import asyncio

import pytest
import redis
from hypothesis import event, settings
from hypothesis.stateful import rule

from tests.hypothesis_profiles import examples

from protos import state_pb2, worker_pb2
from scheduler_service import keys
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sequence import SequenceStatus
from scheduler_service.core.snapshot import restore_scheduler, restore_step
from scheduler_service.state_journal import StateJournal, step_record
from scheduler_service.store import RedisStore, StepCommit
from scheduler_service.takeover import takeover_from_store
from shared.redis_server import RedisServer
from shared.sampling_proto import sampling_to_proto
from tests.unit.test_chunked_prefill import ChunkedPrefixCachingMachine
from tests.unit.test_scheduler import SchedulerMachine, make_group_of, make_scheduler, step
from tests.unit.test_scheduler_snapshot import assert_same_scheduler

W = "w0"
INSTANCE = "instance-1"
_SERVER: dict[str, RedisServer] = {}


@pytest.fixture(scope="module", autouse=True)
def redis_for_machines():
    """One redis-server for every example (each starts with FLUSHALL)."""
    with RedisServer() as server:
        _SERVER["server"] = server
        yield
        _SERVER.clear()


def _write_requests(client: redis.Redis, scheduler: Scheduler) -> None:
    """What admission and the steps' results put in Redis: the records, the live set, the token lists."""
    pipe = client.pipeline()
    pipe.delete(keys.live(W))  # finished and aborted requests leave it (the commit of their last step)
    for group in (*scheduler.waiting, *scheduler.running, *scheduler.swapped):
        record = state_pb2.AdmittedRequest(
            request_id=group.request_id, prompt_token_ids=group.seqs[0].prompt_token_ids,
            sampling=sampling_to_proto(group.sampling_params), arrival_time=group.arrival_time,
            seq_ids=[s.seq_id for s in group.seqs], worker_id=W,
        )
        pipe.hset(keys.request(group.request_id), "request", record.SerializeToString())
        pipe.sadd(keys.live(W), group.request_id)
        for seq in group.seqs:
            pipe.delete(keys.seq_tokens(seq.seq_id))
            if seq.output_token_ids:
                pipe.rpush(keys.seq_tokens(seq.seq_id), *seq.output_token_ids)
    pipe.execute()


class StoreRoundTrip:
    """Adds the `commit_and_rebuild` rule to a scheduler state machine."""

    def __init__(self) -> None:
        super().__init__()
        self.url = _SERVER["server"].url
        with redis.Redis.from_url(self.url) as client:
            client.flushall()
        self.journal = StateJournal()
        self.journal.restart(INSTANCE)
        self.step_id = 0

    @rule()
    def commit_and_rebuild(self) -> None:
        live: Scheduler = self.sched
        with redis.Redis.from_url(self.url) as client:
            _write_requests(client, live)
        record = None
        if self.pending is not None:
            self.step_id += 1
            out = self.pending
            plan = worker_pb2.StepPlan(epoch=1, step_id=self.step_id)
            for pairs, field in ((out.blocks_to_swap_in, plan.swap_in), (out.blocks_to_swap_out, plan.swap_out),
                                 (out.blocks_to_copy, plan.copy)):
                for src, dst in pairs:
                    field.add(src=src, dst=dst)
            record = step_record(plan, out)
        commit = StepCommit(W)
        self.journal.write(live, commit, record, (1, self.step_id))
        state = asyncio.run(self._commit_and_load(commit))
        assert state is not None and state.valid and state.instance_id == INSTANCE
        assert state.last_sent == (1, self.step_id)
        takeover = takeover_from_store(state)
        assert not takeover.recomputed
        rebuilt = restore_scheduler(live.scheduler_config, live.cache_config, takeover.snapshot)
        assert_same_scheduler(live, rebuilt)
        if record is not None:
            assert state.step == record
            out = restore_step(rebuilt, [(t.seq_id, t.num_new_tokens) for t in state.step.scheduled],
                               [(p.src, p.dst) for p in state.step.swap_in], [(p.src, p.dst) for p in state.step.swap_out],
                               [(p.src, p.dst) for p in state.step.copy])
            expected = [(s.seq.seq_id, s.num_new_tokens, s.num_computed_tokens, s.samples)
                        for s in self.pending.scheduled if not s.seq.is_finished]
            assert [(s.seq.seq_id, s.num_new_tokens, s.num_computed_tokens, s.samples) for s in out.scheduled] == expected
            self.pending = out
            event("rebuilt from Redis with a step in flight")
        else:
            assert state.step is None
        if commit.cached_blocks:
            event("cached blocks written")
        self.replace_scheduler(rebuilt)

    async def _commit_and_load(self, commit: StepCommit):
        store = RedisStore.from_url(self.url)
        try:
            await store.commit(commit)
            return await store.load_engine_state(W)
        finally:
            await store.close()


class StoredSchedulerMachine(StoreRoundTrip, SchedulerMachine):
    """Swaps, recompute preemption and parallel sampling, rebuilt from Redis at random points."""


class StoredPrefixCachingMachine(StoreRoundTrip, ChunkedPrefixCachingMachine):
    """Prefix caching (hits, evictable blocks, LRU order) with chunked prefill, rebuilt from Redis."""


TestStoredSchedulerMachine = StoredSchedulerMachine.TestCase
TestStoredPrefixCachingMachine = StoredPrefixCachingMachine.TestCase
TestStoredSchedulerMachine.settings = settings(max_examples=examples(40), stateful_step_count=30, deadline=None)
TestStoredPrefixCachingMachine.settings = settings(max_examples=examples(100), stateful_step_count=40, deadline=None)


def _round_trip(url: str, journal: StateJournal, live: Scheduler) -> Scheduler:
    with redis.Redis.from_url(url) as client:
        _write_requests(client, live)
    commit = StepCommit(W)
    journal.write(live, commit, None, (1, 0))

    async def main():
        store = RedisStore.from_url(url)
        try:
            await store.commit(commit)
            return await store.load_engine_state(W)
        finally:
            await store.close()

    state = asyncio.run(main())
    rebuilt = restore_scheduler(live.scheduler_config, live.cache_config, takeover_from_store(state).snapshot)
    assert_same_scheduler(live, rebuilt)
    return rebuilt


def test_cached_blocks_follow_the_cache_through_release_hit_and_eviction() -> None:
    """Registered, released to the evictor, revived by a hit, evicted: each commit carries the change."""
    url = _SERVER["server"].url
    with redis.Redis.from_url(url) as client:
        client.flushall()
    journal = StateJournal()
    journal.restart(INSTANCE)
    live = make_scheduler(num_gpu_blocks=6, block_size=4, max_num_batched_tokens=32, enable_prefix_caching=True,
                          watermark=0.0)
    prompt = list(range(1, 10))  # two full blocks and one token
    live.add_request(make_group_of("a", 0, prompt))
    step(live)
    live = _round_trip(url, journal, live)  # registered, held by a's table
    live.finish_sequence(live.running[0], live.running[0].seqs[0], SequenceStatus.FINISHED_STOPPED)
    live = _round_trip(url, journal, live)  # released: evictable, with their stamps
    cache = live.block_manager.block_pool
    assert len(cache.evictor) == 2
    live.add_request(make_group_of("b", 1, prompt + [50]))
    step(live)
    assert live.block_manager.prefix_cache_stats.hits == 2
    live = _round_trip(url, journal, live)  # revived by b's hit
    assert len(live.block_manager.block_pool.evictor) == 0
    live.finish_sequence(live.running[0], live.running[0].seqs[0], SequenceStatus.FINISHED_STOPPED)
    live.add_request(make_group_of("c", 2, list(range(60, 83))))  # 23 tokens: 6 blocks, evicts every cached one
    step(live)
    live = _round_trip(url, journal, live)
    cache = live.block_manager.block_pool
    # a's two blocks were evicted for c, whose five full blocks are now the cached ones.
    assert (cache.num_cached_blocks, len(cache.evictor)) == (5, 0)
