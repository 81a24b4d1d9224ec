"""Prefix caching: stable chained hashes, hits, registration timing, LRU evictor, stats."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from tests.hypothesis_profiles import examples

from scheduler_service.core.block_manager import AllocStatus
from scheduler_service.core.block_pool import NoFreeBlocksError
from scheduler_service.core.block_manager import BlockManager
from scheduler_service.core.config import CacheConfig
from scheduler_service.core.block_pool import LRUEvictor
from scheduler_service.core.block_manager import PrefixCacheStats
from scheduler_service.core.block_pool import BlockPool
from scheduler_service.core.prefix_hash import ROOT_BLOCK_HASH, hash_block_tokens, hash_full_blocks
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus
from shared.sampling_params import SamplingParams
from tests.unit.test_scheduler import (
    TOKEN,
    SchedulerMachine,
    ids,
    make_group,
    make_group_of,
    make_scheduler,
    plan,
    sample_all,
    step,
    table,
)


def caching_scheduler(num_gpu_blocks: int = 16, **kwargs: object) -> Scheduler:
    return make_scheduler(num_gpu_blocks=num_gpu_blocks, enable_prefix_caching=True, **kwargs)  # type: ignore[arg-type]


def caching_bm(num_gpu_blocks: int = 6) -> BlockManager:
    return BlockManager(block_size=4, num_gpu_blocks=num_gpu_blocks, watermark=0.0, enable_prefix_caching=True)


def cache_of(bm: BlockManager) -> BlockPool:
    assert bm.block_pool.enable_caching
    return bm.block_pool


def computed_group(bm: BlockManager, request_id: str, seq_id: int, prompt: list[int]) -> SequenceGroup:
    """Allocate a group and pretend a step computed its whole prompt."""
    group = make_group_of(request_id, seq_id, prompt)
    bm.allocate(group)
    seq = group.seqs[0]
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = seq.num_tokens
    bm.mark_computed(seq)
    return group


def refs(sched: Scheduler, block_ids: list[int]) -> list[int]:
    return [sched.block_manager.block_pool.get_ref_count(b) for b in block_ids]


# -- config --------------------------------------------------------------------


def test_cache_config_prefix_caching_flag() -> None:
    assert CacheConfig(num_gpu_blocks=8).enable_prefix_caching is False
    with pytest.raises(ValueError, match="enable_prefix_caching must be a bool, got 'yes'"):
        CacheConfig(num_gpu_blocks=8, enable_prefix_caching="yes")  # type: ignore[arg-type]
    bm = BlockManager.from_config(CacheConfig(num_gpu_blocks=8, block_size=4, enable_prefix_caching=True))
    assert bm.enable_prefix_caching and bm.block_pool.enable_caching


# -- hashes ----------------------------------------------------------------------


def test_block_hash_is_stable_across_processes() -> None:
    expected = hashlib.sha256(bytes(32) + struct.pack("<4Q", 1, 2, 3, 4)).digest()
    assert hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 4]) == expected
    # Computed once; Python's salted hash() would change from run to run.
    assert expected.hex() == "ffb37f396c221c1e32e2d90de01d531aa5e704f43017ac4142d39b24fe4d6c58"


def test_block_hashes_are_chained() -> None:
    first = hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 4])
    second = hash_block_tokens(first, [5, 6, 7, 8])
    assert hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, 2) == [first, second]
    # The same block tokens under another prefix are another block.
    assert hash_block_tokens(ROOT_BLOCK_HASH, [5, 6, 7, 8]) != second
    assert hash_block_tokens(hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 5]), [5, 6, 7, 8]) != second
    assert hash_block_tokens(ROOT_BLOCK_HASH, [4, 3, 2, 1]) != first
    with pytest.raises(ValueError, match="parent_hash must be 32 bytes, got 0"):
        hash_block_tokens(b"", [1])
    with pytest.raises(ValueError, match="3 blocks of 4 tokens do not fit in 9 tokens"):
        hash_full_blocks(list(range(9)), 4, 3)


# -- hits ------------------------------------------------------------------------


def test_second_request_with_same_prompt_hits_two_blocks() -> None:
    sched = caching_scheduler()
    a = make_group("a", 0, 9)
    sched.add_request(a)
    assert plan(step(sched)) == [("a", 9)]
    assert table(sched, a) == [0, 1, 2]
    b = make_group("b", 1, 9)
    sched.add_request(b)
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 1)]
    assert out.num_batched_tokens == 2  # cached tokens cost no budget
    assert table(sched, b) == [0, 1, 3]
    assert refs(sched, [0, 1, 2, 3]) == [2, 2, 1, 1]
    resumed = out.scheduled[1]
    assert (resumed.num_computed_tokens, resumed.num_new_tokens, resumed.samples) == (8, 1, True)
    assert resumed.token_ids == [9]
    assert not out.blocks_to_copy
    # 2 cacheable blocks queried per request, 2 hit by the second.
    assert sched.block_manager.prefix_cache_stats == PrefixCacheStats(queries=4, hits=2)
    assert sched.block_manager.prefix_cache_stats.hit_rate == 0.5
    sched.update_after_step(out, sample_all(out))
    assert b.seqs[0].num_computed_tokens == 9


def test_admission_hashes_each_prompt_block_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The verdict, the budget count and the allocation share one admission plan: one prefix match."""
    import scheduler_service.core.block_manager as tracker_module

    sched = caching_scheduler()
    a = make_group("a", 0, 9)
    sched.add_request(a)
    sched.update_after_step(out := sched.schedule(), sample_all(out))
    calls: list[int] = []
    real = tracker_module.hash_block_tokens

    def counting(parent: bytes, token_ids: list[int]) -> bytes:
        calls.append(len(token_ids))
        return real(parent, token_ids)

    monkeypatch.setattr(tracker_module, "hash_block_tokens", counting)
    sched.add_request(make_group("b", 1, 9))
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 1)]
    # b's two cacheable blocks, each hashed once (both hit: nothing new to register yet).
    assert calls == [4, 4]


