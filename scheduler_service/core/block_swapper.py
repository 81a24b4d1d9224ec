"""Swap preemption: moving groups' block tables between device blocks and a CPU pool."""

from __future__ import annotations

from scheduler_service.core.block_admission import AllocStatus, alloc_status
from scheduler_service.core.block_allocator import BlockAllocator, NoFreeBlocksError
from scheduler_service.core.device_block_tables import DeviceBlockTables
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus


class BlockSwapper:
    """The CPU block pool and the tables of swapped-out sequences.

    swap_out() moves a group's running sequences to CPU blocks
    (cpu_block_tables, a plain ref-counted allocator without prefix caching),
    swap_in() moves them back into fresh device blocks. Swapped-in blocks are
    never registered in the prefix cache again (the sequences lose their hash
    bookkeeping on swap-out).

    device is the BlockManager's own tables, shared, not copied: the swapper
    moves tables out of and back into it. Swapping in keeps the device's
    watermark_blocks free, like admission.
    """

    def __init__(self, num_cpu_blocks: int, device: DeviceBlockTables) -> None:
        self.cpu_allocator: BlockAllocator | None = BlockAllocator(num_cpu_blocks) if num_cpu_blocks else None
        # seq_id -> CPU block ids of a swapped-out sequence, in token order.
        self.cpu_block_tables: dict[int, list[int]] = {}
        self._device = device

    @property
    def num_cpu_blocks(self) -> int:
        """Blocks in the CPU pool (0: no swap space, every preemption recomputes)."""
        return 0 if self.cpu_allocator is None else self.cpu_allocator.num_blocks

    def can_swap_out(self, group: SequenceGroup) -> bool:
        """Whether the CPU pool has a block for each distinct device block of the group's RUNNING sequences."""
        needed = len(self._distinct(self._device.block_tables, group.get_seqs(SequenceStatus.RUNNING)))
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
        counts = self._distinct(self._device.block_tables, seqs)
        if len(counts) > self.num_free_cpu_blocks:
            raise NoFreeBlocksError(
                f"request {group.request_id!r} needs {len(counts)} CPU blocks, {self.num_free_cpu_blocks} free."
            )
        mapping = self._move(counts, self._cpu())
        self._device.tick()
        for seq in seqs:
            table = self._device.take_table(seq.seq_id)
            self.cpu_block_tables[seq.seq_id] = [mapping[b] for b in table]
            for block_id in table:
                self._device.gpu_allocator.free(block_id)
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
        device = self._device
        return alloc_status(
            needed, needed, device.num_gpu_blocks, device.gpu_allocator.num_free_blocks, device.watermark_blocks
        )

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's SWAPPED sequences back to fresh device blocks; returns (cpu, device) pairs.

        Frees the CPU blocks. The device blocks are unhashed (never reused by
        the prefix cache). Sequence statuses are left to the caller.
        """
        seqs = group.get_seqs(SequenceStatus.SWAPPED)
        counts = self._distinct(self.cpu_block_tables, seqs)
        gpu_allocator = self._device.gpu_allocator
        if len(counts) > gpu_allocator.num_free_blocks:
            raise NoFreeBlocksError(
                f"request {group.request_id!r} needs {len(counts)} blocks, {gpu_allocator.num_free_blocks} free."
            )
        self._device.tick()
        mapping = self._move(counts, gpu_allocator)
        cpu = self._cpu()
        for seq in seqs:
            table = self.cpu_block_tables.pop(seq.seq_id)
            self._device.put_table(seq.seq_id, [mapping[b] for b in table])
            for block_id in table:
                cpu.free(block_id)
        return list(mapping.items())

    def free(self, seq: Sequence) -> None:
        """Release a swapped-out sequence's CPU blocks; a no-op for any other sequence."""
        cpu_table = self.cpu_block_tables.pop(seq.seq_id, None)
        if cpu_table is not None:
            cpu = self._cpu()
            for block_id in cpu_table:
                cpu.free(block_id)

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
