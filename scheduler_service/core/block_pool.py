"""The physical KV blocks of one pool: free list, reference counts and, for the device, the prefix cache.

Block ids are 0..num_blocks-1. allocate() always returns the SMALLEST free id (tests and debugging rely on it):
freed ids go back into a min-heap, so the order in which blocks are freed never changes which id comes next.

With caching on, a fully computed block can be registered under its chained hash (see prefix_hash). When its
last owner releases it, it does not go back to the free list: it waits in an LRU evictor, KV intact, so a later
request with the same prefix can take it back (acquire). Fresh allocations use the free list first and only
then evict the least recently used cached block.
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass

from scheduler_service.core.prefix_hash import BlockHash

# Rebuild the evictor's heap once stale entries outnumber live ones by this much, so blocks revived and
# released over and over cannot grow it without bound.
_COMPACT_SLACK = 64


class NoFreeBlocksError(RuntimeError):
    """allocate() found every block in use: callers ask the block manager's can_* first, so this is a bug."""


class AllocStatus(enum.Enum):
    """Whether a waiting (or swapped) group's blocks can be allocated."""

    OK = enum.auto()  # now
    LATER = enum.auto()  # after running sequences free some blocks
    NEVER = enum.auto()  # not even with an empty cache


def alloc_status(needed: int, cost: int, num_blocks: int, num_free_blocks: int, watermark_blocks: int) -> AllocStatus:
    """NEVER when needed blocks exceed an empty cache less the watermark, LATER when cost leaves less than it free."""
    if needed > num_blocks - watermark_blocks:
        return AllocStatus.NEVER
    if num_free_blocks - cost < watermark_blocks:
        return AllocStatus.LATER
    return AllocStatus.OK


@dataclass(frozen=True)
class CachedBlockEntry:
    """A block registered in the prefix cache, as a snapshot holds it."""

    block_id: int
    block_hash: BlockHash
    # Tokens covered by the hash chain up to this block: its depth in the prefix, the evictor's tie-breaker.
    num_hashed_tokens: int
    # The logical time it entered the evictor; None while a table holds it.
    last_accessed: int | None


