"""Maps sequences to physical KV blocks: block tables, admission and growth."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass

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


@dataclass
class _TablePlan:
    """One block table allocate() would create: its size and its prefix-cache hits."""

    seq: Sequence
    num_blocks: int
    hashes: list[BlockHash]
    hits: list[int]


class BlockManager:
    """Owns the block tables of all sequences that hold KV cache.

    block_tables[seq_id][i] is the physical block holding tokens
    [i * block_size, (i + 1) * block_size) of that sequence. Tables may share
    blocks (reference counted): fork() gives a sequence a copy of another's
    table (parallel sampling), and writing into a shared block goes through
    copy-on-write in append_slot.

    With prefix caching, allocate() reuses the cached blocks of the longest
    matching prefix and mark_computed() registers blocks once their KV is
    written; unreferenced cached blocks count as free (they are evicted on
    demand).

    Sliding window (ring_blocks set): a model whose every layer attends to
    the last `window` tokens only never reads older keys, so a table holds at
    most ring_blocks blocks and logical block i lives in table[i % ring_blocks]:
    a new block's tokens overwrite those ring_blocks * block_size positions
    back. The caller sizes the ring so that no step overwrites a key that the
    step still reads (window + the most tokens one step computes - 1 slots);
    logical_block_table() gives the worker the logical view.

    Swap preemption (num_cpu_blocks > 0): swap_out() moves a group's running
    sequences to CPU blocks (cpu_block_tables, a plain ref-counted allocator
    without prefix caching), swap_in() moves them back into fresh device
    blocks. Swapped-in blocks are never registered in the prefix cache again
    (the sequences lose their hash bookkeeping on swap-out).
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
        if ring_blocks is not None and (isinstance(ring_blocks, bool) or not isinstance(ring_blocks, int)
                                        or ring_blocks < 1):
            raise ValueError(f"ring_blocks must be a positive int or None, got {ring_blocks!r}.")
        if ring_blocks is not None and enable_prefix_caching:
            # A reused block would no longer hold what its hash says.
            raise ValueError("ring_blocks (sliding-window reuse) cannot be combined with prefix caching.")
        self.ring_blocks = ring_blocks
        # CacheConfig carries the validation rules; reuse them.
        config = CacheConfig(
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            watermark=watermark,
            enable_prefix_caching=enable_prefix_caching,
            num_cpu_blocks=num_cpu_blocks,
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
        self.num_cpu_blocks = config.num_cpu_blocks
        self.cpu_allocator: BlockAllocator | None = (
            BlockAllocator(config.num_cpu_blocks) if config.num_cpu_blocks else None
        )
        # seq_id -> CPU block ids of a swapped-out sequence, in token order.
        self.cpu_block_tables: dict[int, list[int]] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # seq_id -> chained hashes of the leading blocks of its table already
        # considered for registration, so each step hashes only new blocks.
        # Only sequences allocated with prefix caching on have an entry.
        self._block_hashes: dict[int, list[BlockHash]] = {}

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

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a table needs to hold num_tokens tokens (at most ring_blocks with a sliding window)."""
        blocks = _cdiv(num_tokens, self.block_size)
        return blocks if self.ring_blocks is None else min(blocks, self.ring_blocks)

    def _slot_block_index(self, num_tokens: int) -> int:
        """Table index of the block holding token num_tokens - 1."""
        index = (num_tokens - 1) // self.block_size
        return index if self.ring_blocks is None else index % self.ring_blocks

    def logical_block_table(self, seq: Sequence) -> list[int]:
        """Physical block of each of seq's logical blocks, in token order (what the worker addresses).

        The table itself without a sliding window (not a copy: read it, never
        keep it); with one, ring entries repeated over the sequence's length.
        """
        table = self._table(seq)
        num_logical = _cdiv(seq.num_tokens, self.block_size)
        # A table short of its ring has not wrapped (its newest token may still lack its block).
        if self.ring_blocks is None or len(table) < self.ring_blocks or num_logical <= len(table):
            return table
        return [table[i % self.ring_blocks] for i in range(num_logical)]

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
        plans, num_cow_blocks = self._admission_plans(group)
        needed = sum(plan.num_blocks for plan in plans) + num_cow_blocks
        if needed > self.num_gpu_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        cost = self._admission_cost(plans) + num_cow_blocks
        if self.gpu_allocator.num_free_blocks - cost < self.watermark_blocks:
            return AllocStatus.LATER
        return AllocStatus.OK

    def allocate(self, group: SequenceGroup) -> None:
        """Allocate block tables for the group's WAITING sequences.

        A group that forks on admission gets a table for its parent (the
        first WAITING sequence) only; the others stay without one until
        fork(). Any other group gets a table for each WAITING sequence, none
        shared (except blocks hit in the prefix cache).

        With prefix caching each table starts with the cached blocks of the
        longest matching prefix (never the block holding the last token, so
        every sequence computes at least one token into a block of its own)
        and the sequence's num_computed_tokens is set to the tokens they hold.
        """
        plans, _ = self._admission_plans(group)
        for plan in plans:
            if plan.seq.seq_id in self.block_tables:
                raise ValueError(f"seq {plan.seq.seq_id} already has a block table.")
        cost = self._admission_cost(plans)
        # Check up front so a failure never leaves half a table allocated.
        if cost > self.gpu_allocator.num_free_blocks:
            raise NoFreeBlocksError(
                f"request {group.request_id!r} needs {cost} blocks, "
                f"{self.gpu_allocator.num_free_blocks} free."
            )
        if self._cache is not None:
            self._cache.tick()
            # Hits first, every table's: allocating fresh blocks may evict, and
            # must not evict a block one of these tables is about to reuse.
            for plan in plans:
                for block_id in plan.hits:
                    self._cache.acquire(block_id)
        for plan in plans:
            table = list(plan.hits)
            table.extend(self.gpu_allocator.allocate() for _ in range(plan.num_blocks - len(plan.hits)))
            self.block_tables[plan.seq.seq_id] = table
            if self._cache is not None:
                self.prefix_cache_stats.queries += self._max_hit_blocks(plan.seq)
                self.prefix_cache_stats.hits += len(plan.hits)
                # The truth for a fresh table: only the reused blocks hold KV.
                plan.seq.num_computed_tokens = len(plan.hits) * self.block_size
                self._block_hashes[plan.seq.seq_id] = list(plan.hashes)

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
        hashes = self._block_hashes.get(parent.seq_id)
        if hashes is not None:
            self._block_hashes[child.seq_id] = list(hashes)
        child.num_computed_tokens = num_computed

    # -- growth ------------------------------------------------------------

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
            block_id = table[self._slot_block_index(seq.num_tokens)]
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
        index = self._slot_block_index(seq.num_tokens)
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

    # -- swapping ------------------------------------------------------------

    def can_swap_out(self, group: SequenceGroup) -> bool:
        """Whether the CPU pool has a block for each distinct device block of the group's RUNNING sequences."""
        needed = len(self._distinct(self.block_tables, group.get_seqs(SequenceStatus.RUNNING)))
        return needed <= self.num_free_cpu_blocks

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's RUNNING sequences to CPU blocks; returns (device, cpu) pairs.

        Each distinct device block gets one CPU block whose ref count is the
        number of the group's tables holding it; the group's references to
        the device block are dropped (blocks other tables also hold, e.g.
        prefix-cache hits of other groups, stay theirs: they are copied).
        Sequence statuses are left to the caller.
        """
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        counts = self._distinct(self.block_tables, seqs)
        if len(counts) > self.num_free_cpu_blocks:
            raise NoFreeBlocksError(
                f"request {group.request_id!r} needs {len(counts)} CPU blocks, {self.num_free_cpu_blocks} free."
            )
        mapping = self._move(counts, self._cpu())
        self._tick()
        for seq in seqs:
            table = self.block_tables.pop(seq.seq_id)
            self._block_hashes.pop(seq.seq_id, None)
            self.cpu_block_tables[seq.seq_id] = [mapping[b] for b in table]
            for block_id in table:
                self.gpu_allocator.free(block_id)
        return list(mapping.items())

    def can_swap_in(self, group: SequenceGroup) -> AllocStatus:
        """Whether the group's SWAPPED sequences fit back on the device.

        Counts a device block per distinct CPU block plus one per sequence for
        its next token's slot (a new block or a copy-on-write), and keeps the
        watermark free like admission. NEVER when that exceeds what an empty
        cache offers.
        """
        seqs = group.get_seqs(SequenceStatus.SWAPPED)
        needed = len(self._distinct(self.cpu_block_tables, seqs)) + len(seqs)
        if needed > self.num_gpu_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        if self.gpu_allocator.num_free_blocks - needed < self.watermark_blocks:
            return AllocStatus.LATER
        return AllocStatus.OK

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's SWAPPED sequences back to fresh device blocks; returns (cpu, device) pairs.

        Frees the CPU blocks. The device blocks are unhashed (never reused by
        the prefix cache). Sequence statuses are left to the caller.
        """
        seqs = group.get_seqs(SequenceStatus.SWAPPED)
        counts = self._distinct(self.cpu_block_tables, seqs)
        if len(counts) > self.gpu_allocator.num_free_blocks:
            raise NoFreeBlocksError(
                f"request {group.request_id!r} needs {len(counts)} blocks, "
                f"{self.gpu_allocator.num_free_blocks} free."
            )
        self._tick()
        mapping = self._move(counts, self.gpu_allocator)
        cpu = self._cpu()
        for seq in seqs:
            table = self.cpu_block_tables.pop(seq.seq_id)
            self.block_tables[seq.seq_id] = [mapping[b] for b in table]
            for block_id in table:
                cpu.free(block_id)
        return list(mapping.items())

    def get_cpu_block_table(self, seq: Sequence) -> list[int]:
        """A copy of a swapped-out sequence's CPU block ids, in token order."""
        table = self.cpu_block_tables.get(seq.seq_id)
        if table is None:
            raise ValueError(f"seq {seq.seq_id} is not swapped out.")
        return list(table)

    @property
    def num_free_cpu_blocks(self) -> int:
        """CPU blocks not referenced by any swapped-out table."""
        return 0 if self.cpu_allocator is None else self.cpu_allocator.num_free_blocks

    def get_num_used_cpu_blocks(self) -> int:
        """CPU blocks referenced by at least one swapped-out table."""
        return self.num_cpu_blocks - self.num_free_cpu_blocks

    @staticmethod
    def _distinct(tables: dict[int, list[int]], seqs: list[Sequence]) -> dict[int, int]:
        """Distinct blocks of the sequences' tables (first-appearance order) -> how many of them hold it."""
        counts: dict[int, int] = {}
        for seq in seqs:
            table = tables.get(seq.seq_id)
            if table is None:
                raise ValueError(f"seq {seq.seq_id} has no block table here.")
            for block_id in table:
                counts[block_id] = counts.get(block_id, 0) + 1
        return counts

    @staticmethod
    def _move(counts: dict[int, int], dst: BlockAllocator) -> dict[int, int]:
        """A block of dst per source block, ref counted like the source's holders."""
        mapping: dict[int, int] = {}
        for block_id, count in counts.items():
            new = dst.allocate()
            for _ in range(count - 1):
                dst.incref(new)
            mapping[block_id] = new
        return mapping

    def _cpu(self) -> BlockAllocator:
        if self.cpu_allocator is None:
            raise NoFreeBlocksError("no CPU swap space (num_cpu_blocks is 0).")
        return self.cpu_allocator

    # -- release and queries -------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks (ref counted) and drop its table.

        A no-op for sequences without a table, so aborting a waiting or
        already-freed sequence is safe. With prefix caching, hashed blocks
        that lose their last owner go to the evictor instead of the free list.
        A swapped-out sequence releases its CPU blocks.
        """
        cpu_table = self.cpu_block_tables.pop(seq.seq_id, None)
        if cpu_table is not None:
            cpu = self._cpu()
            for block_id in cpu_table:
                cpu.free(block_id)
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

    def _admission_plans(self, group: SequenceGroup) -> tuple[list[_TablePlan], int]:
        """The tables allocate() would create, and the copy-on-write blocks the fork will need."""
        waiting = group.get_seqs(SequenceStatus.WAITING)
        if not waiting:
            raise ValueError(f"request {group.request_id!r} has no WAITING sequence.")
        if group.forks_on_admission():
            # forks_on_admission: every unfinished sequence is WAITING here.
            seqs, num_cow_blocks = waiting[:1], len(waiting) - 1
        else:
            seqs, num_cow_blocks = waiting, 0
        plans = []
        for seq in seqs:
            hashes, hits = self._match_prefix(seq)
            plans.append(_TablePlan(seq, self.num_blocks_for_tokens(seq.num_tokens), hashes, hits))
        return plans, num_cow_blocks

    def _admission_cost(self, plans: list[_TablePlan]) -> int:
        """Free blocks the tables take: fresh ones, plus hits revived from the evictor (once each)."""
        fresh = sum(plan.num_blocks - len(plan.hits) for plan in plans)
        revived = {block_id for plan in plans for block_id in plan.hits}
        return fresh + sum(1 for block_id in revived if self.gpu_allocator.get_ref_count(block_id) == 0)

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

    def _num_new_blocks_for_append(self, seq: Sequence) -> int:
        table = self._table(seq)
        missing = self.num_blocks_for_tokens(seq.num_tokens) - len(table)
        if missing > 0:
            return missing
        index = self._slot_block_index(seq.num_tokens)
        return 1 if self.gpu_allocator.get_ref_count(table[index]) > 1 else 0
