"""Maps sequences to physical KV blocks: admission, prefix caching and swapping over the block tables.

The pieces, one file each: BlockAllocator / PrefixCachingBlockAllocator (block
ids, ref counts, the cache of computed blocks), BlockTableLayout (table sizes,
the sliding-window ring), DeviceBlockTables (the tables: fork, growth with
copy-on-write, release), PrefixCacheTracker (per-sequence hash chains),
block_admission (admission plans and verdicts) and BlockSwapper (the CPU pool).
"""

from __future__ import annotations

from scheduler_service.core.block_admission import (
    AdmissionPlan,
    AllocStatus,
    admission_cost,
    alloc_status,
    plan_tables,
)
from scheduler_service.core.block_allocator import BlockAllocator, NoFreeBlocksError
from scheduler_service.core.block_swapper import BlockSwapper
from scheduler_service.core.block_table_layout import BlockTableLayout
from scheduler_service.core.config import CacheConfig
from scheduler_service.core.device_block_tables import DeviceBlockTables
from scheduler_service.core.prefix_cache_tracker import PrefixCacheTracker
from scheduler_service.core.prefix_caching_allocator import PrefixCacheStats, PrefixCachingBlockAllocator
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus

# AllocStatus, BlockAllocator, NoFreeBlocksError and PrefixCacheStats live in
# their own modules; re-exported so existing imports from here keep working.
__all__ = ["AllocStatus", "BlockAllocator", "BlockManager", "NoFreeBlocksError", "PrefixCacheStats"]


