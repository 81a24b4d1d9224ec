"""Block allocator with a content-addressed cache of computed blocks.

A block whose tokens are all computed can be registered under its chained
hash (see prefix_hash). When its last owner releases it, it does not go back
to the free list: it waits in an LRU evictor, KV intact, so a later request
with the same prefix can take it back. Fresh allocations use the free list
first and only then evict the least recently used cached block.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from scheduler_service.core.block_allocator import BlockAllocator, NoFreeBlocksError
from scheduler_service.core.evictor import LRUEvictor
from scheduler_service.core.prefix_hash import BlockHash


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache lookups, counted in blocks at admission.

    queries: full blocks that could have been reused (every full block of an
        admitted sequence except the one holding its last token).
    hits: blocks actually reused. The lookup stops at the first miss, so
        blocks after it count as queried but not hit.
    """

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / queries, 0.0 before any query."""
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True)
class CachedBlockEntry:
    """A block registered in the prefix cache, as a snapshot holds it."""

    block_id: int
    block_hash: BlockHash
    num_hashed_tokens: int
    # The logical time it entered the evictor; None while a table holds it.
    last_accessed: int | None


@dataclass(frozen=True)
class _CachedBlock:
    block_hash: BlockHash
    # Tokens covered by the hash chain up to this block: its depth in the
    # prefix, the evictor's tie-breaker.
    num_hashed_tokens: int


class PrefixCachingBlockAllocator(BlockAllocator):
    """BlockAllocator whose unreferenced hashed blocks stay cached until evicted.

    num_free_blocks counts evictable blocks too: they can be handed out at
    any time, so admission control must see them as free capacity.

    clock is a logical clock: the block manager ticks it on every operation,
    and a block entering the evictor is stamped with the current value, so
    blocks released by the same operation tie and the deepest goes first.
    """

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.evictor = LRUEvictor()
        self.clock = 0
        self._block_by_hash: dict[BlockHash, int] = {}
        self._cached: dict[int, _CachedBlock] = {}
        # Blocks registered, evicted, or moved in or out of the evictor since take_changes(): what a
        # journal of the cache rewrites.
        self._changed: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        """Blocks with reference count zero: the free list plus the evictor."""
        return len(self._free_heap) + len(self.evictor)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a hash, in use or evictable."""
        return len(self._cached)

    def tick(self) -> int:
        """Advance the logical clock; returns the new time."""
        self.clock += 1
        return self.clock

    def free_block_ids(self) -> list[int]:
        """Ids of the blocks with reference count zero (evictable ones included), sorted."""
        return sorted(self._free_heap + self.evictor.block_ids())

    def allocate(self) -> int:
        """A fresh block with reference count 1: smallest free id, else evict the LRU cached block.

        An evicted block's KV is about to be overwritten, so its hash is forgotten.
        """
        if self._free_heap:
            return super().allocate()
        if not len(self.evictor):
            raise NoFreeBlocksError(
                f"all {self._num_blocks} KV blocks are in use; check can_* before allocating."
            )
        block_id = self.evictor.evict()
        self._changed.add(block_id)
        cached = self._cached.pop(block_id)
        del self._block_by_hash[cached.block_hash]
        self._ref_counts[block_id] = 1
        return block_id

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block registered under block_hash, in use or evictable; None on a miss."""
        return self._block_by_hash.get(block_hash)

    def get_block_hash(self, block_id: int) -> BlockHash | None:
        """The hash block_id is registered under, None when it is not cached."""
        self._check_block_id(block_id)
        cached = self._cached.get(block_id)
        return None if cached is None else cached.block_hash

    def acquire(self, block_id: int) -> None:
        """Take one reference on a cached block, reviving it from the evictor if unreferenced."""
        if block_id not in self._cached:
            raise ValueError(f"cannot acquire block {block_id}: it is not a cached block.")
        if self._ref_counts[block_id] == 0:
            self.evictor.remove(block_id)
            self._changed.add(block_id)
        self._ref_counts[block_id] += 1

    def register(self, block_id: int, block_hash: BlockHash, num_hashed_tokens: int) -> bool:
        """Register an in-use, fully computed block under block_hash.

        Returns False and changes nothing when the hash already names a block
        (the first copy stays the cached one; this one is freed normally) or
        this block already has a hash.
        """
        self._check_allocated(block_id, "register")
        if block_hash in self._block_by_hash or block_id in self._cached:
            return False
        self._block_by_hash[block_hash] = block_id
        self._cached[block_id] = _CachedBlock(block_hash, num_hashed_tokens)
        self._changed.add(block_id)
        return True

    def cached_blocks(self) -> list[CachedBlockEntry]:
        """Every registered block, by block id, with its evictor stamp when unreferenced."""
        return [self._entry(b, c) for b, c in sorted(self._cached.items())]

    def cached_entry(self, block_id: int) -> CachedBlockEntry | None:
        """The block's registration with its evictor stamp; None when it is not cached."""
        cached = self._cached.get(block_id)
        return None if cached is None else self._entry(block_id, cached)

    def _entry(self, block_id: int, cached: _CachedBlock) -> CachedBlockEntry:
        return CachedBlockEntry(block_id, cached.block_hash, cached.num_hashed_tokens, self.evictor.last_accessed(block_id))

    def take_changes(self) -> set[int]:
        """Blocks whose registration or evictor stamp changed since the last call (look them up with cached_entry)."""
        changed, self._changed = self._changed, set()
        return changed

    def restore(self, ref_counts: dict[int, int], cached: tuple[CachedBlockEntry, ...] = (), clock: int = 0) -> None:
        """Start over with these blocks in use and these registered (see BlockAllocator.restore).

        An entry with a stamp is an evictable block (no reference), one without is held by a table.
        """
        # Restored from a snapshot, nothing differs from it: no change to journal.
        self._changed = set()
        self.evictor.clear()
        self._block_by_hash.clear()
        self._cached.clear()
        for entry in cached:
            self._check_block_id(entry.block_id)
            referenced = ref_counts.get(entry.block_id, 0) > 0
            if referenced == (entry.last_accessed is not None):
                state = "held by a table" if referenced else "held by no table"
                raise ValueError(f"cached block {entry.block_id} is {state}, yet its evictor stamp is {entry.last_accessed}.")
            if entry.block_hash in self._block_by_hash or entry.block_id in self._cached:
                raise ValueError(f"cached block {entry.block_id}: its block id or hash is registered twice.")
            self._block_by_hash[entry.block_hash] = entry.block_id
            self._cached[entry.block_id] = _CachedBlock(entry.block_hash, entry.num_hashed_tokens)
            if entry.last_accessed is not None:
                self.evictor.add(entry.block_id, entry.last_accessed, entry.num_hashed_tokens)
        self.clock = clock
        super().restore(ref_counts)

    def _keeps_free(self, block_id: int) -> bool:
        return block_id not in self.evictor

    def reset(self) -> None:
        """Forget every hash: evictable blocks go back to the free list, blocks in use stay allocated."""
        self._changed.update(self._cached)
        for block_id in self.evictor.clear():
            heapq.heappush(self._free_heap, block_id)
        self._block_by_hash.clear()
        self._cached.clear()

    def _release(self, block_id: int) -> None:
        cached = self._cached.get(block_id)
        if cached is None:
            super()._release(block_id)
        else:
            self.evictor.add(block_id, self.clock, cached.num_hashed_tokens)
            self._changed.add(block_id)
