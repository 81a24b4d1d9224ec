"""Swap preemption: moving groups' block tables between the device pool and a CPU pool."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from scheduler_service.core.block_pool import AllocStatus, BlockPool, NoFreeBlocksError, alloc_status
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from scheduler_service.core.block_manager import BlockManager


class BlockSwapper:
    """The CPU block pool and the tables of swapped-out sequences.

    swap_out() moves a group's running sequences to CPU blocks (a plain ref-counted pool without prefix
    caching), swap_in() moves them back into fresh device blocks of the block manager that owns this swapper.
    Swapped-in blocks are never registered in the prefix cache again (the sequences lose their hash chains on
    swap-out). Swapping in keeps the device's watermark free, like admission.
    """

    def __init__(self, num_cpu_blocks: int, device: BlockManager) -> None:
        self.cpu_pool: BlockPool | None = BlockPool(num_cpu_blocks) if num_cpu_blocks else None
        # seq_id -> CPU block ids of a swapped-out sequence, in token order.
        self.cpu_tables: dict[int, list[int]] = {}
        self._device = device

    @property
    def num_cpu_blocks(self) -> int:
        """Blocks in the CPU pool (0: no swap space, every preemption recomputes)."""
        return 0 if self.cpu_pool is None else self.cpu_pool.num_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        """CPU blocks not referenced by any swapped-out table."""
        return 0 if self.cpu_pool is None else self.cpu_pool.num_free_blocks

    def can_swap_out(self, group: SequenceGroup) -> bool:
        """Whether the CPU pool has a block for each distinct device block of the group's RUNNING sequences."""
        needed = len(_distinct(self._device.block_tables, group.get_seqs(SequenceStatus.RUNNING)))
        return needed <= self.num_free_cpu_blocks

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's RUNNING sequences to CPU blocks; returns (device, cpu) pairs.

        Each distinct device block gets one CPU block whose ref count is the number of the group's tables holding
        it; the group's references to the device block are dropped (blocks other tables also hold, e.g.
        prefix-cache hits of other groups, stay theirs: they are copied). Statuses are left to the caller.
        """
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        counts = _distinct(self._device.block_tables, seqs)
        if len(counts) > self.num_free_cpu_blocks:
            raise NoFreeBlocksError(
                f"request {group.request_id!r} needs {len(counts)} CPU blocks, {self.num_free_cpu_blocks} free."
            )
        mapping = _move(counts, self._cpu())
        pool = self._device.block_pool
        pool.tick()
        for seq in seqs:
            table = self._device.take_table(seq.seq_id)
            self.cpu_tables[seq.seq_id] = [mapping[b] for b in table]
            for block_id in table:
                pool.free(block_id)
        return list(mapping.items())

    def can_swap_in(self, group: SequenceGroup) -> AllocStatus:
        """Whether the group's SWAPPED sequences fit back on the device.

        Counts a device block per distinct CPU block plus one per sequence for its next token's slot (a new
        block or a copy-on-write), and keeps the watermark free like admission. NEVER when that exceeds what an
        empty cache offers.
        """
        seqs = group.get_seqs(SequenceStatus.SWAPPED)
        needed = len(_distinct(self.cpu_tables, seqs)) + len(seqs)
        device = self._device
        return alloc_status(needed, needed, device.num_gpu_blocks, device.num_free_gpu_blocks, device.watermark_blocks)

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's SWAPPED sequences back to fresh device blocks, freeing their CPU blocks; returns
        (cpu, device) pairs. Statuses are left to the caller."""
        seqs = group.get_seqs(SequenceStatus.SWAPPED)
        counts = _distinct(self.cpu_tables, seqs)
        pool = self._device.block_pool
        if len(counts) > pool.num_free_blocks:
            raise NoFreeBlocksError(
                f"request {group.request_id!r} needs {len(counts)} blocks, {pool.num_free_blocks} free."
            )
        pool.tick()
        mapping = _move(counts, pool)
        cpu = self._cpu()
        for seq in seqs:
            table = self.cpu_tables.pop(seq.seq_id)
            self._device.put_table(seq, [mapping[b] for b in table])
            for block_id in table:
                cpu.free(block_id)
        return list(mapping.items())

    def free(self, seq: Sequence) -> None:
        """Release a swapped-out sequence's CPU blocks; a no-op for any other sequence."""
        for block_id in self.cpu_tables.pop(seq.seq_id, ()):
            self._cpu().free(block_id)

    def restore(self, cpu_tables: dict[int, list[int]]) -> None:
        """Start over with these swapped-out tables (their ids already checked against the pool)."""
        self.cpu_tables = {seq_id: list(table) for seq_id, table in cpu_tables.items()}
        if self.cpu_pool is not None:  # without one, a CPU table failed the caller's range check
            self.cpu_pool.restore(dict(Counter(b for table in cpu_tables.values() for b in table)))

    def _cpu(self) -> BlockPool:
        if self.cpu_pool is None:
            raise NoFreeBlocksError("no CPU swap space (num_cpu_blocks is 0).")
        return self.cpu_pool


def _distinct(tables: dict[int, list[int]], seqs: list[Sequence]) -> dict[int, int]:
    """Distinct blocks of the sequences' tables (first-appearance order) -> how many of them hold it."""
    counts: Counter[int] = Counter()
    for seq in seqs:
        table = tables.get(seq.seq_id)
        if table is None:
            raise ValueError(f"seq {seq.seq_id} has no block table here.")
        counts.update(table)
    return counts


def _move(counts: dict[int, int], dst: BlockPool) -> dict[int, int]:
    """A block of dst per source block, ref counted like the source's holders."""
    mapping: dict[int, int] = {}
    for block_id, count in counts.items():
        new = dst.allocate()
        for _ in range(count - 1):
            dst.incref(new)
        mapping[block_id] = new
    return mapping
