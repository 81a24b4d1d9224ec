"""Block allocator and block manager: exact block ids, ref counts, watermark, COW."""

from __future__ import annotations

import pytest

from scheduler_service.core.block_manager import AllocStatus
from scheduler_service.core.block_pool import BlockPool, NoFreeBlocksError
from scheduler_service.core.block_manager import BlockManager
from scheduler_service.core.config import CacheConfig
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus
from shared.sampling_params import SamplingParams


def make_group(request_id: str, seq_id: int, num_prompt: int, num_output: int = 0) -> SequenceGroup:
    seq = Sequence(seq_id, list(range(1, num_prompt + 1)), list(range(100, 100 + num_output)))
    return SequenceGroup(request_id, [seq], SamplingParams(), arrival_time=0.0)


def grow(seq: Sequence, n: int = 1) -> None:
    """Simulate n decode steps' worth of sampled tokens."""
    for _ in range(n):
        seq.append_token(7)


# -- CacheConfig ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 3, "num_gpu_blocks": 8}, "block_size must be a power of two in \\[1, 256\\], got 3"),
        ({"block_size": 512, "num_gpu_blocks": 8}, "block_size must be a power of two.*got 512"),
        ({"block_size": 0, "num_gpu_blocks": 8}, "block_size must be a positive integer, got 0"),
        ({"num_gpu_blocks": 0}, "num_gpu_blocks must be a positive integer, got 0"),
        ({"num_gpu_blocks": 8, "watermark": 1.0}, "watermark must be in \\[0, 1\\), got 1.0"),
        ({"num_gpu_blocks": 8, "watermark": -0.1}, "watermark must be in \\[0, 1\\), got -0.1"),
    ],
)
def test_cache_config_rejects_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CacheConfig(**kwargs)


def test_cache_config_defaults_and_watermark_blocks() -> None:
    config = CacheConfig(num_gpu_blocks=1000)
    assert (config.block_size, config.watermark) == (16, 0.01)
    assert config.watermark_blocks == 10
    assert CacheConfig(num_gpu_blocks=12, block_size=1, watermark=0.0).watermark_blocks == 0


# -- BlockPool ------------------------------------------------------------


def test_allocator_hands_out_lowest_free_id_first() -> None:
    alloc = BlockPool(4)
    assert [alloc.allocate() for _ in range(3)] == [0, 1, 2]
    alloc.free(1)
    alloc.free(0)
    # Lowest free id first, whatever order the frees came in.
    assert alloc.allocate() == 0
    assert alloc.allocate() == 1
    assert alloc.allocate() == 3
    assert alloc.num_free_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        alloc.allocate()


def test_allocator_ref_counts() -> None:
    alloc = BlockPool(2)
    block = alloc.allocate()
    alloc.incref(block)
    assert alloc.get_ref_count(block) == 2
    alloc.free(block)
    assert alloc.get_ref_count(block) == 1
    assert alloc.num_free_blocks == 1
    alloc.free(block)
    assert alloc.get_ref_count(block) == 0
    assert alloc.num_free_blocks == 2
    with pytest.raises(ValueError, match="cannot free block 0: it is not allocated"):
        alloc.free(block)
    with pytest.raises(ValueError, match="cannot incref block 0"):
        alloc.incref(block)
    with pytest.raises(ValueError, match="block_id must be in \\[0, 2\\), got 5"):
        alloc.free(5)


def test_allocator_free_block_ids() -> None:
    alloc = BlockPool(4)
    first, second = alloc.allocate(), alloc.allocate()
    assert alloc.free_block_ids() == [2, 3]
    alloc.free(second)
    alloc.free(first)
    assert alloc.free_block_ids() == [0, 1, 2, 3]


def test_allocator_rejects_bad_size() -> None:
    with pytest.raises(ValueError, match="num_blocks must be a positive integer, got 0"):
        BlockPool(0)


# -- BlockManager: admission ---------------------------------------------------


