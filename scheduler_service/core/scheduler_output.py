"""What one scheduling step asks the workers (and the engine loop) to do."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_service.core.sequence import Sequence, SequenceGroup


@dataclass
class TableUpdate:
    """What the worker learns of a sequence's logical block table in one step (BlockManager.take_table_update).

    in_full: block_ids is the whole table (the worker has never seen it: a new, recomputed, forked or swapped-in
        sequence; the plan sends the sequence in full). Otherwise block_ids are the entries appended from logical
        index `start` on, and replaced the entries before `start` that copy-on-write gave a new block.
    """

    block_ids: list[int]
    in_full: bool = False
    start: int = 0
    replaced: dict[int, int] = field(default_factory=dict)


@dataclass
class ScheduledSequence:
    """One sequence in a step: compute tokens [num_computed_tokens, num_computed_tokens + num_new_tokens) of it.

    num_computed_tokens and num_tokens are snapshots taken when the step was planned, so is_prefill and samples
    keep their meaning after update_after_step mutates seq. table: what the worker learns of the sequence's
    block table, set by schedule() once every slot of the step is reserved.
    """

    group: SequenceGroup
    seq: Sequence
    num_new_tokens: int
    num_computed_tokens: int = field(init=False)
    num_tokens: int = field(init=False)
    table: TableUpdate | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.num_computed_tokens = self.seq.num_computed_tokens
        self.num_tokens = self.seq.num_tokens
        if not 1 <= self.num_new_tokens <= self.num_tokens - self.num_computed_tokens:
            raise ValueError(
                f"num_new_tokens must be in [1, {self.num_tokens - self.num_computed_tokens}] for seq "
                f"{self.seq.seq_id}, got {self.num_new_tokens}."
            )

    @classmethod
    def as_planned(cls, group: SequenceGroup, seq: Sequence, num_new_tokens: int, num_computed_tokens: int,
                   num_tokens: int) -> ScheduledSequence:
        """The entry of a step planned before seq's counts moved on (a restored step in flight)."""
        item = cls.__new__(cls)
        item.group, item.seq, item.num_new_tokens, item.table = group, seq, num_new_tokens, None
        item.num_computed_tokens, item.num_tokens = num_computed_tokens, num_tokens
        return item

    @property
    def is_prefill(self) -> bool:
        """True for prompt (or recompute) processing rather than a single decode."""
        return self.num_new_tokens > 1 or self.num_computed_tokens < len(self.seq.prompt_token_ids)

    @property
    def samples(self) -> bool:
        """True when the step reaches the last known token, so a token is sampled."""
        return self.num_computed_tokens + self.num_new_tokens == self.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The token ids this step feeds to the model for this sequence."""
        start = self.num_computed_tokens
        return self.seq.all_token_ids[start : start + self.num_new_tokens]


@dataclass
class SchedulerOutput:
    """The plan of one step.

    scheduled: sequences to compute, prefills and decodes mixed, FCFS order.
    preempted: groups whose sequences the worker must forget (drop its per-sequence state and cached block
        table). Recompute ones are WAITING again and come back with num_computed_tokens 0; swapped ones (status
        SWAPPED, their blocks in blocks_to_swap_out) come back, in a later step, with their KV moved back
        (blocks_to_swap_in), a completely new block table and num_computed_tokens kept: the engine re-sends
        them in full, like sequences it has never seen.
    ignored: groups that can never run (too long); already FINISHED_IGNORED and forgotten by the scheduler, the
        engine must report them.
    swap_failed: groups that had to be preempted by swap but found no room in the CPU swap space; already
        FINISHED_IGNORED, freed and forgotten by the scheduler. The engine must end them with an error ("out of
        CPU swap space") and make the worker forget their sequences.
    blocks_to_swap_out: (device block, cpu block) pairs, copy device -> host.
    blocks_to_swap_in: (cpu block, device block) pairs, copy host -> device.
    blocks_to_copy: (src, dst) device copy-on-write pairs (the first decodes after a parallel-sampling fork or
        after a swap-in). The worker applies the pairs before the forward pass in this order: swap_out,
        swap_in, copy. A step never has both swap_out and swap_in pairs.
    num_batched_tokens: sum of num_new_tokens over scheduled.
    released_seq_ids: sequences whose KV left the device since the last schedule() (finished, aborted,
        preempted, swapped out, dropped beams): the worker forgets them before this step.
    """

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    ignored: list[SequenceGroup] = field(default_factory=list)
    swap_failed: list[SequenceGroup] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    num_batched_tokens: int = 0
    released_seq_ids: list[int] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens computed this step (the rest of num_batched_tokens: one per decoding sequence)."""
        return sum(s.num_new_tokens for s in self.scheduled if s.is_prefill)

    @property
    def is_empty(self) -> bool:
        """True when the workers have nothing to do this step (ignored, swap_failed and preempted groups may
        still need the engine's attention)."""
        return not (self.scheduled or self.blocks_to_swap_in or self.blocks_to_swap_out or self.blocks_to_copy)
