"""Admission planning: the block tables a waiting group would get, what they cost, and the verdict."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from scheduler_service.core.block_allocator import BlockAllocator
from scheduler_service.core.block_table_layout import BlockTableLayout
from scheduler_service.core.prefix_cache_tracker import PrefixCacheTracker
from scheduler_service.core.prefix_hash import BlockHash
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus


class AllocStatus(enum.Enum):
    """Whether a waiting group's blocks can be allocated."""

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


@dataclass
class TablePlan:
    """One block table allocate() would create: its size and its prefix-cache hits."""

    seq: Sequence
    num_blocks: int
    hashes: list[BlockHash]
    hits: list[int]


def plan_tables(
    group: SequenceGroup, layout: BlockTableLayout, prefix: PrefixCacheTracker | None
) -> tuple[list[TablePlan], int]:
    """The tables allocate() would create, and the copy-on-write blocks the fork will need.

    A group that forks on admission gets one table, its parent's (the first
    WAITING sequence), plus one block per other sequence for its first
    copy-on-write; any other group a table per WAITING sequence.
    """
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
        hashes, hits = prefix.match_prefix(seq) if prefix is not None else ([], [])
        plans.append(TablePlan(seq, layout.num_blocks_for_tokens(seq.num_tokens), hashes, hits))
    return plans, num_cow_blocks


@dataclass
class AdmissionPlan:
    """What admitting a group now would take: its tables, the fork's copy-on-write blocks, the verdict.

    Valid until the block manager changes: the scheduler plans a group, decides, and allocates from
    the same plan within one schedule() (so the prompt's prefix is matched and hashed once).
    """

    group: SequenceGroup
    tables: list[TablePlan]
    num_cow_blocks: int
    status: AllocStatus

    def num_cached_tokens(self, seq: Sequence, block_size: int) -> int:
        """Leading tokens of seq's table that come from the prefix cache (0 for a seq without a table)."""
        for table in self.tables:
            if table.seq is seq:
                return len(table.hits) * block_size
        return 0


def admission_cost(plans: list[TablePlan], allocator: BlockAllocator) -> int:
    """Free blocks the tables take: fresh ones, plus hits revived from the evictor (once each)."""
    fresh = sum(plan.num_blocks - len(plan.hits) for plan in plans)
    revived = {block_id for plan in plans for block_id in plan.hits}
    return fresh + sum(1 for block_id in revived if allocator.get_ref_count(block_id) == 0)
