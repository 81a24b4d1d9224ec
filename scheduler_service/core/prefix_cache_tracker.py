"""Per-sequence prefix-cache bookkeeping: matching a prompt's prefix, registering computed blocks.

The block-level cache (hash -> block, the evictor) is PrefixCachingBlockAllocator;
this module walks sequences' token ids over it: the chained hashes of each
table's leading blocks, and the hit/query statistics.
"""

from __future__ import annotations

from scheduler_service.core.prefix_caching_allocator import PrefixCacheStats, PrefixCachingBlockAllocator
from scheduler_service.core.prefix_hash import ROOT_BLOCK_HASH, BlockHash, hash_block_tokens
from scheduler_service.core.sequence import Sequence


class PrefixCacheTracker:
    """The chained block hashes of the sequences whose tables use the prefix cache.

    Only sequences allocated with prefix caching on have an entry; a sequence
    that lost its entry (swap-out, reset) never registers blocks again.
    """

    def __init__(self, allocator: PrefixCachingBlockAllocator, block_size: int, stats: PrefixCacheStats) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.stats = stats
        # seq_id -> chained hashes of the leading blocks of its table already
        # considered for registration, so each step hashes only new blocks.
        self._block_hashes: dict[int, list[BlockHash]] = {}

    def tick(self) -> None:
        """Advance the cache's logical clock (one tick per block-manager operation)."""
        self.allocator.tick()

    def max_hit_blocks(self, seq: Sequence) -> int:
        """Leading full blocks of seq that may come from the cache."""
        # The block holding the last token is never reused: the sequence must
        # compute at least that token (its logits are sampled) and write it
        # into a block of its own, never into a shared cached block.
        return (seq.num_tokens - 1) // self.block_size

    def match_prefix(self, seq: Sequence) -> tuple[list[BlockHash], list[int]]:
        """Chained hashes and cached block ids of seq's longest cached prefix.

        Pure query: changes no statistics or LRU order.
        """
        token_ids = seq.all_token_ids
        parent = ROOT_BLOCK_HASH
        hashes: list[BlockHash] = []
        hits: list[int] = []
        for index in range(self.max_hit_blocks(seq)):
            start = index * self.block_size
            parent = hash_block_tokens(parent, token_ids[start : start + self.block_size])
            block_id = self.allocator.lookup(parent)
            if block_id is None:
                break
            hashes.append(parent)
            hits.append(block_id)
        return hashes, hits

    def still_cached(self, hashes: list[BlockHash], hits: list[int]) -> bool:
        """Whether each hit of a match_prefix() result is still the block cached under its hash."""
        return all(self.allocator.lookup(h) == block_id for h, block_id in zip(hashes, hits))

    def acquire(self, hits: list[int]) -> None:
        """Take a reference on each hit block (reviving evictable ones)."""
        for block_id in hits:
            self.allocator.acquire(block_id)

    def record_admission(self, seq: Sequence, hashes: list[BlockHash], hits: list[int]) -> None:
        """Count a fresh table's lookups and start its hash chain at the hits it took."""
        self.stats.queries += self.max_hit_blocks(seq)
        self.stats.hits += len(hits)
        # The truth for a fresh table: only the reused blocks hold KV.
        seq.num_computed_tokens = len(hits) * self.block_size
        self._block_hashes[seq.seq_id] = list(hashes)

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give the child the parent's hash chain (they share those blocks)."""
        hashes = self._block_hashes.get(parent_id)
        if hashes is not None:
            self._block_hashes[child_id] = list(hashes)

    def chain_length(self, seq_id: int) -> int | None:
        """Blocks of seq's table considered for registration so far; None when it registers none."""
        hashes = self._block_hashes.get(seq_id)
        return None if hashes is None else len(hashes)

    def restore_chain(self, seq_id: int, hashes: list[BlockHash]) -> None:
        """Give a restored sequence the chain it had (its leading blocks' hashes)."""
        self._block_hashes[seq_id] = list(hashes)

    def forget(self, seq_id: int) -> None:
        """Drop a sequence's hash chain; a no-op when it has none."""
        self._block_hashes.pop(seq_id, None)

    def mark_computed(self, seq: Sequence, table: list[int] | None) -> None:
        """Register seq's newly full and computed blocks (see BlockManager.mark_computed)."""
        hashes = self._block_hashes.get(seq.seq_id)
        if hashes is None or table is None:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(table))
        if num_full <= len(hashes):
            return
        self.allocator.tick()
        token_ids = seq.all_token_ids
        parent = hashes[-1] if hashes else ROOT_BLOCK_HASH
        for index in range(len(hashes), num_full):
            start = index * self.block_size
            parent = hash_block_tokens(parent, token_ids[start : start + self.block_size])
            self.allocator.register(table[index], parent, start + self.block_size)
            hashes.append(parent)

    def reset(self) -> None:
        """Forget every cached block and every sequence's hash chain."""
        self.allocator.reset()
        self._block_hashes.clear()
