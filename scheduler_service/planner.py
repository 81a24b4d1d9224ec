"""Turns a SchedulerOutput into a protobuf StepPlan, sending deltas where it can.

The planner remembers, per sequence, how many block ids the worker already
has and the last of them. A sequence it has never sent (or has told the worker
to forget, after a recompute preemption) goes out in full; every other one as a
delta. Logical tables only grow (a sliding-window ring repeats its blocks
along the sequence), except that copy-on-write replaces the block being
written into, which is always the last one sent: comparing that one entry
finds every replacement.
"""

from __future__ import annotations

from typing import Protocol

from protos import common_pb2, worker_pb2
from scheduler_service.core.scheduler_output import SchedulerOutput
from scheduler_service.core.sequence import Sequence, SequenceGroup
from shared.sampling_params import seed_for_sequence
from shared.sampling_proto import sampling_to_proto


class BlockTables(Protocol):
    def logical_block_table(self, seq: Sequence) -> list[int]: ...


def sequence_sampling(group: SequenceGroup, seq: Sequence) -> common_pb2.SamplingParams:
    """The group's sampling parameters, with a seed of the sequence's own when the request is seeded."""
    msg = sampling_to_proto(group.sampling_params)
    if msg.HasField("seed") and len(group.seqs) > 1:
        index = next(i for i, s in enumerate(group.seqs) if s is seq)
        msg.seed = seed_for_sequence(msg.seed, index)
    return msg


class Planner:
    """Builds step plans for one worker."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self._step_id = 0
        # seq_id -> (number of block ids the worker has, the last of them)
        self._sent_blocks: dict[int, tuple[int, int]] = {}
        self._to_forget: list[int] = []

    def forget(self, seq_id: int) -> None:
        """The sequence finished or was preempted: the next plan tells the worker to drop it."""
        if self._sent_blocks.pop(seq_id, None) is not None:
            self._to_forget.append(seq_id)

    @property
    def last_step_id(self) -> int:
        """The step id of the last plan built in this epoch (0: none yet)."""
        return self._step_id

    def adopt(self, seq_id: int, table: list[int]) -> None:
        """The worker holds the sequence with this (logical) table already: it resumed it for a new owner."""
        self._sent_blocks[seq_id] = (len(table), table[-1] if table else -1)

    def reset(self, epoch: int) -> None:
        """After a worker Reset nothing is cached there any more."""
        self.epoch = epoch
        self._sent_blocks.clear()
        self._to_forget.clear()

    def build(self, out: SchedulerOutput, tables: BlockTables) -> worker_pb2.StepPlan:
        """One plan; `tables` gives each scheduled sequence's logical block table (read, never kept)."""
        self._step_id += 1
        plan = worker_pb2.StepPlan(epoch=self.epoch, step_id=self._step_id, finished_seq_ids=self._to_forget)
        self._to_forget = []
        for src, dst in out.blocks_to_swap_in:
            plan.swap_in.add(src=src, dst=dst)
        for src, dst in out.blocks_to_swap_out:
            plan.swap_out.add(src=src, dst=dst)
        for src, dst in out.blocks_to_copy:
            plan.copy.add(src=src, dst=dst)
        for item in out.scheduled:
            seq = item.seq
            table = tables.logical_block_table(seq)
            sent = self._sent_blocks.get(seq.seq_id)
            if sent is None:
                if seq.num_inflight_tokens:
                    # Its tokens go out in full: one not known yet would be missing (see Scheduler.advance).
                    raise RuntimeError(f"seq {seq.seq_id} is sent in full with a token still in flight")
                plan.new_sequences.add(
                    seq_id=seq.seq_id,
                    prompt_token_ids=seq.prompt_token_ids,
                    output_token_ids=seq.output_token_ids,
                    sampling=sequence_sampling(item.group, seq),
                    block_table=table,
                    num_computed_tokens=seq.num_computed_tokens,
                    num_new_tokens=item.num_new_tokens,
                )
            else:
                num_sent, last_sent = sent
                delta = plan.cached_sequences.add(
                    seq_id=seq.seq_id, new_block_ids=table[num_sent:], num_new_tokens=item.num_new_tokens
                )
                if item.group.sampling_params.use_beam_search and seq.output_token_ids:
                    # The beam may go on with another candidate than the worker's own sample.
                    delta.last_token_id = seq.last_token_id
                if num_sent and table[num_sent - 1] != last_sent:
                    delta.replaced_blocks[num_sent - 1] = table[num_sent - 1]
            self._sent_blocks[seq.seq_id] = (len(table), table[-1] if table else -1)
        return plan