def test_can_allocate_ok_later_never_with_watermark() -> None:
    # 10 blocks, watermark 0.1 -> 1 block kept free for admissions.
    bm = BlockManager(block_size=4, num_gpu_blocks=10, watermark=0.1)
    assert bm.watermark_blocks == 1
    assert bm.can_allocate(make_group("a", 0, 36)) is AllocStatus.OK  # 9 blocks, 1 left
    assert bm.can_allocate(make_group("b", 1, 37)) is AllocStatus.NEVER  # 10 blocks > 10 - 1
    bm.allocate(make_group("c", 2, 20))  # 5 blocks
    assert bm.can_allocate(make_group("d", 3, 16)) is AllocStatus.OK  # 4 blocks, 1 left
    assert bm.can_allocate(make_group("e", 4, 17)) is AllocStatus.LATER  # 5 blocks, 0 left


def test_can_allocate_counts_output_tokens_for_recompute() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=2, watermark=0.0)
    assert bm.can_allocate(make_group("a", 0, 8)) is AllocStatus.OK
    assert bm.can_allocate(make_group("b", 1, 6, num_output=3)) is AllocStatus.NEVER


def test_allocate_exact_block_ids_and_free() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    a, b = make_group("a", 0, 5), make_group("b", 1, 4)
    bm.allocate(a)
    bm.allocate(b)
    assert bm.get_block_table(a.seqs[0]) == [0, 1]
    assert bm.get_block_table(b.seqs[0]) == [2]
    assert (bm.num_free_gpu_blocks, bm.get_num_used_blocks()) == (5, 3)
    bm.free(a.seqs[0])
    assert not bm.has_block_table(a.seqs[0])
    assert (bm.num_free_gpu_blocks, bm.get_num_used_blocks()) == (7, 1)
    c = make_group("c", 2, 12)
    bm.allocate(c)
    assert bm.get_block_table(c.seqs[0]) == [0, 1, 3]
    bm.free(a.seqs[0])  # freeing twice is a no-op
    assert bm.num_free_gpu_blocks == 4


def test_get_block_table_returns_a_copy() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=8)
    a = make_group("a", 0, 4)
    bm.allocate(a)
    bm.get_block_table(a.seqs[0]).append(99)
    assert bm.get_block_table(a.seqs[0]) == [0]


def test_allocate_errors() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=2, watermark=0.0)
    a = make_group("a", 0, 4)
    bm.allocate(a)
    with pytest.raises(ValueError, match="seq 0 already has a block table"):
        bm.allocate(a)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(make_group("b", 1, 8))
    assert bm.num_free_gpu_blocks == 1  # nothing half-allocated
    a.seqs[0].status = SequenceStatus.RUNNING
    with pytest.raises(ValueError, match="request 'a' has no WAITING sequence"):
        bm.can_allocate(a)
    with pytest.raises(ValueError, match="seq 5 has no block table"):
        bm.get_block_table(Sequence(5, [1]))


def test_allocate_gives_only_the_parent_of_a_forking_group_a_table() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    group = SequenceGroup("g", [Sequence(0, [1, 2, 3, 4, 5]), Sequence(1, [1, 2, 3, 4, 5])], SamplingParams(), 0.0)
    assert group.forks_on_admission()
    assert bm.can_allocate(group) is AllocStatus.OK
    bm.allocate(group)
    assert bm.get_block_table(group.seqs[0]) == [0, 1]
    assert not bm.has_block_table(group.seqs[1])  # pending fork: no blocks yet
    assert [bm.block_pool.get_ref_count(b) for b in (0, 1)] == [1, 1]
    assert bm.get_num_used_blocks() == 2
    bm.free(group.seqs[0])
    assert bm.get_num_used_blocks() == 0