def test_allocate_rejects_another_groups_plan() -> None:
    bm = caching_bm()
    a, b = make_group_of("a", 0, [1, 2, 3]), make_group_of("b", 1, [4, 5, 6])
    with pytest.raises(ValueError, match="plan is for request 'a', not 'b'"):
        bm.allocate(b, bm.plan_admission(a))
    assert not bm.block_tables


def test_prompt_of_exactly_two_blocks_hits_only_the_first() -> None:
    sched = caching_scheduler()
    sched.add_request(make_group("a", 0, 8))
    step(sched)
    b = make_group("b", 1, 8)
    sched.add_request(b)
    out = sched.schedule()
    # The block with the last token is never reused: its token must be computed for sampling.
    assert plan(out) == [("a", 1), ("b", 4)]
    assert table(sched, b) == [0, 3]  # a grew into block 2 this step
    assert b.seqs[0].num_computed_tokens == 4
    assert sched.block_manager.prefix_cache_stats == PrefixCacheStats(queries=2, hits=1)
    sched.update_after_step(out, sample_all(out))
    # b's own copy of block 1 stays unhashed: the hash already names block 1.
    assert cache_of(sched.block_manager).get_block_hash(3) is None
    assert cache_of(sched.block_manager).get_block_hash(1) is not None


def test_blocks_are_registered_only_once_computed() -> None:
    sched = caching_scheduler()
    a, b = make_group("a", 0, 9), make_group("b", 1, 9)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    # Same step: a's blocks hold no KV yet, so b must not hit them.
    assert plan(out) == [("a", 9), ("b", 9)]
    assert (table(sched, a), table(sched, b)) == ([0, 1, 2], [3, 4, 5])
    assert cache_of(sched.block_manager).num_cached_blocks == 0
    sched.update_after_step(out, sample_all(out))
    # a registered blocks 0 and 1; b's identical blocks stay unhashed.
    assert [cache_of(sched.block_manager).get_block_hash(b) is not None for b in range(6)] == [
        True, True, False, False, False, False,
    ]
    assert sched.block_manager.prefix_cache_stats == PrefixCacheStats(queries=4, hits=0)


