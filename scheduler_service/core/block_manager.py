"""Maps sequences to physical KV blocks: one BlockManager over a BlockPool (and a CPU pool for swapping).

The manager owns every sequence's block table: admission (with prefix-cache
hits), fork, growth with copy-on-write, registration of computed blocks in
the prefix cache, release, and what the worker learns of each table per step
(take_table_update). The pool (block_pool.py) owns ids, reference counts, the
hash map and the LRU evictor; swapping between the pools is block_swapper.py.

Sliding window (ring_blocks set): a model whose every layer attends to the
last `window` tokens only never reads older keys, so a table holds at most
ring_blocks blocks and logical block i lives in table[i % ring_blocks]; the
worker addresses the logical view (logical_block_table). The caller sizes the
ring so that no step overwrites a key that the step still reads.

    block_size = 2, ring_blocks = 3, 9 tokens:

    logical block   0     1     2     3     4
    tokens         0 1 | 2 3 | 4 5 | 6 7 | 8
    table entry     0     1     2     0     1     (table has 3 entries)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from scheduler_service.core.block_pool import AllocStatus, BlockPool, CachedBlockEntry, NoFreeBlocksError, alloc_status
from scheduler_service.core.block_swapper import BlockSwapper
from scheduler_service.core.config import CacheConfig
from scheduler_service.core.prefix_hash import ROOT_BLOCK_HASH, BlockHash, hash_block_tokens, hash_full_blocks
from scheduler_service.core.scheduler_output import TableUpdate
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus

__all__ = ["AdmissionPlan", "AllocStatus", "BlockManager", "NoFreeBlocksError", "PrefixCacheStats"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache lookups in blocks, counted at admission.

    queries: full blocks that could have been reused (every full block of an admitted sequence except the one
        holding its last token). hits: blocks actually reused; the lookup stops at the first miss.
    """

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / queries, 0.0 before any query."""
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class TablePlan:
    """One block table allocate() would create: its size and its prefix-cache hits."""

    seq: Sequence
    num_blocks: int
    hashes: list[BlockHash]
    hits: list[int]


@dataclass
class AdmissionPlan:
    """What admitting a group now would take: its tables, the fork's copy-on-write blocks, the verdict.

    Valid until the block manager changes: the scheduler plans a group, decides, and allocates from the same
    plan within one schedule() (so the prompt's prefix is matched and hashed once).
    """

    group: SequenceGroup
    tables: list[TablePlan]
    num_cow_blocks: int
    status: AllocStatus

    def num_cached_tokens(self, seq: Sequence, block_size: int) -> int:
        """Leading tokens of seq's table that come from the prefix cache (0 for a seq without a table)."""
        return next((len(t.hits) * block_size for t in self.tables if t.seq is seq), 0)

    def cost(self, pool: BlockPool) -> int:
        """Free blocks the tables take: fresh ones, plus hits revived from the evictor (once each)."""
        fresh = sum(t.num_blocks - len(t.hits) for t in self.tables)
        revived = {block_id for t in self.tables for block_id in t.hits}
        return fresh + sum(1 for block_id in revived if pool.get_ref_count(block_id) == 0)


class BlockManager:
    """Owns the block tables of all sequences that hold KV cache.

    block_tables[seq_id][i] is the physical block holding tokens [i * block_size, (i + 1) * block_size)
    (modulo the ring). Tables share blocks, reference counted (fork, prefix-cache hits); a write into a shared
    block is copied first (append_slot). Unreferenced cached blocks count as free (evicted on demand). The
    pool's logical clock ticks once per operation.
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
        # CacheConfig carries the validation rules; reuse them.
        config = CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks, watermark=watermark,
                             enable_prefix_caching=enable_prefix_caching, num_cpu_blocks=num_cpu_blocks)
        self.block_size = config.block_size
        self.ring_blocks = ring_blocks
        self.enable_prefix_caching = config.enable_prefix_caching
        self.prefix_cache_stats = PrefixCacheStats()
        self.block_pool = BlockPool(config.num_gpu_blocks, enable_caching=config.enable_prefix_caching)
        # Blocks that admission and swap-in leave free, so running sequences can still decode.
        self.watermark_blocks = config.watermark_blocks
        self.block_tables: dict[int, list[int]] = {}
        # seq_id -> chained hashes of the leading blocks of its table already considered for registration, so
        # each step hashes only new blocks. Only sequences allocated with caching on have one; a sequence that
        # lost its chain (swap-out, reset) never registers blocks again.
        self._block_hashes: dict[int, list[BlockHash]] = {}
        # What the worker learns per table (take_table_update): the logical entries it holds once the updates
        # taken so far arrive, and the changes since. A table without an entry is one the worker has never seen
        # (its next update sends it in full).
        self._num_held: dict[int, int] = {}
        self._changes: dict[int, TableUpdate] = {}
        # Sequences whose table left the device since take_released(): the worker may forget them.
        self._released: list[int] = []
        self.swapper = BlockSwapper(config.num_cpu_blocks, self)

    @classmethod
    def from_config(cls, config: CacheConfig, ring_blocks: int | None = None) -> BlockManager:
        """Build from a validated CacheConfig."""
        return cls(config.block_size, config.num_gpu_blocks, config.watermark, config.enable_prefix_caching,
                   config.num_cpu_blocks, ring_blocks)

    # -- queries ---------------------------------------------------------------

    @property
    def num_gpu_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_gpu_blocks(self) -> int:
        """Blocks not referenced by any table (evictable cached blocks included)."""
        return self.block_pool.num_free_blocks

    def get_num_used_blocks(self) -> int:
        """Blocks referenced by at least one table."""
        return self.num_gpu_blocks - self.block_pool.num_free_blocks

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a table needs to hold num_tokens tokens (at most ring_blocks with a sliding window)."""
        blocks = cdiv(num_tokens, self.block_size)
        return blocks if self.ring_blocks is None else min(blocks, self.ring_blocks)

    def logical_block_table(self, seq: Sequence) -> list[int]:
        """Physical block of each of seq's logical blocks, in token order (what the worker addresses).

        The table itself without a sliding window (not a copy: read it, never keep it); with one, ring entries
        repeated over the sequence's length.
        """
        table = self._table(seq)
        num_logical = self._num_logical(table, seq.num_tokens)
        return table if num_logical == len(table) else [table[i % len(table)] for i in range(num_logical)]

    def has_block_table(self, seq: Sequence) -> bool:
        return seq.seq_id in self.block_tables

    def get_block_table(self, seq: Sequence) -> list[int]:
        """A copy of the sequence's physical block ids, in token order."""
        return list(self._table(seq))

    # -- admission -------------------------------------------------------------

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        """Whether the group's WAITING sequences fit in the cache, the watermark kept free (see plan_admission)."""
        return self.plan_admission(group).status

    def plan_admission(self, group: SequenceGroup) -> AdmissionPlan:
        """The tables allocate() would create for the group now, and whether they fit.

        A group that forks on admission (SequenceGroup.forks_on_admission) counts the parent's table plus one
        block per other sequence, for the copy-on-write of the shared last block at its first decode after the
        fork (the parent, appending last, writes in place): counting them now keeps admission from promising
        them to others. Any other group: one table per WAITING sequence, sized for all its tokens (a recomputed
        one re-prefills prompt + outputs). Prefix-cache hits on blocks another table uses cost nothing; hits
        revived from the evictor a free block each, once however many tables take them. NEVER ignores hits:
        they may be evicted later.
        """
        waiting = group.get_seqs(SequenceStatus.WAITING)
        if not waiting:
            raise ValueError(f"request {group.request_id!r} has no WAITING sequence.")
        # forks_on_admission: every unfinished sequence is WAITING here; only the parent gets a table.
        seqs, num_cow = (waiting[:1], len(waiting) - 1) if group.forks_on_admission() else (waiting, 0)
        tables = [TablePlan(seq, self.num_blocks_for_tokens(seq.num_tokens), *self._match_prefix(seq))
                  for seq in seqs]
        plan = AdmissionPlan(group, tables, num_cow, AllocStatus.OK)
        needed = sum(t.num_blocks for t in tables) + num_cow
        plan.status = alloc_status(needed, plan.cost(self.block_pool) + num_cow, self.num_gpu_blocks,
                                   self.block_pool.num_free_blocks, self.watermark_blocks)
        return plan

    def allocate(self, group: SequenceGroup, plan: AdmissionPlan | None = None) -> None:
        """Allocate block tables for the group's WAITING sequences.

        plan: the group's plan_admission() result, when the caller made one since the last change to the block
        manager (it is not recomputed). A group that forks on admission gets a table for its parent only; the
        others stay without one until fork(). With prefix caching each table starts with the cached blocks of
        the longest matching prefix (see _max_hit_blocks) and num_computed_tokens is set to the tokens they hold.
        """
        pool = self.block_pool
        if plan is None:
            plan = self.plan_admission(group)
        elif plan.group is not group:
            raise ValueError(f"the admission plan is for request {plan.group.request_id!r}, not {group.request_id!r}.")
        elif not all(pool.lookup(h) == b for t in plan.tables for h, b in zip(t.hashes, t.hits)):
            # Made before an eviction: a hit may now hold other tokens' KV.
            raise ValueError(f"the admission plan of request {group.request_id!r} is stale: replan it.")
        for t in plan.tables:
            if t.seq.seq_id in self.block_tables:
                raise ValueError(f"seq {t.seq.seq_id} already has a block table.")
        cost = plan.cost(pool)
        # Check up front so a failure never leaves half a table allocated.
        if cost > pool.num_free_blocks:
            raise NoFreeBlocksError(f"request {group.request_id!r} needs {cost} blocks, {pool.num_free_blocks} free.")
        if self.enable_prefix_caching:
            pool.tick()
            # Hits first, every table's: allocating fresh blocks may evict, and must not evict a block one of
            # these tables is about to reuse.
            for t in plan.tables:
                for block_id in t.hits:
                    pool.acquire(block_id)
        for t in plan.tables:
            seq = t.seq
            self.put_table(seq, t.hits + [pool.allocate() for _ in range(t.num_blocks - len(t.hits))])
            if self.enable_prefix_caching:
                self.prefix_cache_stats.queries += self._max_hit_blocks(seq)
                self.prefix_cache_stats.hits += len(t.hits)
                # The truth for a fresh table: only the reused blocks hold KV.
                seq.num_computed_tokens = len(t.hits) * self.block_size
                self._block_hashes[seq.seq_id] = list(t.hashes)

    # -- fork and growth -------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give child a copy of parent's block table, sharing every block (reference counts go up by one).

        A later write into a shared block copies it first (append_slot). The child's num_computed_tokens becomes
        the parent's, so the child must hold the parent's computed tokens; it takes over the parent's hash chain.
        Needs no free block.
        """
        table = self._table(parent)
        num_computed = parent.num_computed_tokens
        if child.num_tokens < num_computed or child.all_token_ids[:num_computed] != parent.all_token_ids[:num_computed]:
            raise ValueError(f"seq {child.seq_id} does not hold the {num_computed} tokens computed for seq "
                             f"{parent.seq_id}; it cannot share their KV.")
        self.put_table(child, list(table))  # first: it refuses a child that has a table before any incref
        for block_id in table:
            self.block_pool.incref(block_id)
        hashes = self._block_hashes.get(parent.seq_id)
        if hashes is not None:
            self._block_hashes[child.seq_id] = list(hashes)
        child.num_computed_tokens = num_computed

    def can_append_slot(self, group: SequenceGroup) -> bool:
        """Whether every RUNNING sequence of the group can get its next slot.

        Counts one block per sequence that grows past its table, and the copies-on-write of shared last blocks:
        k sequences of the group writing into one block make k copies, or k - 1 when no table outside the group
        holds it (the last of them to append writes in place).
        """
        needed = 0
        sharers: Counter[int] | None = None  # built only for a shared last block (rare: Counter() is slow)
        pool = self.block_pool
        for seq in group.seqs:
            if seq.status is not SequenceStatus.RUNNING:
                continue
            table = self._table(seq)
            num_tokens = seq.num_tokens
            missing = self.num_blocks_for_tokens(num_tokens) - len(table)
            if missing > 0:
                needed += missing
            elif pool.get_ref_count(block_id := table[self._slot_index(num_tokens)]) > 1:
                if sharers is None:
                    sharers = Counter()
                sharers[block_id] += 1
        for block_id, count in (sharers or {}).items():
            needed += count - 1 if pool.get_ref_count(block_id) == count else count
        return needed <= pool.num_free_blocks

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """Make the table cover seq.num_tokens tokens before they are computed.

        Allocates blocks when the table is too short (the slot lands in a fresh, unshared block). When the
        slot's block is shared it is copied on write: a new block replaces it in this table and (src, dst) is
        returned so the worker copies the KV before the step; else None.
        """
        table = self._table(seq)
        pool = self.block_pool
        num_tokens = seq.num_tokens
        num_blocks = self.num_blocks_for_tokens(num_tokens)
        grows = len(table) < num_blocks
        index = self._slot_index(num_tokens)
        needed = num_blocks - len(table) if grows else int(pool.get_ref_count(table[index]) > 1)
        pool.tick()
        if needed and needed > pool.num_free_blocks:
            raise NoFreeBlocksError(f"seq {seq.seq_id} needs {needed} blocks, {pool.num_free_blocks} free.")
        cow = None
        if grows:
            table.extend(pool.allocate() for _ in range(needed))
        elif needed:
            cow = (table[index], pool.allocate())
            table[index] = cow[1]
            pool.free(cow[0])
        self._record_growth(seq, table, num_tokens, replaced=cow is not None)
        return cow

    # -- the prefix cache ------------------------------------------------------

    def mark_computed(self, seq: Sequence) -> None:
        """Register the sequence's newly full and computed blocks in the prefix cache.

        Call after seq.num_computed_tokens advanced (the step wrote their KV); registering earlier would let
        another sequence hit a block whose KV is not written yet. A block whose hash already names another
        block stays unhashed (the first copy is the cached one). A no-op without prefix caching, for a sequence
        without a table or one that lost its chain.
        """
        hashes = self._block_hashes.get(seq.seq_id)
        table = self.block_tables.get(seq.seq_id)
        if hashes is None or table is None:
            return
        # Blocks of known tokens only: with several tokens in flight (multi-step scheduling) the computed ones
        # run past the known ones, and a block holding one not known yet is registered once it has landed.
        num_known = len(seq.prompt_token_ids) + len(seq.output_token_ids)
        num_full = min(min(seq.num_computed_tokens, num_known) // self.block_size, len(table))
        if num_full <= len(hashes):
            return
        self.block_pool.tick()
        first, size = len(hashes), self.block_size
        new = hash_full_blocks(seq.all_token_ids[first * size : num_full * size], size, num_full - first,
                               hashes[-1] if hashes else ROOT_BLOCK_HASH)
        for index, block_hash in enumerate(new, start=first):
            self.block_pool.register(table[index], block_hash, (index + 1) * size)
        hashes.extend(new)

    def get_num_cached_tokens(self, seq: Sequence) -> int:
        """Leading tokens of seq that allocate() would take from the prefix cache now (a pure query)."""
        return len(self._match_prefix(seq)[1]) * self.block_size

    def reset_prefix_cache(self) -> None:
        """Forget every cached block, e.g. after the worker lost its KV cache.

        Evictable blocks become plain free blocks. Sequences holding blocks keep them but never register them
        (or later ones) again: their KV may be as untrustworthy as the cache's.
        """
        self.block_pool.reset_cache()
        self._block_hashes.clear()

    def chain_length(self, seq_id: int) -> int | None:
        """Blocks of seq's table considered for registration so far; None when it registers none."""
        hashes = self._block_hashes.get(seq_id)
        return None if hashes is None else len(hashes)

    def _max_hit_blocks(self, seq: Sequence) -> int:
        # The block holding the last token is never reused: the sequence must compute at least that token (its
        # logits are sampled) and write it into a block of its own, never into a shared cached block.
        return (seq.num_tokens - 1) // self.block_size

    def _match_prefix(self, seq: Sequence) -> tuple[list[BlockHash], list[int]]:
        """Chained hashes and cached block ids of seq's longest cached prefix (changes no statistics or LRU order)."""
        if not self.enable_prefix_caching:
            return [], []
        token_ids = seq.all_token_ids
        parent = ROOT_BLOCK_HASH
        hashes: list[BlockHash] = []
        hits: list[int] = []
        for index in range(self._max_hit_blocks(seq)):
            start = index * self.block_size
            parent = hash_block_tokens(parent, token_ids[start : start + self.block_size])
            block_id = self.block_pool.lookup(parent)
            if block_id is None:
                break
            hashes.append(parent)
            hits.append(block_id)
        return hashes, hits

    # -- release ---------------------------------------------------------------

    def finish_group(self, group: SequenceGroup, status: SequenceStatus) -> None:
        """End every unfinished sequence of the group with status (a FINISHED_* one) and free its blocks."""
        for seq in group.unfinished_seqs():
            seq.status = status
            self.free(seq)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks (ref counted) and drop its table; a swapped-out one its CPU blocks.

        A no-op for sequences without a table, so aborting a waiting or already-freed sequence is safe. Hashed
        blocks that lose their last owner go to the evictor instead of the free list; one tick for the whole
        table, so its blocks tie in LRU order and the evictor takes the deepest first.
        """
        self.swapper.free(seq)
        if seq.seq_id in self.block_tables:  # a hash chain exists only beside a table
            table = self.take_table(seq.seq_id)
            self.block_pool.tick()
            for block_id in table:
                self.block_pool.free(block_id)

    def take_table(self, seq_id: int) -> list[int]:
        """Remove a sequence's table, its blocks still referenced (KeyError when it has none).

        Its hash chain goes too: the blocks are leaving the device (swap-out), never to be registered again.
        """
        table = self.block_tables.pop(seq_id)
        self._block_hashes.pop(seq_id, None)
        self._num_held.pop(seq_id, None)
        self._changes.pop(seq_id, None)
        self._released.append(seq_id)
        return table

    def take_released(self) -> list[int]:
        """Sequences whose device table was freed or taken (swap-out) since the last call, in that order."""
        released, self._released = self._released, []
        return released

    def put_table(self, seq: Sequence, table: list[int]) -> None:
        """Install a table whose blocks the caller already referenced (admission, fork, swap-in).

        The worker has never seen it: the next update sends it in full.
        """
        if seq.seq_id in self.block_tables:
            raise ValueError(f"seq {seq.seq_id} already has a block table.")
        self.block_tables[seq.seq_id] = table

    # -- what the worker learns ------------------------------------------------

    def take_table_update(self, seq: Sequence) -> TableUpdate:
        """What the worker learns of seq's table this step: all of it for a table it has never seen, else the
        logical entries appended and the copy-on-write replacements since the last update."""
        num_held = self._num_held.get(seq.seq_id)
        if num_held is None:
            self.mark_held(seq)
            return TableUpdate(list(self.logical_block_table(seq)), in_full=True)
        return self._changes.pop(seq.seq_id, None) or TableUpdate([], start=num_held)

    def mark_held(self, seq: Sequence) -> None:
        """The worker holds seq's logical table as it is now (resumed for a new owner, or restored)."""
        self._changes.pop(seq.seq_id, None)
        self._num_held[seq.seq_id] = len(self.logical_block_table(seq))

    def _record_growth(self, seq: Sequence, table: list[int], num_tokens: int, replaced: bool) -> None:
        """Note what append_slot changed in the logical view: entries appended, the slot's block replaced."""
        seq_id = seq.seq_id
        before = self._num_held.get(seq_id)
        after = self._num_logical(table, num_tokens)
        if before is None or (after == before and not replaced):  # a fresh table, or nothing new (most decodes)
            return
        self._num_held[seq_id] = after
        change = self._changes.get(seq_id)
        if change is None:
            change = self._changes[seq_id] = TableUpdate([], start=before)
        ring = self.ring_blocks or len(table)
        change.block_ids.extend(table[i % ring] for i in range(before, after))
        if replaced:
            slot = (num_tokens - 1) // self.block_size
            block_id = table[self._slot_index(num_tokens)]
            if slot < change.start:
                change.replaced[slot] = block_id
            else:
                change.block_ids[slot - change.start] = block_id

    # -- snapshots -------------------------------------------------------------

    def restore(self, tables: list[tuple[Sequence, list[int]]], cpu_tables: dict[int, list[int]],
                cached: tuple[CachedBlockEntry, ...], clock: int, chains: list[tuple[Sequence, int]]) -> None:
        """Puts an empty manager into a snapshot's state: the tables (the worker taken to hold them as they are),
        the swapped-out ones, the prefix cache and each (sequence, length) hash chain."""
        for seq, table in tables:
            self._check_ids(seq.seq_id, table, self.num_gpu_blocks, "device")
            self.block_tables[seq.seq_id] = list(table)
            self.mark_held(seq)
        self.block_pool.restore(dict(Counter(b for _, t in tables for b in t)), cached, clock)
        for seq_id, table in cpu_tables.items():
            self._check_ids(seq_id, table, self.num_cpu_blocks, "CPU")
        self.swapper.restore(cpu_tables)
        for seq, length in chains:
            table = self.block_tables.get(seq.seq_id)
            if not self.enable_prefix_caching or table is None or length > len(table):
                raise ValueError(f"seq {seq.seq_id}: a prefix-hash chain of {length} blocks does not fit its table.")
            self._block_hashes[seq.seq_id] = hash_full_blocks(seq.all_token_ids, self.block_size, length)

    @staticmethod
    def _check_ids(seq_id: int, table: list[int], num_blocks: int, where: str) -> None:
        bad = [b for b in table if not 0 <= b < num_blocks]
        if bad:
            raise ValueError(f"seq {seq_id}: {where} block ids {bad} are outside [0, {num_blocks}).")

    # -- swapping (block_swapper.py has the details) ---------------------------

    def can_swap_out(self, group: SequenceGroup) -> bool:
        """Whether the CPU pool can take the group's RUNNING sequences."""
        return self.swapper.can_swap_out(group)

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's RUNNING sequences to CPU blocks; returns (device, cpu) pairs."""
        return self.swapper.swap_out(group)

    def can_swap_in(self, group: SequenceGroup) -> AllocStatus:
        """Whether the group's SWAPPED sequences fit back on the device (watermark kept)."""
        return self.swapper.can_swap_in(group)

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's SWAPPED sequences back to fresh device blocks; returns (cpu, device) pairs."""
        return self.swapper.swap_in(group)

    @property
    def num_cpu_blocks(self) -> int:
        """Blocks in the CPU swap pool (0: every preemption recomputes)."""
        return self.swapper.num_cpu_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.swapper.num_free_cpu_blocks

    # -- helpers ---------------------------------------------------------------

    def _table(self, seq: Sequence) -> list[int]:
        table = self.block_tables.get(seq.seq_id)
        if table is None:
            raise ValueError(f"seq {seq.seq_id} has no block table.")
        return table

    def _slot_index(self, num_tokens: int) -> int:
        """Table index of the block holding token num_tokens - 1."""
        index = (num_tokens - 1) // self.block_size
        return index if self.ring_blocks is None else index % self.ring_blocks

    def _num_logical(self, table: list[int], num_tokens: int) -> int:
        """Entries of the logical view: the table's own, or one per block of the sequence once a ring wrapped."""
        # A table short of its ring has not wrapped (its newest token may still lack its block).
        if self.ring_blocks is None or len(table) < self.ring_blocks:
            return len(table)
        return max(cdiv(num_tokens, self.block_size), len(table))
