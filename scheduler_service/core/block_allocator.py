"""Reference-counted allocator of physical KV-cache block ids."""

from __future__ import annotations

import heapq


class NoFreeBlocksError(RuntimeError):
    """Raised by allocate() when every block is in use.

    Callers are expected to ask BlockManager.can_allocate / can_append_slot
    first, so seeing this error means a scheduling bug, not a full cache.
    """


class BlockAllocator:
    """Hands out physical block ids 0..num_blocks-1 with reference counts.

    Allocation policy (tests and debugging rely on it): allocate() always
    returns the SMALLEST free block id. Freed ids go back into a min-heap, so
    the order in which blocks are freed never changes which id is handed out
    next; the cache layout depends only on which blocks are free.

    Reference counts let several block tables share a block (fork for n>1 and
    beam search, prefix caching): free() only returns the block to the
    free pool when its count drops to zero.
    """

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}.")
        self._num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # range() is already a valid min-heap.
        self._free_heap: list[int] = list(range(num_blocks))

    @property
    def num_blocks(self) -> int:
        """Total number of physical blocks."""
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks with reference count zero."""
        return len(self._free_heap)

    def allocate(self) -> int:
        """Take the smallest free block id, with reference count 1."""
        if not self._free_heap:
            raise NoFreeBlocksError(
                f"all {self._num_blocks} KV blocks are in use; check can_* before allocating."
            )
        block_id = heapq.heappop(self._free_heap)
        self._ref_counts[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        """Add one more owner to an allocated block (the primitive fork will use)."""
        self._check_allocated(block_id, "incref")
        self._ref_counts[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drop one owner; the block becomes free again when none is left."""
        self._check_allocated(block_id, "free")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._release(block_id)

    def free_block_ids(self) -> list[int]:
        """Ids of the blocks with reference count zero, sorted."""
        return sorted(self._free_heap)

    def ref_counts(self) -> dict[int, int]:
        """block id -> reference count, for the blocks in use."""
        return {b: n for b, n in enumerate(self._ref_counts) if n}

    def restore(self, ref_counts: dict[int, int]) -> None:
        """Start over with these blocks in use (a scheduler restored from a snapshot); the rest are free."""
        for block_id, count in ref_counts.items():
            self._check_block_id(block_id)
            if count < 1:
                raise ValueError(f"block {block_id}: a reference count must be positive, got {count}.")
        self._ref_counts = [ref_counts.get(b, 0) for b in range(self._num_blocks)]
        # Sorted, hence already a valid min-heap.
        self._free_heap = [b for b in range(self._num_blocks) if not self._ref_counts[b] and self._keeps_free(b)]

    def _keeps_free(self, block_id: int) -> bool:
        """Whether an unreferenced block belongs on the free list (the prefix cache keeps its own)."""
        return True

    def _release(self, block_id: int) -> None:
        """Called when block_id lost its last owner (a hook for the prefix cache)."""
        heapq.heappush(self._free_heap, block_id)

    def get_ref_count(self, block_id: int) -> int:
        """Current number of owners of block_id (0 when free)."""
        self._check_block_id(block_id)
        return self._ref_counts[block_id]

    def _check_block_id(self, block_id: int) -> None:
        if not isinstance(block_id, int) or not 0 <= block_id < self._num_blocks:
            raise ValueError(f"block_id must be in [0, {self._num_blocks}), got {block_id!r}.")

    def _check_allocated(self, block_id: int, verb: str) -> None:
        self._check_block_id(block_id)
        # A count going negative would silently corrupt the free pool.
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"cannot {verb} block {block_id}: it is not allocated.")