def test_mark_computed_registers_only_full_computed_blocks() -> None:
    bm = caching_bm(num_gpu_blocks=8)
    group = make_group_of("a", 0, list(range(1, 11)))
    bm.allocate(group)
    seq = group.seqs[0]
    probe = Sequence(9, list(range(1, 11)))
    seq.num_computed_tokens = 7  # a chunk: block 1 is only partly written
    bm.mark_computed(seq)
    assert bm.get_num_cached_tokens(probe) == 4
    seq.num_computed_tokens = 10
    bm.mark_computed(seq)
    assert bm.get_num_cached_tokens(probe) == 8
    # Decode-filled blocks are registered too once computed.
    seq.append_token(11)
    seq.append_token(12)
    bm.append_slot(seq)
    seq.num_computed_tokens = 12
    bm.mark_computed(seq)
    assert bm.get_num_cached_tokens(Sequence(10, list(range(1, 14)))) == 12
    # Without prefix caching mark_computed is a no-op and nothing is ever cached.
    plain = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    other = make_group_of("b", 1, list(range(1, 11)))
    plain.allocate(other)
    other.seqs[0].num_computed_tokens = 10
    plain.mark_computed(other.seqs[0])
    assert plain.get_num_cached_tokens(probe) == 0
    assert plain.prefix_cache_stats == PrefixCacheStats()


def test_decode_filled_blocks_are_hit_by_a_longer_prompt() -> None:
    sched = caching_scheduler()
    a = make_group("a", 0, 9)
    sched.add_request(a)
    for _ in range(4):
        out = step(sched)
        assert not out.blocks_to_copy
    # 9 prompt + 4 sampled tokens, 12 computed: block 2 is full of decoded KV.
    assert a.seqs[0].num_tokens == 13 and a.seqs[0].num_computed_tokens == 12
    c = make_group_of("c", 1, a.seqs[0].all_token_ids)
    sched.add_request(c)
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("c", 1)]
    assert table(sched, c)[:3] == table(sched, a)[:3]


# -- freeing and the evictor ----------------------------------------------------------


def test_freed_hashed_blocks_are_evictable_free_and_revived() -> None:
    sched = caching_scheduler()
    a = make_group("a", 0, 9)
    sched.add_request(a)
    step(sched)
    sched.finish_sequence(a, a.seqs[0], SequenceStatus.FINISHED_STOPPED)
    cache = cache_of(sched.block_manager)
    assert cache.evictor.block_ids() == [0, 1]  # block 2 was not full: plain free block
    assert refs(sched, [0, 1, 2]) == [0, 0, 0]
    assert sched.block_manager.num_free_gpu_blocks == 16
    assert sched.block_manager.get_num_used_blocks() == 0
    b = make_group("b", 1, 9)
    sched.add_request(b)
    assert sched.block_manager.can_allocate(b) is AllocStatus.OK
    out = sched.schedule()
    assert plan(out) == [("b", 1)]
    assert table(sched, b) == [0, 1, 2]  # the same ids, revived with ref count 1
    assert refs(sched, [0, 1, 2]) == [1, 1, 1]
    assert len(cache.evictor) == 0
    assert sched.block_manager.num_free_gpu_blocks == 13


