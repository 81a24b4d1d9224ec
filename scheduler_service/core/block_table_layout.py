"""Where a sequence's tokens live in its block table: table sizes and the sliding-window ring."""

from __future__ import annotations

from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


@dataclass(frozen=True)
class BlockTableLayout:
    """Maps token positions to block-table entries.

    table[i] holds tokens [i * block_size, (i + 1) * block_size). block_size
    is validated by CacheConfig; ring_blocks here.

    Sliding window (ring_blocks set): a model whose every layer attends to
    the last `window` tokens only never reads older keys, so a table holds at
    most ring_blocks blocks and logical block i lives in table[i % ring_blocks]:
    a new block's tokens overwrite those ring_blocks * block_size positions
    back. The caller sizes the ring so that no step overwrites a key that the
    step still reads (window + the most tokens one step computes - 1 slots).

        block_size = 2, ring_blocks = 3, 9 tokens:

        logical block   0     1     2     3     4
        tokens         0 1 | 2 3 | 4 5 | 6 7 | 8
        table entry     0     1     2     0     1     (table has 3 entries)
    """

    block_size: int
    ring_blocks: int | None = None

    def __post_init__(self) -> None:
        ring_blocks = self.ring_blocks
        if ring_blocks is not None and (isinstance(ring_blocks, bool) or not isinstance(ring_blocks, int)
                                        or ring_blocks < 1):
            raise ValueError(f"ring_blocks must be a positive int or None, got {ring_blocks!r}.")

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a table needs to hold num_tokens tokens (at most ring_blocks with a sliding window)."""
        blocks = cdiv(num_tokens, self.block_size)
        return blocks if self.ring_blocks is None else min(blocks, self.ring_blocks)

    def slot_block_index(self, num_tokens: int) -> int:
        """Table index of the block holding token num_tokens - 1."""
        index = (num_tokens - 1) // self.block_size
        return index if self.ring_blocks is None else index % self.ring_blocks

    def logical_view(self, table: list[int], num_tokens: int) -> list[int]:
        """Physical block of each logical block of a num_tokens-long sequence, in token order.

        table itself without a sliding window (not a copy); with one, ring
        entries repeated over the sequence's length.
        """
        num_logical = cdiv(num_tokens, self.block_size)
        # A table short of its ring has not wrapped (its newest token may still lack its block).
        if self.ring_blocks is None or len(table) < self.ring_blocks or num_logical <= len(table):
            return table
        return [table[i % self.ring_blocks] for i in range(num_logical)]
