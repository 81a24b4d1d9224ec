"""Maps sequences to physical KV blocks: block tables, admission and growth."""

from __future__ import annotations

import enum

from scheduler_service.core.block_allocator import BlockAllocator, NoFreeBlocksError
from scheduler_service.core.config import CacheConfig
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus

__all__ = ["AllocStatus", "BlockAllocator", "BlockManager", "NoFreeBlocksError"]


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
    """

    def __init__(self, block_size: int, num_gpu_blocks: int, watermark: float = 0.01) -> None:
        # CacheConfig carries the validation rules; reuse them.
        config = CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks, watermark=watermark)
        self.block_size = config.block_size
        self.num_gpu_blocks = config.num_gpu_blocks
        self.watermark_blocks = config.watermark_blocks
        self.gpu_allocator = BlockAllocator(config.num_gpu_blocks)
        self.block_tables: dict[int, list[int]] = {}

    @classmethod
    def from_config(cls, config: CacheConfig) -> BlockManager:
        """Build from a validated CacheConfig."""
        return cls(config.block_size, config.num_gpu_blocks, config.watermark)

    # -- admission ---------------------------------------------------------

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return _cdiv(num_tokens, self.block_size)

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        """Whether the group's first WAITING sequence fits in the cache.

        All its tokens count, outputs included: a recomputed sequence
        re-prefills prompt + outputs. The watermark keeps a few blocks free so
        running sequences can still decode after the admission.
        """
        seq = self._first_waiting_seq(group)
        needed = self.num_blocks_for_tokens(seq.num_tokens)
        if needed > self.num_gpu_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        if self.gpu_allocator.num_free_blocks - needed < self.watermark_blocks:
            return AllocStatus.LATER
        return AllocStatus.OK

    def allocate(self, group: SequenceGroup) -> None:
        """Allocate the block table of the group's waiting sequences.

        The table is sized for the first waiting sequence and shared (ref
        counted) by every waiting sequence of the group, which is only valid
        while they hold the same tokens; copy-on-write splits them later.
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
        # Check up front so a failure never leaves half a table allocated.
        if needed > self.gpu_allocator.num_free_blocks:
            raise NoFreeBlocksError(
                f"request {group.request_id!r} needs {needed} blocks, "
                f"{self.gpu_allocator.num_free_blocks} free."
            )
        table = [self.gpu_allocator.allocate() for _ in range(needed)]
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

    # -- release and queries -------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks (ref counted) and drop its table.

        A no-op for sequences without a table, so aborting a waiting or
        already-freed sequence is safe.
        """
        table = self.block_tables.pop(seq.seq_id, None)
        if table is None:
            return
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
        """Blocks not referenced by any table."""
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

    def _num_new_blocks_for_append(self, seq: Sequence) -> int:
        table = self._table(seq)
        missing = self.num_blocks_for_tokens(seq.num_tokens) - len(table)
        if missing > 0:
            return missing
        index = (seq.num_tokens - 1) // self.block_size
        return 1 if self.gpu_allocator.get_ref_count(table[index]) > 1 else 0