def test_lru_evictor_order_and_tie_rule() -> None:
    evictor = LRUEvictor()
    evictor.add(5, last_accessed=2, num_hashed_tokens=4)
    evictor.add(3, last_accessed=1, num_hashed_tokens=4)
    evictor.add(7, last_accessed=1, num_hashed_tokens=12)  # same time, deeper: evicted first
    evictor.add(1, last_accessed=1, num_hashed_tokens=8)
    evictor.add(9, last_accessed=3, num_hashed_tokens=4)
    assert len(evictor) == 5 and 7 in evictor and 2 not in evictor
    evictor.remove(1)
    assert evictor.evict() == 7
    assert evictor.evict() == 3
    evictor.add(1, last_accessed=4, num_hashed_tokens=8)  # re-added later: now the most recent
    assert [evictor.evict() for _ in range(3)] == [5, 9, 1]
    with pytest.raises(ValueError, match="the evictor is empty"):
        evictor.evict()
    with pytest.raises(ValueError, match="block 4 is not in the evictor"):
        evictor.remove(4)
    evictor.add(4, 0, 4)
    with pytest.raises(ValueError, match="block 4 is already in the evictor"):
        evictor.add(4, 1, 4)
    # Many revive/release cycles keep working (stale heap entries are dropped).
    for t in range(500):
        evictor.remove(4)
        evictor.add(4, t, 4)
    evictor.add(2, 1000, 4)
    assert [evictor.evict(), evictor.evict()] == [4, 2]
    evictor.add(8, 0, 4)
    assert evictor.clear() == [8] and len(evictor) == 0


def test_allocation_evicts_lru_deepest_first_only_when_free_list_is_empty() -> None:
    bm = caching_bm(num_gpu_blocks=6)
    a = computed_group(bm, "a", 0, [1, 2, 3, 4, 5, 6, 7, 8])  # blocks 0, 1
    b = computed_group(bm, "b", 1, [11, 12, 13, 14, 15, 16, 17, 18])  # blocks 2, 3
    bm.free(a.seqs[0])  # released first: least recently used
    bm.free(b.seqs[0])
    cache = cache_of(bm)
    assert cache.evictor.block_ids() == [0, 1, 2, 3]
    assert cache.free_block_ids() == [0, 1, 2, 3, 4, 5]
    assert bm.num_free_gpu_blocks == 6
    c = make_group_of("c", 2, list(range(100, 116)))  # 4 blocks, no hit
    bm.allocate(c)
    # Free list first (4, 5), then a's blocks, deepest (1) before its parent (0).
    assert bm.get_block_table(c.seqs[0]) == [4, 5, 1, 0]
    assert bm.get_num_cached_tokens(Sequence(8, [1, 2, 3, 4, 5, 6, 7, 8, 9])) == 0  # a's hashes forgotten
    assert cache.get_block_hash(0) is None and cache.get_block_hash(1) is None
    assert bm.get_num_cached_tokens(Sequence(9, [11, 12, 13, 14, 15, 16, 17, 18, 19])) == 8
    d = make_group_of("d", 3, [50])
    bm.allocate(d)
    assert bm.get_block_table(d.seqs[0]) == [3]
    assert cache.evictor.block_ids() == [2]
    assert bm.get_num_cached_tokens(Sequence(10, [11, 12, 13, 14, 15, 16, 17, 18, 19])) == 4
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(make_group_of("e", 4, list(range(200, 209))))
    assert bm.num_free_gpu_blocks == 1  # nothing half-allocated


def test_can_allocate_counts_hits_on_blocks_in_use_as_free() -> None:
    bm = caching_bm(num_gpu_blocks=4)
    computed_group(bm, "a", 0, list(range(1, 10)))  # 3 blocks in use, 0 and 1 hashed
    same = make_group_of("b", 1, list(range(1, 10)))
    other = make_group_of("c", 2, list(range(50, 59)))
    assert bm.can_allocate(other) is AllocStatus.LATER  # 3 blocks, 1 free
    assert bm.can_allocate(same) is AllocStatus.OK  # 2 shared blocks cost nothing
    bm.allocate(same)
    assert bm.get_block_table(same.seqs[0]) == [0, 1, 3]
    assert same.seqs[0].num_computed_tokens == 8
    assert bm.num_free_gpu_blocks == 0


