"""Forking a parallel-sampling group, and the slot order that copies shared blocks on write.

Parallel sampling (a group of n sequences with one prompt) computes the prompt once by forking before the last
prompt token:
- admission gives only the parent (the group's first unfinished sequence) a block table; the other sequences
  stay WAITING without one (pending fork);
- the parent prefills prompt_len - 1 tokens (chunks are capped there) and samples nothing;
- in the first schedule() that finds those tokens computed and schedules the group (at admission already when
  prompt_len is 1 or prefix-cache hits cover them), the scheduler forks: each other sequence gets a copy of the
  parent's table (every block shared, ref counted) and its num_computed_tokens, and becomes RUNNING. All n
  sequences are scheduled in that same step as 1-token decodes of the last prompt token, each sampling its own
  first token: the children append first and copy the shared last block on write (blocks_to_copy), the parent
  appends last and writes into it in place. A group whose n decodes do not fit a step (token budget) waits
  unforked, like any decode.
The worker sees nothing new: a child is a sequence it has never seen, sent in full with num_computed_tokens =
prompt_len - 1.
"""

from __future__ import annotations

from scheduler_service.core.block_manager import BlockManager
from scheduler_service.core.scheduler_output import ScheduledSequence, SchedulerOutput
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus
from scheduler_service.core.token_budget import tokens_before_fork


def fork_if_ready(group: SequenceGroup, block_manager: BlockManager) -> bool:
    """Fork the pending sequences from a parent that computed all but its last prompt token; True if it did."""
    pending = group.pending_fork_seqs()
    if not pending:
        return False
    (parent,) = group.get_seqs(SequenceStatus.RUNNING)
    if tokens_before_fork(parent, parent.num_computed_tokens) > 0:
        return False
    for child in pending:
        block_manager.fork(parent, child)
        child.status = SequenceStatus.RUNNING
    return True


def add_decodes(
    out: SchedulerOutput, group: SequenceGroup, block_manager: BlockManager, items: list[tuple[Sequence, int]]
) -> None:
    """Give each sequence its next slot (copy-on-write included) and schedule it.

    The children append before the parent (the first sequence), so right after a fork each child copies the
    shared last block and the parent, last, writes into it in place: the worker already has its table.
    """
    for seq, _ in items[1:] + items[:1]:
        cow = block_manager.append_slot(seq)
        if cow is not None:
            out.blocks_to_copy.append(cow)
    for seq, num_new in items:
        out.scheduled.append(ScheduledSequence(group, seq, num_new))
