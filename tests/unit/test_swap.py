"""Swap preemption (vLLM v0): forked groups move their KV to CPU blocks and back."""

from __future__ import annotations

import pytest

from scheduler_service.core.block_manager import AllocStatus
from scheduler_service.core.block_pool import NoFreeBlocksError
from scheduler_service.core.block_manager import BlockManager
from scheduler_service.core.config import CacheConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus
from shared.sampling_params import SamplingParams
from tests.unit.test_scheduler import ids, make_scheduler, plan, sample_all

PROMPT_B = [5, 6, 7, 8, 9, 10]  # one full block + 2 tokens: the full block stays shared after the fork


def group(request_id: str, first_seq_id: int, prompt: list[int], n: int = 1) -> SequenceGroup:
    seqs = [Sequence(first_seq_id + i, prompt) for i in range(n)]
    return SequenceGroup(request_id, seqs, SamplingParams(), float(first_seq_id))


def detail(out) -> list[tuple[str, int, int, int]]:
    return [(s.group.request_id, s.seq.seq_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]


def run(sched: Scheduler):
    out = sched.schedule()
    sched.update_after_step(out, sample_all(out))
    return out


def swapped_scenario(num_cpu_blocks: int = 6, watermark: float = 0.0) -> tuple[Scheduler, SequenceGroup, SequenceGroup]:
    """a (1 seq, prompt 4) then b (n=2, prompt 6) on 7 device blocks, run to the step before pressure."""
    sched = make_scheduler(num_gpu_blocks=7, num_cpu_blocks=num_cpu_blocks, watermark=watermark)
    a, b = group("a", 0, [1, 2, 3, 4]), group("b", 1, PROMPT_B, n=2)
    sched.add_request(a)
    sched.add_request(b)
    assert plan(run(sched)) == [("a", 4), ("b", 5)]
    out = run(sched)  # fork: seq 2 copies the shared last block
    assert detail(out) == [("a", 0, 4, 1), ("b", 1, 5, 1), ("b", 2, 5, 1)] and out.blocks_to_copy == [(2, 4)]
    for _ in range(3):
        run(sched)
    bm = sched.block_manager
    assert bm.block_tables == {0: [0, 3], 1: [1, 2, 6], 2: [1, 4, 5]}
    assert bm.num_free_gpu_blocks == 0
    return sched, a, b


def test_cache_config_num_cpu_blocks_validation() -> None:
    assert CacheConfig(num_gpu_blocks=4).num_cpu_blocks == 0
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="num_cpu_blocks"):
            CacheConfig(num_gpu_blocks=4, num_cpu_blocks=bad)


def test_forked_group_is_swapped_out_then_back_in() -> None:
    sched, a, b = swapped_scenario()
    bm = sched.block_manager
    # a needs a block for its 9th token: b, the latest and forked, is swapped out.
    out = sched.schedule()
    assert ids(out.preempted) == ["b"] and out.swap_failed == [] and out.blocks_to_swap_in == []
    # Distinct device blocks once each, in table order; block 1 (shared) moved once.
    assert out.blocks_to_swap_out == [(1, 0), (2, 1), (6, 2), (4, 3), (5, 4)]
    assert out.released_seq_ids == [1, 2]  # the worker forgets them: they come back sent in full
    assert bm.swapper.cpu_tables == {1: [0, 1, 2], 2: [0, 3, 4]}
    assert [bm.swapper.cpu_pool.get_ref_count(c) for c in range(6)] == [2, 1, 1, 1, 1, 0]
    assert all(s.status is SequenceStatus.SWAPPED and not s.is_finished for s in b.seqs)
    assert list(sched.swapped) == [b] and sched.running == [a] and not sched.waiting
    # Device blocks freed (a took block 1 for its slot: the worker swaps out first).
    assert detail(out) == [("a", 0, 8, 1)]
    assert bm.block_tables == {0: [0, 3, 1]}
    assert bm.num_free_gpu_blocks == 4 and bm.get_num_used_blocks() == 3
    assert bm.num_free_cpu_blocks == 1 and (bm.num_cpu_blocks - bm.num_free_cpu_blocks) == 5
    assert sched.has_unfinished_requests() and sched.get_num_unfinished_requests() == 2
    sched.update_after_step(out, sample_all(out))
    assert [s.num_computed_tokens for s in b.seqs] == [9, 9]

    # 5 CPU blocks + 2 slots = 7 > 4 free: LATER, nothing is swapped in.
    assert bm.can_swap_in(b) is AllocStatus.LATER
    out = run(sched)
    assert detail(out) == [("a", 0, 9, 1)] and out.blocks_to_swap_in == [] and list(sched.swapped) == [b]

    sched.finish_sequence(a, a.seqs[0], SequenceStatus.FINISHED_STOPPED)
    assert bm.can_swap_in(b) is AllocStatus.OK
    out = sched.schedule()
    assert out.blocks_to_swap_in == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)] and out.blocks_to_swap_out == []
    assert out.preempted == [] and out.blocks_to_copy == []
    # Resumed in the same step as 1-token decodes, num_computed_tokens kept.
    assert detail(out) == [("b", 1, 9, 1), ("b", 2, 9, 1)]
    assert all(s.samples and not s.is_prefill for s in out.scheduled)
    assert bm.block_tables == {1: [0, 1, 2], 2: [0, 3, 4]} and bm.block_pool.get_ref_count(0) == 2
    assert bm.swapper.cpu_tables == {} and bm.num_free_cpu_blocks == 6
    assert sched.running == [b] and not sched.swapped
    assert all(s.status is SequenceStatus.RUNNING for s in b.seqs)
    sched.update_after_step(out, sample_all(out))
    assert [s.num_computed_tokens for s in b.seqs] == [10, 10]