def test_forking_group_hits_once_and_children_inherit_the_hits() -> None:
    bm = caching_bm(num_gpu_blocks=8)
    computed_group(bm, "a", 0, list(range(1, 10)))
    group = SequenceGroup("g", [Sequence(1, list(range(1, 10))), Sequence(2, list(range(1, 10)))], SamplingParams(), 0)
    bm.allocate(group)
    parent, child = group.seqs
    assert bm.get_block_table(parent) == [0, 1, 3]
    assert not bm.has_block_table(child)
    assert [bm.block_pool.get_ref_count(b) for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert [s.num_computed_tokens for s in group.seqs] == [8, 0]
    assert bm.prefix_cache_stats == PrefixCacheStats(queries=4, hits=2)  # a: 2 queried; g: the parent only
    bm.fork(parent, child)
    assert bm.get_block_table(child) == [0, 1, 3]
    assert [bm.block_pool.get_ref_count(b) for b in (0, 1, 2, 3)] == [3, 3, 1, 2]
    assert child.num_computed_tokens == 8


def test_diverged_group_tables_hit_and_revive_shared_blocks_once() -> None:
    bm = caching_bm(num_gpu_blocks=6)
    a = computed_group(bm, "a", 0, list(range(1, 10)))  # blocks 0, 1 hashed, 2 not
    bm.free(a.seqs[0])  # 0 and 1 evictable
    prompt = list(range(1, 9))
    group = SequenceGroup("g", [Sequence(1, prompt, [9, 5]), Sequence(2, prompt, [7])], SamplingParams(), 0)
    # 3 + 3 blocks, 2 hits each on the same 2 evictable blocks: 2 fresh + 2 revived.
    assert bm.can_allocate(group) is AllocStatus.OK
    bm.allocate(group)
    assert bm.get_block_table(group.seqs[0]) == [0, 1, 2]
    assert bm.get_block_table(group.seqs[1]) == [0, 1, 3]
    assert [bm.block_pool.get_ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    assert [s.num_computed_tokens for s in group.seqs] == [8, 8]
    assert bm.num_free_gpu_blocks == 2


def test_recompute_preemption_hits_its_own_old_blocks() -> None:
    sched = caching_scheduler(num_gpu_blocks=8)
    a = make_group_of("a", 0, list(range(100, 108)))  # 2 blocks
    b = make_group("b", 1, 24)  # 6 blocks: the cache is full
    sched.add_request(a)
    sched.add_request(b)
    assert plan(step(sched)) == [("a", 8), ("b", 24)]
    out = step(sched)  # a needs a 3rd block: preempt b, its hashed blocks go to the evictor
    assert ids(out.preempted) == ["b"] and plan(out) == [("a", 1)]
    # The free list is empty: a's new block is b's deepest cached block.
    assert table(sched, a) == [0, 1, 7]
    assert cache_of(sched.block_manager).evictor.block_ids() == [2, 3, 4, 5, 6]
    assert plan(step(sched)) == [("a", 1)]  # b (7 blocks, 5 evictable) is LATER
    sched.abort_request("a")
    out = sched.schedule()
    # b hits the 5 blocks it still has cached and recomputes the rest.
    assert plan(out) == [("b", 5)]
    (resumed,) = out.scheduled
    assert resumed.num_computed_tokens == 20
    assert resumed.token_ids == [21, 22, 23, 24, TOKEN]
    assert table(sched, b) == [2, 3, 4, 5, 6, 7, 1]  # free block 7, then a's deepest cached block
    sched.update_after_step(out, sample_all(out))
    assert b.seqs[0].num_computed_tokens == 25


def test_reset_prefix_cache_forgets_everything() -> None:
    sched = caching_scheduler()
    a, b = make_group("a", 0, 9), make_group_of("b", 1, list(range(50, 59)))
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    sched.finish_sequence(b, b.seqs[0], SequenceStatus.FINISHED_STOPPED)
    cache = cache_of(sched.block_manager)
    assert cache.evictor.block_ids() == [3, 4]
    sched.reset_prefix_cache()
    assert len(cache.evictor) == 0 and cache.num_cached_blocks == 0
    assert sched.block_manager.num_free_gpu_blocks == 13
    # a keeps running but is never registered again (its KV is not trusted).
    for _ in range(3):
        step(sched)
    assert a.seqs[0].num_computed_tokens == 12
    assert cache.num_cached_blocks == 0
    c = make_group("c", 2, 9)
    sched.add_request(c)
    assert plan(sched.schedule()) == [("a", 1), ("c", 9)]
    # Without prefix caching it is a no-op.
    make_scheduler().reset_prefix_cache()


# -- property test -----------------------------------------------------------------

# A few shared prefixes so that prompts hit each other's blocks; the last one
# repeats a single token, so only the chaining tells its blocks apart.
PREFIXES = [list(range(1, 17)), list(range(40, 56)), [7] * 16]


class PrefixCachingMachine(SchedulerMachine):
    """The scheduler state machine with prefix caching on and prompts sharing prefixes."""

    prefix_caching = True

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        prefix_len=st.integers(0, 16),
        suffix=st.lists(st.integers(0, 2), max_size=5),
        max_tokens=st.integers(1, 24),
        n=st.integers(1, 3),
    )
    def add_shared(self, prefix: int, prefix_len: int, suffix: list[int], max_tokens: int, n: int) -> None:
        self.add_prompt(PREFIXES[prefix][:prefix_len] + suffix or [1], max_tokens, n)

    @rule(data=st.data(), extra=st.integers(0, 2))
    def add_copy_of_running(self, data: st.DataObject, extra: int) -> None:
        # A prompt that repeats a running sequence's prompt and outputs: it can
        # hit blocks filled by decodes, including ones just completed.
        running = [s for g in self.sched.running for s in g.get_seqs(SequenceStatus.RUNNING)]
        if running:
            seq = data.draw(st.sampled_from(running))
            self.add_prompt(seq.all_token_ids + [TOKEN] * extra, data.draw(st.integers(1, 8)), data.draw(st.integers(1, 2)))

    @invariant()
    def prefix_cache_is_consistent(self) -> None:
        bm = self.sched.block_manager
        cache = cache_of(bm)
        evictable = set(cache.evictor.block_ids())
        for block_id in range(bm.num_gpu_blocks):
            block_hash = cache.get_block_hash(block_id)
            if block_id in evictable:
                assert cache.get_ref_count(block_id) == 0 and block_hash is not None
            elif cache.get_ref_count(block_id) == 0:
                assert block_hash is None  # plain free block
            if block_hash is not None:
                assert cache.lookup(block_hash) == block_id
        assert cache.num_cached_blocks == sum(cache.get_block_hash(b) is not None for b in range(bm.num_gpu_blocks))
        stats = bm.prefix_cache_stats
        assert 0 <= stats.hits <= stats.queries


TestPrefixCachingMachine = PrefixCachingMachine.TestCase
TestPrefixCachingMachine.settings = settings(max_examples=examples(100), stateful_step_count=40, deadline=None)


def test_allocate_refuses_a_plan_whose_hit_was_evicted() -> None:
    bm = caching_bm(num_gpu_blocks=3)
    a = computed_group(bm, "a", 0, [1, 2, 3, 4, 5, 6, 7, 8, 9])  # blocks 0 and 1 cached, 2 holds token 9
    for seq in a.seqs:
        bm.free(seq)  # all three evictable
    b = make_group_of("b", 1, [1, 2, 3, 4, 5])
    plan = bm.plan_admission(b)
    assert plan.tables[0].hits == [0]
    # Another sequence takes every block: the evictor reuses block 0 for other tokens.
    computed_group(bm, "c", 2, list(range(100, 112)))
    with pytest.raises(ValueError, match="stale"):
        bm.allocate(b, plan)
    assert 1 not in bm.block_tables
