"""Preemption policy: how a running group gives up its KV blocks (vLLM v0 semantics).

When a decode finds no free KV slot the Scheduler preempts the latest-arrived running group, in one of two ways:
- RECOMPUTE for a group with a single RUNNING sequence, or one whose RUNNING sequences are not all decoding (a
  pending-fork parent, a chunked re-prefill): its blocks are freed, its tokens kept, and it waits at the front
  of the waiting queue; once forked sequences have outputs they differ, so readmission prefills each one alone;
- SWAP, when a CPU swap space is configured (CacheConfig.num_cpu_blocks > 0; with 0 every preemption is a
  recompute), for a group with several RUNNING sequences, all decoding (forked, n > 1): its blocks move to CPU
  blocks (blocks_to_swap_out), its sequences become SWAPPED and the group joins the front of the swapped queue.
  Both kinds are reported in SchedulerOutput.preempted. With no room in the CPU swap space the group fails
  instead (SWAP_FAILED): FINISHED_IGNORED, freed, in swap_failed.

This module changes the group's sequences and blocks only; moving the group between queues stays with the
Scheduler, which owns them.
"""

from __future__ import annotations

import enum

from scheduler_service.core.block_manager import BlockManager
from scheduler_service.core.scheduler_output import SchedulerOutput
from scheduler_service.core.sequence import SequenceGroup, SequenceStatus


class Preemption(enum.Enum):
    """What preempt_group did to a group, so the caller knows where it goes next."""

    RECOMPUTE = enum.auto()  # KV dropped, tokens kept: to the front of the waiting queue
    SWAP = enum.auto()  # KV moved to CPU blocks: to the front of the swapped queue
    SWAP_FAILED = enum.auto()  # a swap with no CPU room: every sequence FINISHED_IGNORED, freed


def preempt_group(group: SequenceGroup, block_manager: BlockManager, out: SchedulerOutput) -> Preemption:
    """Preempt by swap (several sequences, all decoding, with a CPU pool) or else by recompute (module doc)."""
    running = group.get_seqs(SequenceStatus.RUNNING)
    if block_manager.num_cpu_blocks > 0 and len(running) > 1 and all(s.num_uncomputed_tokens == 1 for s in running):
        if not block_manager.can_swap_out(group):
            block_manager.finish_group(group, SequenceStatus.FINISHED_IGNORED)
            return Preemption.SWAP_FAILED
        out.blocks_to_swap_out.extend(block_manager.swap_out(group))
        for seq in running:
            seq.status = SequenceStatus.SWAPPED
        return Preemption.SWAP
    for seq in running:
        block_manager.free(seq)
        seq.reset_for_recompute()
    return Preemption.RECOMPUTE