def test_can_allocate_counts_one_copy_on_write_block_per_child() -> None:
    # 5 prompt tokens: 2 blocks for the parent, plus 1 per child for the fork's copy-on-write.
    def group_of(n: int) -> SequenceGroup:
        return SequenceGroup("g", [Sequence(i, [1, 2, 3, 4, 5]) for i in range(n)], SamplingParams(), 0.0)

    assert BlockManager(block_size=4, num_gpu_blocks=4, watermark=0.0).can_allocate(group_of(3)) is AllocStatus.OK
    assert BlockManager(block_size=4, num_gpu_blocks=3, watermark=0.0).can_allocate(group_of(3)) is AllocStatus.NEVER
    assert BlockManager(block_size=4, num_gpu_blocks=3, watermark=0.0).can_allocate(group_of(2)) is AllocStatus.OK
    bm = BlockManager(block_size=4, num_gpu_blocks=5, watermark=0.0)
    bm.allocate(make_group("other", 9, 4))  # 1 block: 4 left
    assert bm.can_allocate(group_of(3)) is AllocStatus.OK
    bm.allocate(make_group("more", 8, 1))  # 3 left < 2 + 2
    assert bm.can_allocate(group_of(3)) is AllocStatus.LATER
    # Finished sequences need nothing; one unfinished sequence does not fork.
    group = group_of(3)
    group.seqs[1].status = group.seqs[2].status = SequenceStatus.FINISHED_ABORTED
    assert not group.forks_on_admission()
    bm.allocate(make_group("last", 7, 1))  # 2 left
    assert bm.can_allocate(group) is AllocStatus.OK


def test_allocate_gives_diverged_seqs_their_own_tables() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    # As after a recompute preemption of a forked group: different outputs, nothing shared.
    group = SequenceGroup(
        "g",
        [Sequence(0, [1, 2, 3], [7, 8]), Sequence(1, [1, 2, 3], [9]), Sequence(2, [1, 2, 3], [6], status=SequenceStatus.FINISHED_STOPPED)],
        SamplingParams(),
        0.0,
    )
    assert not group.forks_on_admission()
    assert BlockManager(block_size=4, num_gpu_blocks=3, watermark=0.0).can_allocate(group) is AllocStatus.OK
    assert BlockManager(block_size=4, num_gpu_blocks=2, watermark=0.0).can_allocate(group) is AllocStatus.NEVER
    bm.allocate(group)
    assert bm.get_block_table(group.seqs[0]) == [0, 1]
    assert bm.get_block_table(group.seqs[1]) == [2]
    assert not bm.has_block_table(group.seqs[2])
    assert [bm.block_pool.get_ref_count(b) for b in (0, 1, 2)] == [1, 1, 1]
    # One sequence with output is enough to diverge: the one without prefills its prompt alone.
    mixed = SequenceGroup("m", [Sequence(3, [1, 2, 3]), Sequence(4, [1, 2, 3], [5])], SamplingParams(), 0.0)
    assert not mixed.forks_on_admission()
    bm.allocate(mixed)
    assert (bm.get_block_table(mixed.seqs[0]), bm.get_block_table(mixed.seqs[1])) == ([3], [4])


def test_allocate_diverged_failure_allocates_nothing() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=3, watermark=0.0)
    group = SequenceGroup("g", [Sequence(0, [1, 2, 3], [7, 8]), Sequence(1, [1, 2, 3], [9, 9])], SamplingParams(), 0.0)
    bm.allocate(make_group("a", 5, 1))
    with pytest.raises(NoFreeBlocksError, match="request 'g' needs 4 blocks, 2 free"):
        bm.allocate(group)
    assert bm.num_free_gpu_blocks == 2 and not bm.has_block_table(group.seqs[0])


def test_group_seqs_must_share_the_prompt() -> None:
    with pytest.raises(ValueError, match="seqs of request 'g' must share one prompt"):
        SequenceGroup("g", [Sequence(0, [1, 2]), Sequence(1, [1, 3])], SamplingParams(), 0.0)


# -- BlockManager: fork --------------------------------------------------------