class LRUEvictor:
    """Unreferenced cached blocks, ordered for eviction.

    Order (as vLLM's): smallest last_accessed first; on a tie the block holding the MOST hashed tokens, the
    deepest of a prefix chain (a lookup walks a chain from its root and stops at the first miss, so evicting a
    parent first would strand its cached descendants); last the smallest block id. last_accessed is a logical
    clock value (the pure core never reads wall time).
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[int, int]] = {}  # block_id -> (last_accessed, num_hashed_tokens)
        # Lazy deletion: remove() leaves the heap entry behind; evict() skips entries that no longer match.
        self._heap: list[tuple[int, int, int]] = []  # (last_accessed, -num_hashed_tokens, block_id)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._entries

    def block_ids(self) -> list[int]:
        """The evictable block ids, sorted by id."""
        return sorted(self._entries)

    def last_accessed(self, block_id: int) -> int | None:
        """The stamp a block entered with; None when it is not in the evictor."""
        entry = self._entries.get(block_id)
        return None if entry is None else entry[0]

    def add(self, block_id: int, last_accessed: int, num_hashed_tokens: int) -> None:
        if block_id in self._entries:
            raise ValueError(f"block {block_id} is already in the evictor.")
        self._entries[block_id] = (last_accessed, num_hashed_tokens)
        heapq.heappush(self._heap, (last_accessed, -num_hashed_tokens, block_id))

    def remove(self, block_id: int) -> None:
        """Take a block back out (a prefix-cache hit revives it)."""
        if self._entries.pop(block_id, None) is None:
            raise ValueError(f"block {block_id} is not in the evictor.")
        if len(self._heap) > 2 * len(self._entries) + _COMPACT_SLACK:
            self._heap = [(t, -n, b) for b, (t, n) in self._entries.items()]
            heapq.heapify(self._heap)

    def clear(self) -> list[int]:
        """Remove every block; returns their ids, sorted."""
        block_ids = self.block_ids()
        self._entries.clear()
        self._heap.clear()
        return block_ids

    def evict(self) -> int:
        """Remove and return the block to evict next."""
        while self._heap:
            last_accessed, neg_tokens, block_id = heapq.heappop(self._heap)
            if self._entries.get(block_id) == (last_accessed, -neg_tokens):
                del self._entries[block_id]
                return block_id
        raise ValueError("the evictor is empty.")


class BlockPool:
    """Reference-counted block ids, with a content-addressed cache of computed blocks when caching is on.

    num_free_blocks counts evictable blocks too: they can be handed out at any time, so admission control must
    see them as free capacity. clock is a logical clock the block manager ticks once per operation; a block
    entering the evictor is stamped with it, so blocks released by one operation tie and the deepest goes first.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        self._free_heap: list[int] = list(range(num_blocks))  # range() is already a valid min-heap
        self.evictor = LRUEvictor()
        self.clock = 0
        self._block_by_hash: dict[BlockHash, int] = {}
        self._cached: dict[int, tuple[BlockHash, int]] = {}  # block_id -> (hash, num_hashed_tokens)
        # Blocks registered, evicted, or moved in or out of the evictor since take_changes(): what a journal of
        # the cache rewrites.
        self._changed: set[int] = set()

    # -- counts ----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with reference count zero: the free list plus the evictor."""
        return len(self._free_heap) + len(self.evictor)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a hash, in use or evictable."""
        return len(self._cached)

    def get_ref_count(self, block_id: int) -> int:
        """Current number of owners of block_id (0 when free)."""
        self._check_block_id(block_id)
        return self._ref_counts[block_id]

    def free_block_ids(self) -> list[int]:
        """Ids of the blocks with reference count zero (evictable ones included), sorted."""
        return sorted(self._free_heap + self.evictor.block_ids())

    def ref_counts(self) -> dict[int, int]:
        """block id -> reference count, for the blocks in use."""
        return {b: n for b, n in enumerate(self._ref_counts) if n}

    # -- owners ----------------------------------------------------------------

    def tick(self) -> int:
        """Advance the logical clock; returns the new time."""
        self.clock += 1
        return self.clock

    def allocate(self) -> int:
        """A fresh block with reference count 1: the smallest free id, else evict the LRU cached block.

        An evicted block's KV is about to be overwritten, so its hash is forgotten.
        """
        if self._free_heap:
            block_id = heapq.heappop(self._free_heap)
        elif len(self.evictor):
            block_id = self.evictor.evict()
            self._changed.add(block_id)
            block_hash, _ = self._cached.pop(block_id)
            del self._block_by_hash[block_hash]
        else:
            raise NoFreeBlocksError(f"all {self.num_blocks} KV blocks are in use; check can_* before allocating.")
        self._ref_counts[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        """Add one more owner to an allocated block (fork, swap of a shared block)."""
        self._check_allocated(block_id, "incref")
        self._ref_counts[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drop one owner. With none left the block is free again, or evictable when it is cached."""
        self._check_allocated(block_id, "free")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id]:
            return
        cached = self._cached.get(block_id)
        if cached is None:
            heapq.heappush(self._free_heap, block_id)
        else:
            self.evictor.add(block_id, self.clock, cached[1])
            self._changed.add(block_id)

    # -- the prefix cache ------------------------------------------------------

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block registered under block_hash, in use or evictable; None on a miss."""
        return self._block_by_hash.get(block_hash)

    def get_block_hash(self, block_id: int) -> BlockHash | None:
        """The hash block_id is registered under, None when it is not cached."""
        self._check_block_id(block_id)
        cached = self._cached.get(block_id)
        return None if cached is None else cached[0]

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

        Returns False and changes nothing when the hash already names a block (the first copy stays the cached
        one; this one is freed normally) or this block already has a hash.
        """
        self._check_allocated(block_id, "register")
        if not self.enable_caching:
            raise ValueError("this block pool has no prefix cache.")
        if block_hash in self._block_by_hash or block_id in self._cached:
            return False
        self._block_by_hash[block_hash] = block_id
        self._cached[block_id] = (block_hash, num_hashed_tokens)
        self._changed.add(block_id)
        return True

    def reset_cache(self) -> None:
        """Forget every hash: evictable blocks go back to the free list, blocks in use stay allocated."""
        self._changed.update(self._cached)
        for block_id in self.evictor.clear():
            heapq.heappush(self._free_heap, block_id)
        self._block_by_hash.clear()
        self._cached.clear()

    # -- snapshots -------------------------------------------------------------

    def cached_blocks(self) -> list[CachedBlockEntry]:
        """Every registered block, by block id, with its evictor stamp when unreferenced."""
        return [self._entry(b) for b in sorted(self._cached)]

    def cached_entry(self, block_id: int) -> CachedBlockEntry | None:
        """The block's registration with its evictor stamp; None when it is not cached."""
        return self._entry(block_id) if block_id in self._cached else None

    def _entry(self, block_id: int) -> CachedBlockEntry:
        block_hash, num_hashed_tokens = self._cached[block_id]
        return CachedBlockEntry(block_id, block_hash, num_hashed_tokens, self.evictor.last_accessed(block_id))

    def take_changes(self) -> set[int]:
        """Blocks whose registration or evictor stamp changed since the last call (look them up with cached_entry)."""
        changed, self._changed = self._changed, set()
        return changed

    def restore(self, ref_counts: dict[int, int], cached: tuple[CachedBlockEntry, ...] = (), clock: int = 0) -> None:
        """Start over with these blocks in use and these registered; the rest are free.

        ref_counts come from the caller's checked tables. An entry with a stamp is an evictable block (no
        reference), one without is held by a table. Restored from a snapshot, nothing differs from it: there is
        no change to journal.
        """
        if cached and not self.enable_caching:
            raise ValueError("the snapshot has prefix-cached blocks, the configuration no prefix caching.")
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
            self._cached[entry.block_id] = (entry.block_hash, entry.num_hashed_tokens)
            if entry.last_accessed is not None:
                self.evictor.add(entry.block_id, entry.last_accessed, entry.num_hashed_tokens)
        self.clock = clock
        self._ref_counts = [ref_counts.get(b, 0) for b in range(self.num_blocks)]
        # Sorted, hence already a valid min-heap.
        self._free_heap = [b for b in range(self.num_blocks) if not self._ref_counts[b] and b not in self.evictor]

    def _check_block_id(self, block_id: int) -> None:
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block_id must be in [0, {self.num_blocks}), got {block_id!r}.")

    def _check_allocated(self, block_id: int, verb: str) -> None:
        self._check_block_id(block_id)
        # A count going negative would silently corrupt the free list.
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"cannot {verb} block {block_id}: it is not allocated.")
