"""Per-sequence block tables on the device: lookup, fork, growth with copy-on-write, release."""

from __future__ import annotations

from collections import Counter

from scheduler_service.core.block_allocator import BlockAllocator, NoFreeBlocksError
from scheduler_service.core.block_table_layout import BlockTableLayout
from scheduler_service.core.prefix_cache_tracker import PrefixCacheTracker
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus


class DeviceBlockTables:
    """The block tables of all sequences that hold device KV blocks.

    block_tables[seq_id][i] is the physical block holding tokens
    [i * block_size, (i + 1) * block_size) of that sequence (modulo the ring,
    see BlockTableLayout). Tables may share blocks (reference counted): fork()
    gives a sequence a copy of another's table (parallel sampling), and
    writing into a shared block goes through copy-on-write in append_slot.

    prefix, when set, is told about forks and released tables, and its
    logical clock is ticked once per operation (it orders the LRU evictor).
    How tables are first created (admission) is BlockManager's.
    """

    def __init__(
        self,
        layout: BlockTableLayout,
        gpu_allocator: BlockAllocator,
        prefix: PrefixCacheTracker | None,
        watermark_blocks: int = 0,
    ) -> None:
        self.gpu_allocator = gpu_allocator
        # Blocks that admission and swap-in leave free, so running sequences can still decode.
        self.watermark_blocks = watermark_blocks
        self.block_tables: dict[int, list[int]] = {}
        self._layout = layout
        self._prefix = prefix
        # Sequences whose table left the device since take_released(): the worker may forget them.
        self._released: list[int] = []

    # -- queries ---------------------------------------------------------------

    @property
    def block_size(self) -> int:
        """Token slots per block."""
        return self._layout.block_size

    @property
    def ring_blocks(self) -> int | None:
        """Most blocks a sliding-window table holds (reused as a ring); None without a sliding window."""
        return self._layout.ring_blocks

    @property
    def num_gpu_blocks(self) -> int:
        """Device blocks in the cache."""
        return self.gpu_allocator.num_blocks

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a table needs to hold num_tokens tokens (at most ring_blocks with a sliding window)."""
        return self._layout.num_blocks_for_tokens(num_tokens)

    def logical_block_table(self, seq: Sequence) -> list[int]:
        """Physical block of each of seq's logical blocks, in token order (what the worker addresses).

        The table itself without a sliding window (not a copy: read it, never
        keep it); with one, ring entries repeated over the sequence's length.
        """
        return self._layout.logical_view(self._table(seq), seq.num_tokens)

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

    # -- fork and growth -------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give child a copy of parent's block table, sharing every block.

        Each block's reference count goes up by one; a later write into a
        shared block copies it first (append_slot's copy-on-write). The
        child's num_computed_tokens becomes the parent's (their KV is in those
        blocks), so the child must hold the parent's computed tokens. With
        prefix caching the child also takes over which of those blocks were
        already considered for registration. Needs no free block.
        """
        table = self._table(parent)
        if child.seq_id in self.block_tables:
            raise ValueError(f"seq {child.seq_id} already has a block table.")
        num_computed = parent.num_computed_tokens
        if child.num_tokens < num_computed or child.all_token_ids[:num_computed] != parent.all_token_ids[:num_computed]:
            raise ValueError(
                f"seq {child.seq_id} does not hold the {num_computed} tokens computed for seq "
                f"{parent.seq_id}; it cannot share their KV."
            )
        for block_id in table:
            self.gpu_allocator.incref(block_id)
        self.block_tables[child.seq_id] = list(table)
        if self._prefix is not None:
            self._prefix.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = num_computed

    def can_append_slot(self, group: SequenceGroup) -> bool:
        """Whether every RUNNING sequence of the group can get its next slot.

        Counts one block per sequence that grows past its table, and the
        copies-on-write of shared last blocks: k sequences of the group
        writing into one block make k copies, or k - 1 when no table outside
        the group holds it (the last of them to append writes in place).
        """
        needed = 0
        sharers: Counter[int] = Counter()
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            table = self._table(seq)
            missing = self.num_blocks_for_tokens(seq.num_tokens) - len(table)
            if missing > 0:
                needed += missing
                continue
            block_id = table[self._layout.slot_block_index(seq.num_tokens)]
            if self.gpu_allocator.get_ref_count(block_id) > 1:
                sharers[block_id] += 1
        for block_id, count in sharers.items():
            needed += count - 1 if self.gpu_allocator.get_ref_count(block_id) == count else count
        return needed <= self.gpu_allocator.num_free_blocks

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """Make the table cover seq.num_tokens tokens before they are computed.

        The newest token's slot is seq.num_tokens - 1. Allocates a block when
        the table is too short. When the slot's block is shared, it is copied
        on write: a new block replaces it in this table and (src, dst) is
        returned so the worker copies the KV before the step; else None.
        """
        table = self._table(seq)
        num_blocks = self.num_blocks_for_tokens(seq.num_tokens)
        # The table grows (the slot lands in a fresh, unshared block), or the slot's block is copied if shared.
        grows = len(table) < num_blocks
        index = -1 if grows else self._layout.slot_block_index(seq.num_tokens)
        needed = num_blocks - len(table) if grows else int(self.gpu_allocator.get_ref_count(table[index]) > 1)
        self.tick()
        if needed > self.gpu_allocator.num_free_blocks:
            raise NoFreeBlocksError(
                f"seq {seq.seq_id} needs {needed} blocks, {self.gpu_allocator.num_free_blocks} free."
            )
        if grows:
            while len(table) < num_blocks:
                table.append(self.gpu_allocator.allocate())
            return None
        if needed == 0:
            return None
        src = table[index]
        dst = self.gpu_allocator.allocate()
        table[index] = dst
        self.gpu_allocator.free(src)
        return (src, dst)

    # -- release ---------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Release the sequence's device blocks (ref counted) and drop its table.

        A no-op for sequences without a table, so aborting a waiting or
        already-freed sequence is safe. With prefix caching, hashed blocks
        that lose their last owner go to the evictor instead of the free list.
        """
        table = self.block_tables.pop(seq.seq_id, None)
        self._forget_hashes(seq.seq_id)
        if table is None:
            return
        self._released.append(seq.seq_id)
        # One tick for the whole table: its blocks tie in LRU order, so the
        # evictor takes the deepest first.
        self.tick()
        for block_id in table:
            self.gpu_allocator.free(block_id)

    def take_table(self, seq_id: int) -> list[int]:
        """Remove a sequence's table, its blocks still referenced (KeyError when it has none).

        Its prefix-hash bookkeeping goes too: the blocks are about to leave
        the device (swap-out), so they are never registered again.
        """
        table = self.block_tables.pop(seq_id)
        self._forget_hashes(seq_id)
        self._released.append(seq_id)
        return table

    def take_released(self) -> list[int]:
        """Sequences whose device table was freed or taken (swap-out) since the last call, in that order."""
        released, self._released = self._released, []
        return released

    def put_table(self, seq_id: int, table: list[int]) -> None:
        """Install a table whose blocks the caller already referenced (admission, swap-in)."""
        if seq_id in self.block_tables:
            raise ValueError(f"seq {seq_id} already has a block table.")
        self.block_tables[seq_id] = table

    def tick(self) -> None:
        """Advance the prefix cache's logical clock; a no-op without prefix caching."""
        if self._prefix is not None:
            self._prefix.tick()

    # -- helpers ---------------------------------------------------------------

    def _table(self, seq: Sequence) -> list[int]:
        table = self.block_tables.get(seq.seq_id)
        if table is None:
            raise ValueError(f"seq {seq.seq_id} has no block table.")
        return table

    def _forget_hashes(self, seq_id: int) -> None:
        if self._prefix is not None:
            self._prefix.forget(seq_id)