def test_fork_shares_every_block_and_the_computed_tokens() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    group = SequenceGroup("g", [Sequence(0, list(range(1, 7))), Sequence(1, list(range(1, 7)))], SamplingParams(), 0.0)
    bm.allocate(group)
    parent, child = group.seqs
    parent.num_computed_tokens = 5
    bm.fork(parent, child)
    assert bm.get_block_table(child) == bm.get_block_table(parent) == [0, 1]
    assert [bm.block_pool.get_ref_count(b) for b in (0, 1)] == [2, 2]
    assert child.num_computed_tokens == 5
    assert bm.num_free_gpu_blocks == 6  # a fork takes no block
    with pytest.raises(ValueError, match="seq 1 already has a block table"):
        bm.fork(parent, child)
    with pytest.raises(ValueError, match="seq 7 has no block table"):
        bm.fork(Sequence(7, [1]), Sequence(8, [1]))
    stranger = Sequence(9, [1, 2, 3, 4, 0, 6])
    with pytest.raises(ValueError, match="seq 9 does not hold the 5 tokens computed for seq 0"):
        bm.fork(parent, stranger)
    assert not bm.has_block_table(stranger) and bm.block_pool.get_ref_count(0) == 2
    with pytest.raises(ValueError, match="seq 10 does not hold the 5 tokens"):
        bm.fork(parent, Sequence(10, [1, 2, 3]))
    bm.free(parent)
    assert [bm.block_pool.get_ref_count(b) for b in (0, 1)] == [1, 1]
    bm.free(child)
    assert bm.num_free_gpu_blocks == 8


# -- BlockManager: growth ------------------------------------------------------


def _running(group: SequenceGroup) -> SequenceGroup:
    for seq in group.seqs:
        seq.status = SequenceStatus.RUNNING
    return group


def test_append_slot_allocates_only_at_block_boundary() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=3, watermark=0.0)
    group = make_group("a", 0, 3)
    bm.allocate(group)
    _running(group)
    seq = group.seqs[0]
    grow(seq)  # 4 tokens: slot 3 is still in block 0
    assert bm.can_append_slot(group)
    assert bm.append_slot(seq) is None
    assert bm.get_block_table(seq) == [0]
    grow(seq)  # 5 tokens: slot 4 needs a second block
    assert bm.append_slot(seq) is None
    assert bm.get_block_table(seq) == [0, 1]
    assert bm.append_slot(seq) is None  # idempotent
    assert bm.get_block_table(seq) == [0, 1]
    other = make_group("b", 1, 4)
    bm.allocate(other)  # takes the last block, 2
    grow(seq, 4)  # 9 tokens: needs a third block, none free
    assert not bm.can_append_slot(group)
    with pytest.raises(NoFreeBlocksError):
        bm.append_slot(seq)
    bm.free(other.seqs[0])
    assert bm.can_append_slot(group)
    assert bm.append_slot(seq) is None
    assert bm.get_block_table(seq) == [0, 1, 2]


def test_append_slot_copy_on_write_of_shared_last_block() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=6, watermark=0.0)
    group = make_group("a", 0, 6)
    bm.allocate(group)  # blocks [0, 1], slot 5 used in block 1
    parent = group.seqs[0]
    child = Sequence(1, list(parent.prompt_token_ids), status=SequenceStatus.RUNNING)
    group.seqs.append(child)
    _running(group)
    bm.fork(parent, child)
    grow(parent)
    grow(child)  # both write slot 6, inside shared block 1
    assert bm.can_append_slot(group)
    assert bm.append_slot(parent) == (1, 2)
    assert bm.get_block_table(parent) == [0, 2]
    assert bm.block_pool.get_ref_count(1) == 1
    # The child is now the only owner of block 1: it writes in place.
    assert bm.append_slot(child) is None
    assert bm.get_block_table(child) == [0, 1]
    assert bm.block_pool.get_ref_count(0) == 2
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_gpu_blocks == 6


