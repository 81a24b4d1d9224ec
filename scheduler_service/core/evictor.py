"""LRU evictor: cached blocks that no sequence references, oldest evicted first."""

from __future__ import annotations

import heapq

# Rebuild the heap once stale entries outnumber live ones by this much, so
# blocks revived and released over and over cannot grow it without bound.
_COMPACT_SLACK = 64


class LRUEvictor:
    """Unreferenced blocks whose KV is still valid, ordered for eviction.

    Order (as vLLM's LRUEvictor): smallest last_accessed first; on a tie the
    block holding the MOST hashed tokens, i.e. the deepest block of a prefix
    chain. A lookup walks a chain from its root and stops at the first miss,
    so evicting a parent first would strand its still cached descendants;
    evicting from the leaf keeps every remaining block reachable. Last, the
    smallest block id, so the order is fully deterministic.

    last_accessed is a logical clock value chosen by the caller (the pure core
    never reads wall time).
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[int, int]] = {}  # block_id -> (last_accessed, num_hashed_tokens)
        # Lazy deletion: remove() leaves the heap entry behind; evict() skips
        # entries that no longer match _entries.
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
        """Make a block evictable."""
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