def test_single_sequence_group_is_preempted_by_recompute() -> None:
    sched = make_scheduler(num_gpu_blocks=7, num_cpu_blocks=6)
    b, a = group("b", 0, PROMPT_B, n=2), group("a", 2, [1, 2, 3, 4])
    sched.add_request(b)
    sched.add_request(a)
    for _ in range(5):
        run(sched)
    out = sched.schedule()
    assert ids(out.preempted) == ["a"] and out.blocks_to_swap_out == [] and out.swap_failed == []
    assert detail(out) == [("b", 0, 9, 1), ("b", 1, 9, 1)]
    assert list(sched.waiting) == [a] and not sched.swapped
    assert a.seqs[0].status is SequenceStatus.WAITING and a.seqs[0].num_computed_tokens == 0
    assert sched.block_manager.num_free_cpu_blocks == 6


def test_swap_out_without_cpu_room_fails_the_group() -> None:
    sched, a, b = swapped_scenario(num_cpu_blocks=4)  # b holds 5 distinct blocks
    bm = sched.block_manager
    assert not bm.can_swap_out(b)
    out = sched.schedule()
    assert ids(out.swap_failed) == ["b"] and out.preempted == [] and out.blocks_to_swap_out == []
    assert all(s.status is SequenceStatus.FINISHED_IGNORED for s in b.seqs)
    assert detail(out) == [("a", 0, 8, 1)]
    assert bm.block_tables == {0: [0, 3, 1]} and bm.swapper.cpu_tables == {}
    assert bm.num_free_gpu_blocks == 4 and bm.num_free_cpu_blocks == 4
    assert sched.running == [a] and not sched.swapped and sched.get_num_unfinished_requests() == 1
    assert sched.abort_request("b") is None


def test_abort_of_swapped_group_frees_cpu_blocks() -> None:
    sched, a, b = swapped_scenario()
    out = sched.schedule()
    assert ids(out.preempted) == ["b"]
    assert sched.abort_request("b") is b
    assert all(s.status is SequenceStatus.FINISHED_ABORTED for s in b.seqs)
    bm = sched.block_manager
    assert bm.swapper.cpu_tables == {} and bm.num_free_cpu_blocks == 6 and not sched.swapped
    sched.update_after_step(out, sample_all(out))
    # Nothing swapped any more: admission is open again.
    sched.add_request(group("c", 3, [1]))
    assert plan(run(sched)) == [("a", 1), ("c", 1)]


def test_no_admission_while_a_group_is_swapped() -> None:
    sched, a, b = swapped_scenario()
    run(sched)  # swaps b out
    sched.add_request(group("c", 3, [1]))
    out = run(sched)
    assert plan(out) == [("a", 1)] and list(sched.waiting)[0].request_id == "c"


# -- block manager -------------------------------------------------------------------


def forked_bm(watermark: float = 0.0) -> tuple[BlockManager, SequenceGroup]:
    bm = BlockManager(block_size=4, num_gpu_blocks=10, watermark=watermark, num_cpu_blocks=4)
    g = group("g", 0, [1, 2, 3, 4], n=2)
    bm.allocate(g)
    bm.fork(g.seqs[0], g.seqs[1])
    for s in g.seqs:
        s.status = SequenceStatus.RUNNING
    return bm, g