def test_can_append_slot_counts_copy_on_write_exactly() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=3, watermark=0.0)
    group = make_group("a", 0, 2)
    bm.allocate(group)
    parent = group.seqs[0]
    children = [Sequence(i, [1, 2], status=SequenceStatus.RUNNING) for i in (1, 2)]
    group.seqs.extend(children)
    _running(group)
    for child in children:
        bm.fork(parent, child)
    bm.allocate(make_group("b", 5, 4))  # 1 block left
    for seq in group.seqs:
        grow(seq)
    # 3 sequences write into block 0: 2 copies (the last one writes in place), 1 free block.
    assert not bm.can_append_slot(group)
    children[1].status = SequenceStatus.FINISHED_STOPPED
    bm.free(children[1])
    assert bm.can_append_slot(group)  # 2 writers, 1 copy
    # A table outside the group holding the block: nobody may write in place.
    outsider = Sequence(9, [1, 2])
    bm.fork(parent, outsider)
    assert not bm.can_append_slot(group)
    bm.free(outsider)
    assert bm.append_slot(children[0]) == (0, 2)
    assert bm.append_slot(parent) is None
    assert bm.num_free_gpu_blocks == 0


def test_append_slot_without_table_is_an_error() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=2)
    with pytest.raises(ValueError, match="seq 3 has no block table"):
        bm.append_slot(Sequence(3, [1]))


# -- sliding window: ring tables --------------------------------------------------------


def test_a_ring_table_stops_growing_and_reuses_its_blocks_cyclically() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0, ring_blocks=2)
    group = make_group("r", 1, 3)
    (seq,) = group.seqs
    bm.allocate(group)
    assert bm.get_block_table(seq) == [0]
    grow(seq, 2)  # 5 tokens: the second block
    assert bm.append_slot(seq) is None and bm.get_block_table(seq) == [0, 1]
    grow(seq, 4)  # 9 tokens: logical block 2 lives in ring slot 0
    assert bm.append_slot(seq) is None
    assert bm.get_block_table(seq) == [0, 1] and bm.get_num_used_blocks() == 2
    assert bm.logical_block_table(seq) == [0, 1, 0]
    grow(seq, 8)  # 17 tokens: logical blocks 0..4
    bm.append_slot(seq)
    assert bm.logical_block_table(seq) == [0, 1, 0, 1, 0]


def test_a_ring_slot_shared_by_a_fork_is_copied_on_write() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0, ring_blocks=2)
    group = make_group("r", 1, 9)
    (parent,) = group.seqs
    bm.allocate(group)
    assert bm.get_block_table(parent) == [0, 1]  # 9 tokens, already wrapped into slot 0
    parent.num_computed_tokens = 9
    child = Sequence(2, parent.prompt_token_ids)
    bm.fork(parent, child)
    grow(child)  # token 9 is in logical block 2 -> ring slot 0, shared
    assert bm.append_slot(child) == (0, 2)
    assert bm.get_block_table(child) == [2, 1] and bm.logical_block_table(child) == [2, 1, 2]


def test_ring_tables_admit_prompts_longer_than_the_cache() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=4, watermark=0.0, ring_blocks=3)
    assert bm.can_allocate(make_group("long", 1, 100)) is AllocStatus.OK
    assert BlockManager(block_size=4, num_gpu_blocks=4, watermark=0.0).can_allocate(
        make_group("long", 1, 100)) is AllocStatus.NEVER


@pytest.mark.parametrize("ring_blocks", [0, -1, True, 1.5])
def test_ring_blocks_must_be_a_positive_int(ring_blocks: object) -> None:
    with pytest.raises(ValueError, match="ring_blocks must be a positive int"):
        BlockManager(block_size=4, num_gpu_blocks=4, ring_blocks=ring_blocks)  # type: ignore[arg-type]


def test_ring_tables_exclude_prefix_caching() -> None:
    with pytest.raises(ValueError, match="cannot be combined with prefix caching"):
        BlockManager(block_size=4, num_gpu_blocks=4, enable_prefix_caching=True, ring_blocks=2)