class BlockManager(DeviceBlockTables):
    """Owns the block tables of all sequences that hold KV cache.

    The tables themselves, fork(), can_append_slot()/append_slot() (with
    copy-on-write) and the queries come from DeviceBlockTables; this class
    adds how tables are created (can_allocate/allocate), the prefix cache and
    swapping.

    With prefix caching, allocate() reuses the cached blocks of the longest
    matching prefix and mark_computed() registers blocks once their KV is
    written; unreferenced cached blocks count as free (they are evicted on
    demand).

    Sliding window (ring_blocks set): a table holds at most ring_blocks
    blocks, reused as a ring (see BlockTableLayout); logical_block_table()
    gives the worker the logical view.

    Swap preemption (num_cpu_blocks > 0): see BlockSwapper.
    """

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        watermark: float = 0.01,
        enable_prefix_caching: bool = False,
        num_cpu_blocks: int = 0,
        ring_blocks: int | None = None,
    ) -> None:
        # Validates ring_blocks first (block_size is CacheConfig's to validate, below).
        layout = BlockTableLayout(block_size, ring_blocks)
        if ring_blocks is not None and enable_prefix_caching:
            # A reused block would no longer hold what its hash says.
            raise ValueError("ring_blocks (sliding-window reuse) cannot be combined with prefix caching.")
        # CacheConfig carries the validation rules; reuse them.
        config = CacheConfig(
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            watermark=watermark,
            enable_prefix_caching=enable_prefix_caching,
            num_cpu_blocks=num_cpu_blocks,
        )
        self.enable_prefix_caching = config.enable_prefix_caching
        self.prefix_cache_stats = PrefixCacheStats()
        # The tracker's allocator is the same object as gpu_allocator when
        # caching is on; without caching there is no hash bookkeeping at all.
        prefix: PrefixCacheTracker | None = None
        if config.enable_prefix_caching:
            cache = PrefixCachingBlockAllocator(config.num_gpu_blocks)
            prefix = PrefixCacheTracker(cache, config.block_size, self.prefix_cache_stats)
            gpu_allocator: BlockAllocator = cache
        else:
            gpu_allocator = BlockAllocator(config.num_gpu_blocks)
        super().__init__(layout, gpu_allocator, prefix, config.watermark_blocks)
        self._swapper = BlockSwapper(config.num_cpu_blocks, self)
        # The swapper's own objects, exposed under their long-standing names.
        self.cpu_allocator = self._swapper.cpu_allocator
        self.cpu_block_tables = self._swapper.cpu_block_tables

    @classmethod
    def from_config(cls, config: CacheConfig, ring_blocks: int | None = None) -> BlockManager:
        """Build from a validated CacheConfig."""
        return cls(
            config.block_size,
            config.num_gpu_blocks,
            config.watermark,
            config.enable_prefix_caching,
            config.num_cpu_blocks,
            ring_blocks,
        )

    # -- admission ---------------------------------------------------------

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        """Whether the group's WAITING sequences fit in the cache.

        Counted, for a group that forks on admission (several sequences, no
        output yet; see SequenceGroup.forks_on_admission): the parent's table
        (blocks for the prompt) plus one block per other sequence, the block
        each will need when, after the fork, its first decode copies the
        shared last block on write (the parent, appending last, writes in
        place). Counting them now keeps admission from promising the cache
        to others that the fork step needs; they are allocated at that step.
        Counted for any other group: one table per WAITING sequence, sized
        for all its tokens (outputs included: a recomputed sequence
        re-prefills prompt + outputs), nothing shared.

        The watermark keeps a few blocks free so running sequences can still
        decode after the admission. Prefix-cache hits on blocks another table
        already uses cost nothing; hits revived from the evictor cost a free
        block each, once however many tables take them (evictable blocks are
        counted as free). NEVER ignores hits: they may be evicted later.
        """
        return self.plan_admission(group).status

    def plan_admission(self, group: SequenceGroup) -> AdmissionPlan:
        """The tables allocate() would create for the group now, and can_allocate's verdict on them."""
        plans, num_cow_blocks = plan_tables(group, self._layout, self._prefix)
        needed = sum(plan.num_blocks for plan in plans) + num_cow_blocks
        cost = admission_cost(plans, self.gpu_allocator) + num_cow_blocks
        status = alloc_status(
            needed, cost, self.num_gpu_blocks, self.gpu_allocator.num_free_blocks, self.watermark_blocks
        )
        return AdmissionPlan(group, plans, num_cow_blocks, status)

    def allocate(self, group: SequenceGroup, plan: AdmissionPlan | None = None) -> None:
        """Allocate block tables for the group's WAITING sequences.

        plan: the group's plan_admission() result, when the caller made one
        since the last change to the block manager (it is not recomputed).

        A group that forks on admission gets a table for its parent (the
        first WAITING sequence) only; the others stay without one until
        fork(). Any other group gets a table for each WAITING sequence, none
        shared (except blocks hit in the prefix cache).

        With prefix caching each table starts with the cached blocks of the
        longest matching prefix (never the block holding the last token, so
        every sequence computes at least one token into a block of its own)
        and the sequence's num_computed_tokens is set to the tokens they hold.
        """
        if plan is None:
            plan = self.plan_admission(group)
        elif plan.group is not group:
            raise ValueError(f"the admission plan is for request {plan.group.request_id!r}, not {group.request_id!r}.")
        elif self._prefix is not None and not all(self._prefix.still_cached(t.hashes, t.hits) for t in plan.tables):
            # Made before an eviction: a hit may now hold other tokens' KV.
            raise ValueError(f"the admission plan of request {group.request_id!r} is stale: replan it.")
        for table_plan in plan.tables:
            if table_plan.seq.seq_id in self.block_tables:
                raise ValueError(f"seq {table_plan.seq.seq_id} already has a block table.")
        cost = admission_cost(plan.tables, self.gpu_allocator)
        # Check up front so a failure never leaves half a table allocated.
        if cost > self.gpu_allocator.num_free_blocks:
            raise NoFreeBlocksError(
                f"request {group.request_id!r} needs {cost} blocks, "
                f"{self.gpu_allocator.num_free_blocks} free."
            )
        if self._prefix is not None:
            self._prefix.tick()
            # Hits first, every table's: allocating fresh blocks may evict, and
            # must not evict a block one of these tables is about to reuse.
            for table_plan in plan.tables:
                self._prefix.acquire(table_plan.hits)
        for table_plan in plan.tables:
            table = list(table_plan.hits)
            table.extend(self.gpu_allocator.allocate() for _ in range(table_plan.num_blocks - len(table_plan.hits)))
            self.put_table(table_plan.seq.seq_id, table)
            if self._prefix is not None:
                self._prefix.record_admission(table_plan.seq, table_plan.hashes, table_plan.hits)

    # -- prefix cache ----------------------------------------------------------

    @property
    def prefix_tracker(self) -> PrefixCacheTracker | None:
        """The sequences' prefix-hash chains; None without prefix caching."""
        return self._prefix

    def mark_computed(self, seq: Sequence) -> None:
        """Register the sequence's newly full and computed blocks in the prefix cache.

        Call after seq.num_computed_tokens advanced (the step wrote their KV).
        Registering earlier, e.g. at allocation, would let another sequence
        hit a block whose KV is not written yet. Blocks filled by decodes are
        registered too. A block whose hash already names another block stays
        unhashed (the first copy is the cached one). A no-op without prefix
        caching or for a sequence without a table.
        """
        if self._prefix is not None:
            self._prefix.mark_computed(seq, self.block_tables.get(seq.seq_id))

    def get_num_cached_tokens(self, seq: Sequence) -> int:
        """Leading tokens of seq that allocate() would take from the prefix cache now.

        0 without prefix caching. Pure query: changes no statistics or LRU order.
        """
        if self._prefix is None:
            return 0
        _, hits = self._prefix.match_prefix(seq)
        return len(hits) * self.block_size

    def reset_prefix_cache(self) -> None:
        """Forget every cached block, e.g. after the worker lost its KV cache.

        Evictable blocks become plain free blocks. Sequences holding blocks now
        keep them but never register them (or later ones) again: their KV may
        be as untrustworthy as the cache's.
        """
        if self._prefix is not None:
            self._prefix.reset()

    # -- swapping (BlockSwapper has the details) -------------------------------

    def can_swap_out(self, group: SequenceGroup) -> bool:
        """Whether the CPU pool can take the group's RUNNING sequences."""
        return self._swapper.can_swap_out(group)

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's RUNNING sequences to CPU blocks; returns (device, cpu) pairs."""
        return self._swapper.swap_out(group)

    def can_swap_in(self, group: SequenceGroup) -> AllocStatus:
        """Whether the group's SWAPPED sequences fit back on the device (watermark kept)."""
        return self._swapper.can_swap_in(group)

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's SWAPPED sequences back to fresh device blocks; returns (cpu, device) pairs."""
        return self._swapper.swap_in(group)

    def get_cpu_block_table(self, seq: Sequence) -> list[int]:
        """A copy of a swapped-out sequence's CPU block ids, in token order."""
        return self._swapper.get_cpu_block_table(seq)

    @property
    def num_cpu_blocks(self) -> int:
        """Blocks in the CPU swap pool (0: every preemption recomputes)."""
        return self._swapper.num_cpu_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        """CPU blocks not referenced by any swapped-out table."""
        return self._swapper.num_free_cpu_blocks

    def get_num_used_cpu_blocks(self) -> int:
        """CPU blocks referenced by at least one swapped-out table."""
        return self._swapper.get_num_used_cpu_blocks()

    # -- release ---------------------------------------------------------------

    def finish_group(self, group: SequenceGroup, status: SequenceStatus) -> None:
        """End every unfinished sequence of the group with status (a FINISHED_* one) and free its blocks."""
        if not status.is_finished:
            raise ValueError(f"status must be a FINISHED_* status, got {status.name}.")
        for seq in group.unfinished_seqs():
            seq.status = status
            self.free(seq)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks (ref counted) and drop its table.

        A no-op for sequences without a table, so aborting a waiting or
        already-freed sequence is safe. With prefix caching, hashed blocks
        that lose their last owner go to the evictor instead of the free list.
        A swapped-out sequence releases its CPU blocks.
        """
        self._swapper.free(seq)
        super().free(seq)