def test_swap_keeps_blocks_other_groups_hold() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=6, watermark=0.0, num_cpu_blocks=4)
    x = group("x", 0, list(range(1, 9)))
    bm.allocate(x)
    x.seqs[0].status = SequenceStatus.RUNNING
    y = group("y", 1, list(range(1, 9)), n=2)
    for s in y.seqs:
        bm.fork(x.seqs[0], s)  # as prefix-cache sharing would: y's tables hold x's blocks
        s.status = SequenceStatus.RUNNING
    assert bm.block_pool.get_ref_count(0) == 3
    assert bm.swap_out(y) == [(0, 0), (1, 1)]
    # Copied for y only: x keeps its blocks, y's two references are dropped.
    assert bm.block_tables == {0: [0, 1]} and [bm.block_pool.get_ref_count(b) for b in (0, 1)] == [1, 1]
    assert [bm.swapper.cpu_pool.get_ref_count(c) for c in (0, 1)] == [2, 2]
    assert bm.num_free_gpu_blocks == 4 and bm.num_free_cpu_blocks == 2
    for s in y.seqs:
        s.status = SequenceStatus.SWAPPED
    assert bm.swap_in(y) == [(0, 2), (1, 3)]
    assert bm.block_tables == {0: [0, 1], 1: [2, 3], 2: [2, 3]} and bm.num_free_cpu_blocks == 4
    assert [bm.block_pool.get_ref_count(b) for b in range(4)] == [1, 1, 2, 2]


def test_swap_in_watermark_and_never() -> None:
    bm, g = forked_bm(watermark=0.1)  # 1 block kept free
    assert bm.can_swap_out(g) and bm.swap_out(g) == [(0, 0)]
    for s in g.seqs:
        s.status = SequenceStatus.SWAPPED
    assert bm.num_free_gpu_blocks == 10
    # 1 CPU block + 2 slots = 3.
    filler = group("f", 5, list(range(1, 25)))  # 6 blocks -> 4 free: 4 - 3 >= 1
    bm.allocate(filler)
    assert bm.can_swap_in(g) is AllocStatus.OK
    filler2 = group("h", 6, [1, 2, 3, 4])  # 3 free: 3 - 3 < 1
    bm.allocate(filler2)
    assert bm.can_swap_in(g) is AllocStatus.LATER
    bm.free(filler2.seqs[0])
    assert bm.can_swap_in(g) is AllocStatus.OK
    # free() of a swapped sequence frees its CPU blocks (ref counted).
    bm.free(g.seqs[0])
    assert bm.num_free_cpu_blocks == 3 and bm.swapper.cpu_pool.get_ref_count(0) == 1
    bm.free(g.seqs[1])
    assert bm.num_free_cpu_blocks == 4 and bm.swapper.cpu_tables == {}


def test_swap_in_never_when_the_group_cannot_fit() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=4, watermark=0.0, num_cpu_blocks=4)
    g = group("g", 0, list(range(1, 13)), n=2)  # 3 blocks + 2 slots = 5 > 4
    bm.allocate(g)
    bm.fork(g.seqs[0], g.seqs[1])
    for s in g.seqs:
        s.status = SequenceStatus.RUNNING
    bm.swap_out(g)
    for s in g.seqs:
        s.status = SequenceStatus.SWAPPED
    assert bm.can_swap_in(g) is AllocStatus.NEVER


def test_no_cpu_pool_means_no_swap() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=4, watermark=0.0)
    g = group("g", 0, [1, 2], n=2)
    bm.allocate(g)
    g.seqs[0].status = SequenceStatus.RUNNING
    assert bm.swapper.cpu_pool is None and bm.num_free_cpu_blocks == 0 and not bm.can_swap_out(g)
    with pytest.raises(NoFreeBlocksError):
        bm.swap_out(g)


def test_swapped_in_blocks_are_not_hashed_with_prefix_caching() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0, enable_prefix_caching=True, num_cpu_blocks=4)
    g = group("g", 0, list(range(1, 10)), n=2)
    bm.allocate(g)
    g.seqs[0].num_computed_tokens = 8
    bm.mark_computed(g.seqs[0])
    bm.fork(g.seqs[0], g.seqs[1])
    for s in g.seqs:
        s.status = SequenceStatus.RUNNING
    assert bm.swap_out(g) == [(0, 0), (1, 1), (2, 2)]
    for s in g.seqs:
        s.status = SequenceStatus.SWAPPED
    # The cached blocks 0 and 1 lost their last owner: evictable, still hashed.
    assert bm.num_free_gpu_blocks == 8
    # Plain free blocks first: the cached 0 and 1 stay in the evictor.
    assert bm.swap_in(g) == [(0, 2), (1, 3), (2, 4)]
    cache = bm.block_pool
    assert all(cache.get_block_hash(b) is None for b in (2, 3, 4))
    assert all(cache.get_block_hash(b) is not None for b in (0, 1))
    g.seqs[0].num_computed_tokens = 9
    bm.mark_computed(g.seqs[0])  # no-op: swapped-in blocks stay unhashed
    assert all(cache.get_block_hash(b) is None for b in (2, 3, 4))
