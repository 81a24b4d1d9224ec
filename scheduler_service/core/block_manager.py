"""Maps sequences to physical KV blocks: block tables, admission and growth."""

from __future__ import annotations

import enum

from scheduler_service.core.block_allocator import BlockAllocator, NoFreeBlocksError
from scheduler_service.core.config import CacheConfig
from scheduler_service.core.prefix_caching_allocator import PrefixCacheStats, PrefixCachingBlockAllocator
from scheduler_service.core.prefix_hash import ROOT_BLOCK_HASH, BlockHash, hash_block_tokens
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus

__all__ = ["AllocStatus", "BlockAllocator", "BlockManager", "NoFreeBlocksError", "PrefixCacheStats"]


class AllocStatus(enum.Enum):
    """Whether a waiting group's blocks can be allocated."""

    OK = enum.auto()  # now
    LATER = enum.auto()  # after running sequences free some blocks
    NEVER = enum.auto()  # not even with an empty cache


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Owns the block tables of all sequences that hold KV cache.

    block_tables[seq_id][i] is the physical block holding tokens
    [i * block_size, (i + 1) * block_size) of that sequence. Tables may share
    blocks (reference counted); writing into a shared block goes through
    copy-on-write in append_slot.

    With prefix caching, allocate() reuses the cached blocks of the longest
    matching prefix and mark_computed() registers blocks once their KV is
    written; unreferenced cached blocks count as free (they are evicted on
    demand).
    """

    def __init__(
        self, block_size: int, num_gpu_blocks: int, watermark: float = 0.01, enable_prefix_caching: bool = False
    ) -> None:
        # CacheConfig carries the validation rules; reuse them.
        config = CacheConfig(
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            watermark=watermark,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.block_size = config.block_size
        self.num_gpu_blocks = config.num_gpu_blocks
        self.watermark_blocks = config.watermark_blocks
        self.enable_prefix_caching = config.enable_prefix_caching
        # Typed separately so the prefix-cache calls need no casts; the same
        # object as gpu_allocator when caching is on.
        self._cache: PrefixCachingBlockAllocator | None = None
        if config.enable_prefix_caching:
            self._cache = PrefixCachingBlockAllocator(config.num_gpu_blocks)
            self.gpu_allocator: BlockAllocator = self._cache
        else:
            self.gpu_allocator = BlockAllocator(config.num_gpu_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # seq_id -> chained hashes of the leading blocks of its table already
        # considered for registration, so each step hashes only new blocks.
        # Only sequences allocated with prefix caching on have an entry.
        self._block_hashes: dict[int, list[BlockHash]] = {}

    @classmethod
    def from_config(cls, config: CacheConfig) -> BlockManager:
        """Build from a validated CacheConfig."""
        return cls(config.block_size, config.num_gpu_blocks, config.watermark, config.enable_prefix_caching)

    # -- admission ---------------------------------------------------------

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return _cdiv(num_tokens, self.block_size)

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        """Whether the group's first WAITING sequence fits in the cache.

        All its tokens count, outputs included: a recomputed sequence
        re-prefills prompt + outputs. The watermark keeps a few blocks free so
        running sequences can still decode after the admission.

        Prefix-cache hits on blocks another table already uses cost nothing;
        hits revived from the evictor cost a free block each (evictable blocks
        are counted as free). NEVER ignores hits: they may be evicted later.
        """
        seq = self._first_waiting_seq(group)
        needed = self.num_blocks_for_tokens(seq.num_tokens)
        if needed > self.num_gpu_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        _, hits = self._match_prefix(seq)
        cost = needed - self._num_in_use(hits)
        if self.gpu_allocator.num_free_blocks - cost < self.watermark_blocks:
            return AllocStatus.LATER
        return AllocStatus.OK

    def allocate(self, group: SequenceGroup) -> None:
        """Allocate the block table of the group's waiting sequences.

        The table is sized for the first waiting sequence and shared (ref
        counted) by every waiting sequence of the group, which is only valid
        while they hold the same tokens; copy-on-write splits them later.

        With prefix caching the table starts with the cached blocks of the
        longest matching prefix (never the block holding the last token, so
        every sequence computes at least one token into a block of its own)
        and each waiting sequence's num_computed_tokens is set to the tokens
        they hold.
        """
        waiting = group.get_seqs(SequenceStatus.WAITING)
        first = self._first_waiting_seq(group)
        token_ids = first.all_token_ids
        for seq in waiting:
            if seq.seq_id in self.block_tables:
                raise ValueError(f"seq {seq.seq_id} already has a block table.")
            if seq.all_token_ids != token_ids:
                raise ValueError(
                    f"waiting seqs of request {group.request_id!r} hold different tokens; "
                    "they cannot share one prefill."
                )
        needed = self.num_blocks_for_tokens(first.num_tokens)
        hashes, hits = self._match_prefix(first)
        cost = needed - self._num_in_use(hits)
        # Check up front so a failure never leaves half a table allocated.
        if cost > self.gpu_allocator.num_free_blocks:
            raise NoFreeBlocksError(
                f"request {group.request_id!r} needs {cost} blocks, "
                f"{self.gpu_allocator.num_free_blocks} free."
            )
        table: list[int] = []
        if self._cache is not None:
            self._cache.tick()
            # Hits first: allocating fresh blocks may evict, and must not
            # evict a block this very table is about to reuse.
            for block_id in hits:
                self._cache.acquire(block_id)
            table.extend(hits)
            self.prefix_cache_stats.queries += self._max_hit_blocks(first)
            self.prefix_cache_stats.hits += len(hits)
            for seq in waiting:
                # The truth for a fresh table: only the reused blocks hold KV.
                seq.num_computed_tokens = len(hits) * self.block_size
                self._block_hashes[seq.seq_id] = list(hashes)
        table.extend(self.gpu_allocator.allocate() for _ in range(needed - len(hits)))
        self.block_tables[first.seq_id] = table
        for seq in waiting:
            if seq is first:
                continue
            for block_id in table:
                self.gpu_allocator.incref(block_id)
            self.block_tables[seq.seq_id] = list(table)

    # -- growth ------------------------------------------------------------

    def can_append_slot(self, group: SequenceGroup) -> bool:
        """Whether every RUNNING sequence of the group can get its next slot.

        Counts one block per sequence that grows past its table or must
        copy-on-write a shared last block. Sequences sharing the same block
        are each counted, so this may over-estimate (never under-estimate).
        """
        needed = sum(self._num_new_blocks_for_append(seq) for seq in group.get_seqs(SequenceStatus.RUNNING))
        return needed <= self.gpu_allocator.num_free_blocks

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """Make the table cover seq.num_tokens tokens before they are computed.

        The newest token's slot is seq.num_tokens - 1. Allocates a block when
        the table is too short. When the slot's block is shared, it is copied
        on write: a new block replaces it in this table and (src, dst) is
        returned so the worker copies the KV before the step; else None.
        """
        table = self._table(seq)
        needed = self._num_new_blocks_for_append(seq)
        self._tick()
        if needed > self.gpu_allocator.num_free_blocks:
            raise NoFreeBlocksError(
                f"seq {seq.seq_id} needs {needed} blocks, {self.gpu_allocator.num_free_blocks} free."
            )
        num_blocks = self.num_blocks_for_tokens(seq.num_tokens)
        if len(table) < num_blocks:
            # The slot lands in a fresh, unshared block: no copy needed.
            while len(table) < num_blocks:
                table.append(self.gpu_allocator.allocate())
            return None
        index = (seq.num_tokens - 1) // self.block_size
        src = table[index]
        if self.gpu_allocator.get_ref_count(src) == 1:
            return None
        dst = self.gpu_allocator.allocate()
        table[index] = dst
        self.gpu_allocator.free(src)
        return (src, dst)

    # -- prefix cache ----------------------------------------------------------

    def mark_computed(self, seq: Sequence) -> None:
        """Register the sequence's newly full and computed blocks in the prefix cache.

        Call after seq.num_computed_tokens advanced (the step wrote their KV).
        Registering earlier, e.g. at allocation, would let another sequence
        hit a block whose KV is not written yet. Blocks filled by decodes are
        registered too. A block whose hash already names another block stays
        unhashed (the first copy is the cached one). A no-op without prefix
        caching or for a sequence without a table.
        """
        if self._cache is None:
            return
        hashes = self._block_hashes.get(seq.seq_id)
        table = self.block_tables.get(seq.seq_id)
        if hashes is None or table is None:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(table))
        if num_full <= len(hashes):
            return
        self._cache.tick()
        token_ids = seq.all_token_ids
        parent = hashes[-1] if hashes else ROOT_BLOCK_HASH
        for index in range(len(hashes), num_full):
            start = index * self.block_size
            parent = hash_block_tokens(parent, token_ids[start : start + self.block_size])
            self._cache.register(table[index], parent, start + self.block_size)
            hashes.append(parent)

    def get_num_cached_tokens(self, seq: Sequence) -> int:
        """Leading tokens of seq that allocate() would take from the prefix cache now.

        0 without prefix caching. Pure query: changes no statistics or LRU order.
        """
        _, hits = self._match_prefix(seq)
        return len(hits) * self.block_size

    def reset_prefix_cache(self) -> None:
        """Forget every cached block, e.g. after the worker lost its KV cache.

        Evictable blocks become plain free blocks. Sequences holding blocks now
        keep them but never register them (or later ones) again: their KV may
        be as untrustworthy as the cache's.
        """
        if self._cache is None:
            return
        self._cache.reset()
        self._block_hashes.clear()

    # -- release and queries -------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks (ref counted) and drop its table.

        A no-op for sequences without a table, so aborting a waiting or
        already-freed sequence is safe. With prefix caching, hashed blocks
        that lose their last owner go to the evictor instead of the free list.
        """
        table = self.block_tables.pop(seq.seq_id, None)
        self._block_hashes.pop(seq.seq_id, None)
        if table is None:
            return
        # One tick for the whole table: its blocks tie in LRU order, so the
        # evictor takes the deepest first.
        self._tick()
        for block_id in table:
            self.gpu_allocator.free(block_id)

    def has_block_table(self, seq: Sequence) -> bool:
        """True when the sequence holds KV blocks."""
        return seq.seq_id in self.block_tables

    def get_block_table(self, seq: Sequence) -> list[int]:
        """A copy of the sequence's physical block ids, in token order."""
        return list(self._table(seq))

    @property
    def num_free_gpu_blocks(self) -> int:
        """Blocks not referenced by any table (evictable cached blocks included)."""
        return self.gpu_allocator.num_free_blocks

    def get_num_used_blocks(self) -> int:
        """Blocks referenced by at least one table."""
        return self.num_gpu_blocks - self.gpu_allocator.num_free_blocks

    # -- helpers -------------------------------------------------------------

    def _table(self, seq: Sequence) -> list[int]:
        table = self.block_tables.get(seq.seq_id)
        if table is None:
            raise ValueError(f"seq {seq.seq_id} has no block table.")
        return table

    def _first_waiting_seq(self, group: SequenceGroup) -> Sequence:
        waiting = group.get_seqs(SequenceStatus.WAITING)
        if not waiting:
            raise ValueError(f"request {group.request_id!r} has no WAITING sequence.")
        return waiting[0]

    def _tick(self) -> None:
        if self._cache is not None:
            self._cache.tick()

    def _max_hit_blocks(self, seq: Sequence) -> int:
        # The block holding the last token is never reused: the sequence must
        # compute at least that token (its logits are sampled) and write it
        # into a block of its own, never into a shared cached block.
        return (seq.num_tokens - 1) // self.block_size

    def _match_prefix(self, seq: Sequence) -> tuple[list[BlockHash], list[int]]:
        """Chained hashes and cached block ids of seq's longest cached prefix."""
        if self._cache is None:
            return [], []
        token_ids = seq.all_token_ids
        parent = ROOT_BLOCK_HASH
        hashes: list[BlockHash] = []
        hits: list[int] = []
        for index in range(self._max_hit_blocks(seq)):
            start = index * self.block_size
            parent = hash_block_tokens(parent, token_ids[start : start + self.block_size])
            block_id = self._cache.lookup(parent)
            if block_id is None:
                break
            hashes.append(parent)
            hits.append(block_id)
        return hashes, hits

    def _num_in_use(self, block_ids: list[int]) -> int:
        return sum(1 for block_id in block_ids if self.gpu_allocator.get_ref_count(block_id) > 0)

    def _num_new_blocks_for_append(self, seq: Sequence) -> int:
        table = self._table(seq)
        missing = self.num_blocks_for_tokens(seq.num_tokens) - len(table)
        if missing > 0:
            return missing
        index = (seq.num_tokens - 1) // self.block_size
        return 1 if self.gpu_allocator.get_ref_count(table[index]) > 1 else 0
